"""What a drafter can accept at T > 0 on held-out prompts: the per-slot ceilings (`dflashkit.infer.ceilings`).

For each temperature: E[max p_T] per slot (the argmax chain's ceiling), each proposal's conditional acceptance
per slot (argmax: p_T of the drafter's top token; marginal: sum_x min(p_T, q)), the target's mass on the
drafter's top-k tokens of a slot (a tree's ceiling with k children, k = 1..4), and the tokens a round expects
from each chain and from a tree of 15: exact from the two distributions, at the rounds of a decode at that
temperature on the reference engine. Runs on the CPU with the embedded target and the drafter in git:

    dflashkit prepare -c HELDOUT.yaml        # a dataset whose validation split holds the held-out records
    python benchmarks/ceilings.py --drafter benchmarks/drafters/embedded-gpu-more --data DIR \\
        --prompts 8 --temperatures 0.7,1 --max-new-tokens 128 --out benchmarks/results/ceilings.json

``--data mtbench`` takes MT-Bench's first turns instead (evenly spaced, the chat template applied): no dataset
to prepare. The expected tokens include a recursive tree of 15 (``tree15_recursive``, `infer/recursive.py`).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", default="benchmarks/drafters/embedded-gpu-more")
    p.add_argument(
        "--data",
        required=True,
        help="a dataset folder (its held-out, validation, records' prompts), or mtbench (its first turns)",
    )
    p.add_argument("--prompts", type=int, default=8, help="held-out records, spread evenly (default 8)")
    p.add_argument("--temperatures", default="0.7,1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, help="measure the first N drafted slots only (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args()

    from dflashkit.infer.bench import _write_json, heldout_set
    from dflashkit.infer.ceilings import TOP_K, measure
    from dflashkit.infer.sampling import Sampling
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.target.hf import TargetModel

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    target = TargetModel.load("embedded", dtype=dtype, device=device)
    drafter = load_drafter(args.drafter, target, dtype=dtype, device=device, verify=False).eval()
    if args.data == "mtbench":
        from dflashkit.data.chat import generation_prompt_ids
        from dflashkit.data.sources import read_mtbench
        from dflashkit.target.tokenizer import serving_tokenizer

        tokenizer, questions = serving_tokenizer(target.path), read_mtbench()
        chosen = questions[:: max(1, len(questions) // args.prompts)][: args.prompts]
        prompts = [
            generation_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}], enable_thinking=False)
            for q in chosen
        ]
        source = f"mtbench: first turns of {len(prompts)} questions, every {max(1, len(questions) // args.prompts)}th"
    else:
        held = heldout_set(args.data, args.prompts, max_turns=1)
        prompts = [list(c.prefixes[0]) for c in held.conversations]
        source = held.source
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "device": args.device,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "block_size": drafter.config.block_size,
        "prompts": source,
        "max_new_tokens": args.max_new_tokens,
        "slots": args.slots,
        "temperatures": {},
    }
    for t in (float(x) for x in args.temperatures.split(",")):
        s = Sampling(t, args.top_p, seed=args.seed)
        fig = measure(target, drafter, prompts, s, args.max_new_tokens, slots=args.slots)
        record["temperatures"][f"{t:g}"] = fig
        print(
            f"T={t:g}: {fig['rounds']} rounds over {len(prompts)} prompts; expected tokens a round:",
            ", ".join(f"{k} {v:.3f}" for k, v in fig["expected_tokens"].items()),
            f"-> {fig['draft_sampling']}",
        )
        rows = [
            ("E[max p]", fig["max_p"]),
            ("argmax", fig["argmax_acceptance"]),
            ("marginal", fig["marginal_acceptance"]),
        ]
        rows += [(f"top-{k} mass", fig["top_k_mass"][str(k)]) for k in range(1, TOP_K + 1)]
        print("  slot        " + " ".join(f"{k:>6d}" for k in range(1, len(fig["max_p"]) + 1)))
        for name, values in rows:
            print(f"  {name:<12}" + " ".join(f"{v:6.3f}" for v in values))
        if args.out:  # after each temperature: a long run keeps what it measured
            _write_json(args.out, record)
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Does a sharper or flatter drafter distribution build better trees? Served tau against the build's temperature
and a per-depth discount.

A tree's nodes are the drafter's best branches by the product of its per-slot probabilities
(``dflashkit.infer.tree.build_tree``). Those are the drafter's marginals for each slot, not the chance that the
target accepts a branch, so a temperature on them (scores from ``p ** (1 / T)``, renormalised per slot) could
rank branches better: a flatter one (T > 1) widens the tree, a sharper one (T < 1) deepens it. A discount g
multiplies every slot's probabilities (a branch of depth k scores g ** k more): g < 1 widens the tree at its
shallow slots, where the target accepts more often than deep ones (the served per-slot acceptance falls with
depth faster than the drafter's own probabilities, ``bench``'s per_position_acceptance). This decodes one
prompt set greedily with trees of one budget at each (temperature, discount) (and the chain, for the gain), through
``dflashkit bench`` with no autoregressive pass, and prints tau for each. The engine's build is wrapped here
only; the served code is unchanged.

    python benchmarks/tree_build_temperature.py --drafter benchmarks/drafters/embedded-gpu-more \\
        --build-temperatures 0.7,1,1.5,2,3 --budget 15 --max-prompts 16 --max-new-tokens 128
    python benchmarks/tree_build_temperature.py --drafter benchmarks/drafters/embedded-gpu-more \
        --build-temperatures 1 --depth-discounts 0.6,0.8,1,1.25
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--set", default="mtbench")
    p.add_argument("--build-temperatures", default="0.7,1,1.5,2,3")
    p.add_argument("--depth-discounts", default="1", help="g: every slot's probabilities times g")
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--max-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, help="write the taus as JSON here")
    args = p.parse_args()

    from dflashkit import cli
    from dflashkit.infer import bench, graph_engine

    build = graph_engine.build_tree
    temperature = {"T": 1.0, "g": 1.0}

    def tempered(anchor, probs, budget, candidates=None):  # scores from p ** (1/T), renormalised per slot
        if temperature["T"] != 1.0:
            probs = torch.softmax(probs.float().clamp_min(1e-30).log() / temperature["T"], dim=-1)
        if temperature["g"] != 1.0:
            probs = probs.float() * temperature["g"]  # a branch of depth k: g ** k
        return build(anchor, probs, budget, candidates)

    graph_engine.build_tree = tempered
    bench.decode_set = functools.partial(bench.decode_set, baseline=False)  # tau only
    runs = [("chain", 1.0, 1.0, 0)] + [
        (f"tree-{args.budget} T={t}" + (f" g={g}" if float(g) != 1 else ""), float(t), float(g), args.budget)
        for t in args.build_temperatures.split(",")
        for g in args.depth_discounts.split(",")
    ]
    rows = []
    for name, t, g, budget in runs:
        temperature["T"], temperature["g"] = t, g
        with tempfile.TemporaryDirectory() as out:
            argv = [
                "bench",
                "--drafter",
                args.drafter,
                "--sets",
                args.set,
                "--out",
                out,
                "--temperatures",
                "0",
            ]
            argv += ["--max-prompts", str(args.max_prompts), "--max-turns", "1", "--dtype", args.dtype]
            argv += ["--max-new-tokens", str(args.max_new_tokens), "--tree-budget", str(budget)]
            cli.main(argv)
            result = json.loads(next(Path(out, "sets").glob("*.json")).read_text())["temperatures"]["0"]
        rows.append(
            {"run": name, "build_temperature": t, "depth_discount": g, "budget": budget, "tau": result["tau"]}
        )
        print(f"{name:26s} tau {result['tau']:.3f} ({result['rounds']} rounds)", flush=True)
    chain = rows[0]["tau"]
    for r in rows[1:]:
        r["gain_over_chain"] = r["tau"] / chain - 1
        print(f"{r['run']:26s} tau {r['tau']:.3f}  {r['gain_over_chain']:+.1%} over the chain")
    if args.out:
        args.out.write_text(json.dumps({"set": args.set, "dtype": args.dtype, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

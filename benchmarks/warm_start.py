"""Warm start of the compiled graphs engine: compiled steps from the portable compile cache vs precompiled steps.

Each case is a fresh process (interpreter, imports, target load, engine, warm-up and the first token), run
one after another on a random target of the chosen shape and a random drafter:

  compile, cold            precompile off, empty Inductor cache, no compile cache (fills both)
  compile, warm local      the same caches again (this machine's Inductor cache and the portable file)
  compile, warm file       an empty Inductor cache and the portable file only (a fresh machine)
  precompile, cold         precompile on: the chain steps precompiled and written beside a new cache file
  precompile, warm local   loaded whole, this machine's Inductor cache as left by the cold case
  precompile, warm file    loaded whole into an empty Inductor cache (a fresh machine)

    python benchmarks/warm_start.py --shape smollm2-135m --out /tmp/warm-start     # CPU: fp32, ~6 minutes
    python benchmarks/warm_start.py --dtype bfloat16                                 # GPU: bf16, captured
    python benchmarks/warm_start.py --engines graphs-fused,graphs-layers --cases compile
                        # the whole-step compile against one decoder layer compiled, the compile cases only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import TARGET_SHAPES, make_target  # noqa: E402  (the random target)
from report import print_result, run_child, write_report  # noqa: E402

# (label, precompile, Inductor cache folder, compile cache file): folders and files by name, under the run's
# temporary folder; a name used twice is the same cache, so a later case finds what an earlier one left
CASES = [
    ("compile, cold", False, "inductor-a", "compile/graphs.cache"),
    ("compile, warm local", False, "inductor-a", "compile/graphs.cache"),
    ("compile, warm file", False, "inductor-b", "compile/graphs.cache"),
    ("precompile, cold", True, "inductor-c", "precompile/graphs.cache"),
    ("precompile, warm local", True, "inductor-c", "precompile/graphs.cache"),
    ("precompile, warm file", True, "inductor-d", "precompile/graphs.cache"),
]


def child(args: argparse.Namespace) -> dict:
    """One fresh process: load, build the engine around the caches, warm up, decode the first token."""
    import torch

    imported_torch = time.time()
    from decode_steps import load_models  # the random target saved in the folder, a random drafter
    from dflashkit.infer.graph_engine import GraphEngine
    from dflashkit.infer.speculative import autoregressive_generate

    imported = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=device)  # the CUDA context
    device_ready = time.time()
    target, drafter = load_models(Path(args.target_folder), args.dtype, args, device)
    loaded = time.time()
    t0 = time.perf_counter()
    from dflashkit.infer.engine import GRAPH_ENGINES

    engine = GraphEngine(
        target,
        drafter,
        capacity=args.capacity,
        compile=GRAPH_ENGINES[args.engine],
        compile_cache=args.cache,
        precompile=args.precompile == "on",
    )
    with torch.no_grad():
        warm = engine.warm_up()
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, target.vocab_size - 1, (64,), generator=g).tolist()
        autoregressive_generate(target, prompt, 1, layer_ids=drafter.config.target_layer_ids, engine=engine)
    if device.type == "cuda":
        torch.cuda.synchronize()
    now = time.time()
    return {
        "process_to_first_token_seconds": now - args.spawned_at,
        "before_engine_seconds": loaded - args.spawned_at,
        # what goes before the engine: the interpreter and torch, the rest of the imports (transformers and
        # ours), the CUDA context, the two models loaded and moved
        "before_engine_parts": {
            "interpreter and torch": imported_torch - args.spawned_at,
            "other imports": imported - imported_torch,
            "device": device_ready - imported,
            "models": loaded - device_ready,
        },
        "engine_to_first_token_seconds": time.perf_counter() - t0,
        "warmup_seconds": dict(warm),
        "graphs_compiled": warm.compiled,
        "graphs_from_cache": warm.cached,
        "steps_precompiled_loaded": warm.precompiled_loaded,
        "steps_precompiled_built": warm.precompiled_built,
        "notes": warm.notes,
        "device": device.type,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--target-layers", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=400)
    ap.add_argument("--timeout", type=float, default=900, help="seconds a case may take")
    ap.add_argument("--out", help="folder for warm_start.json")
    ap.add_argument(
        "--engines",
        default="graphs-compiled",
        help="compiling graphs engines, one after another (comma-separated)",
    )
    ap.add_argument(
        "--cases", choices=["all", "compile"], default="all", help="compile: the first three cases"
    )
    # a case's child (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target-folder", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--precompile", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="graphs-compiled", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print_result(child(args))
        return
    import torch

    on_gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    rows = []
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        folder = make_target(args.shape, Path(tmp) / "target", args.dtype, device="cuda" if on_gpu else "cpu")
        cases = [
            (e, *case)
            for e in args.engines.split(",")
            for case in CASES
            if args.cases == "all" or not case[1]
        ]
        for engine, label, precompile, inductor, cache in cases:
            if engine != "graphs-compiled":  # each engine its own caches
                label, inductor, cache = f"{engine}: {label}", f"{engine}-{inductor}", f"{engine}/{cache}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--target-folder", str(folder)]
            cmd += ["--cache", str(Path(tmp) / cache), "--precompile", "on" if precompile else "off"]
            cmd += ["--engine", engine]
            cmd += ["--dtype", args.dtype, "--layers", str(args.layers), "--block", str(args.block)]
            cmd += ["--target-layers", str(args.target_layers), "--capacity", str(args.capacity)]
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / inductor)}
            out = run_child([*cmd, "--spawned-at", repr(time.time())], env, args.timeout)
            rows.append({"case": label, **out})
            print(f"{label}: {out}", flush=True)
    print()
    print(
        f"{'case':40} {'process s':>9} {'engine s':>9} {'before s':>9} {'loaded':>6} {'built':>6}  steps (s)"
    )
    for r in rows:
        if "errors" in r:
            print(f"{r['case']:40} {r['errors']}")
            continue
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["warmup_seconds"].items())
        steps += "; before: " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("before_engine_parts", {}).items())
        print(
            f"{r['case']:40} {r['process_to_first_token_seconds']:9.1f} {r['engine_to_first_token_seconds']:9.1f} "
            f"{r['before_engine_seconds']:9.1f} {r['steps_precompiled_loaded']:6d} "
            f"{r['steps_precompiled_built']:6d}  {steps}"
        )
    report = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name() if on_gpu else None,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "rows": rows,
    }
    write_report("warm_start.json", report, args.out)


if __name__ == "__main__":
    main()

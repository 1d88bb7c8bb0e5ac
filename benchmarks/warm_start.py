"""Warm start of the compiled graphs engine: compiled steps from the portable compile cache vs precompiled steps.

Each case is a fresh process (interpreter, imports, target load, engine, warm-up and the first token), run
one after another on a random target of the chosen shape and a random drafter:

  compile, cold            precompile off, empty Inductor cache, no compile cache (fills both)
  compile, warm local      the same caches again (this machine's Inductor cache and the portable file)
  compile, warm file       an empty Inductor cache and the portable file only (a fresh machine)
  compile, warm file, target model   the same, the target loaded through transformers' model (as before the
                           serving commands read its weights file alone: `TargetModel.load(lazy=True)`)
  precompile, cold         precompile on: the chain steps precompiled and written beside a new cache file
  precompile, warm local   loaded whole, this machine's Inductor cache as left by the cold case
  precompile, warm file    loaded whole into an empty Inductor cache (a fresh machine)

    python benchmarks/warm_start.py --shape smollm2-135m --out /tmp/warm-start     # CPU: fp32, ~6 minutes
    python benchmarks/warm_start.py --dtype bfloat16                                 # GPU: bf16, captured
    python benchmarks/warm_start.py --engines graphs-compiled,graphs-layers --cases compile
                        # the whole-step compile against one decoder layer compiled, the compile cases only
    python benchmarks/warm_start.py --from benchmarks/results/warm_start-layers-gpu-s17.json --update-results
                        # a run's file (measured on the GPU) into benchmarks/results/decode_steps.json

``--update-results`` writes the issue's ``warm_start_s`` (process to first token, the portable file alone: a
fresh machine) and a ``warm_start`` block (cold and warm, engine and process, per step shape) into
``benchmarks/results/decode_steps.json``, for the engine that file's summary names (``summary_engine``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import TARGET_SHAPES, make_target  # noqa: E402  (the random target)
from report import print_result, run_child, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "decode_steps.json"

# (label, precompile, Inductor cache folder, compile cache file): folders and files by name, under the run's
# temporary folder; a name used twice is the same cache, so a later case finds what an earlier one left
# and whether the target loads as the serving commands load it (lazy: its weights file alone) or through
# transformers' model (as before the twenty-first session), side by side on the portable file alone
CASES = [
    ("compile, cold", False, "inductor-a", "compile/graphs.cache", "lazy"),
    ("compile, warm local", False, "inductor-a", "compile/graphs.cache", "lazy"),
    ("compile, warm file", False, "inductor-b", "compile/graphs.cache", "lazy"),
    ("compile, warm file, target model", False, "inductor-e", "compile/graphs.cache", "model"),
    ("precompile, cold", True, "inductor-c", "precompile/graphs.cache", "lazy"),
    ("precompile, warm local", True, "inductor-c", "precompile/graphs.cache", "lazy"),
    ("precompile, warm file", True, "inductor-d", "precompile/graphs.cache", "lazy"),
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
    models: dict[str, float] = {}
    target, drafter = load_models(
        Path(args.target_folder), args.dtype, args, device, models, lazy=args.target_load == "lazy"
    )
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
            # of which: the target's load (lazy: its weights file read; model: transformers' from_pretrained,
            # its model code imported on first use) and the drafter built and moved
            "target load": models["target"],
            "drafter": models["drafter"],
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
        "--cases",
        choices=["all", "compile"],
        default="all",
        help="compile: the compile cases (no precompile)",
    )
    ap.add_argument(
        "--from", dest="from_file", help="a warm_start.json of an earlier run: report it, measure nothing"
    )
    ap.add_argument(
        "--update-results",
        action="store_true",
        help="write warm_start_s and the warm_start block into " + str(RESULTS),
    )
    # a case's child (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target-folder", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--precompile", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="graphs-compiled", help=argparse.SUPPRESS)
    ap.add_argument("--target-load", choices=["lazy", "model"], default="lazy", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print_result(child(args))
        return
    if args.from_file:
        report = json.loads(Path(args.from_file).read_text())
        print_table(report["rows"])
        if args.update_results:
            update_results(report, args.from_file)
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
        for engine, label, precompile, inductor, cache, target_load in cases:
            if engine != "graphs-compiled":  # each engine its own caches
                label, inductor, cache = f"{engine}: {label}", f"{engine}-{inductor}", f"{engine}/{cache}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--target-folder", str(folder)]
            cmd += ["--cache", str(Path(tmp) / cache), "--precompile", "on" if precompile else "off"]
            cmd += ["--engine", engine, "--target-load", target_load]
            cmd += ["--dtype", args.dtype, "--layers", str(args.layers), "--block", str(args.block)]
            cmd += ["--target-layers", str(args.target_layers), "--capacity", str(args.capacity)]
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / inductor)}
            out = run_child([*cmd, "--spawned-at", repr(time.time())], env, args.timeout)
            rows.append({"case": label, **out})
            print(f"{label}: {out}", flush=True)
    report = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name() if on_gpu else None,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "rows": rows,
    }
    print_table(rows)
    path = write_report("warm_start.json", report, args.out)
    if args.update_results:
        update_results(report, str(path) if path else "this run")


def print_table(rows: list[dict]) -> None:
    print()
    print(
        f"{'case':52} {'process s':>9} {'engine s':>9} {'before s':>9} {'loaded':>6} {'built':>6}  steps (s)"
    )
    for r in rows:
        if "errors" in r:
            print(f"{r['case']:52} {r['errors']}")
            continue
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["warmup_seconds"].items())
        steps += "; before: " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("before_engine_parts", {}).items())
        print(
            f"{r['case']:52} {r['process_to_first_token_seconds']:9.1f} {r['engine_to_first_token_seconds']:9.1f} "
            f"{r['before_engine_seconds']:9.1f} {r['steps_precompiled_loaded']:6d} "
            f"{r['steps_precompiled_built']:6d}  {steps}"
        )


def update_results(report: dict, source: str) -> None:
    """``warm_start_s`` and the ``warm_start`` block of the results file, for its summary's engine: the
    compile cases (cold; warm with the portable file alone) of that engine in ``report``. Refused (the file
    left alone) when the report lacks them or was not measured on a GPU."""
    results = json.loads(RESULTS.read_text())
    engine = results.get("summary_engine")
    prefix = "" if engine == "graphs-compiled" else f"{engine}: "
    cases = {r["case"]: r for r in report["rows"] if "errors" not in r}
    cold, warm = cases.get(f"{prefix}compile, cold"), cases.get(f"{prefix}compile, warm file")
    if report.get("device") != "cuda" or cold is None or warm is None:
        sys.exit(f"--update-results: {source} has no GPU compile cases of {engine} (the summary's engine)")
    results["warm_start_s"] = warm["process_to_first_token_seconds"]
    results["warm_start"] = {
        "engine": engine,
        "source": source,
        "gpu": report.get("gpu"),
        "torch": report.get("torch"),
        "cold_process_s": cold["process_to_first_token_seconds"],
        "cold_engine_s": cold["engine_to_first_token_seconds"],
        "cold_steps_s": cold["warmup_seconds"],
        "warm_file_process_s": warm["process_to_first_token_seconds"],
        "warm_file_engine_s": warm["engine_to_first_token_seconds"],
        "warm_file_steps_s": warm["warmup_seconds"],
        "warm_file_before_engine": warm.get("before_engine_parts"),
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{RESULTS}: warm_start_s {results['warm_start_s']:.1f} ({engine}, the portable file alone)")


if __name__ == "__main__":
    main()

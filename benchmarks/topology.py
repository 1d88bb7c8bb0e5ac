"""The 8-GPU fan-out topology, counted: target workers on GPUs 0-4 (one copy each of a Qwen3-8B-shaped target),
three drafter variants on GPUs 5, 6 and 7, all threads of one process; compiled flex attention; each run a
fresh subprocess with a fresh (cold) compile cache.

The drafters: b16-l1 (block 16, one layer), b16-l2 (block 16, two layers), b8-lr3e-4 (block 8, lr 3e-4),
each reading 5 target layers; rows of --max-len tokens with --anchors blocks each (the paper's 3072 and 512
by default), --steps steps. The target has random weights (transformers from_config, nothing to download):
the driver builds it once straight on cuda:0 (random initialisation of 8B weights takes seconds there and
minutes on the CPU) and saves it to a local folder; every run then loads its copies from that folder
(`TargetModel.load` per device, as `dflashkit fanout` does, out of the page cache after the first), so a
run's start-up is what a user's is. The data are random tokens.

Runs: --reps repetitions of the full topology (all target workers), and the scaling sweep: one run (or
--sweep-reps) with each smaller number of workers (--sweep, default 1 .. all but one), interleaved with the
repetitions so that a --budget-s cut leaves a balanced picture. Each run counts drafter errors, dense
fall-backs and compiles after warm-up (benchmarks/fanout.py's counting), and measures each drafter's steady
steps/s on its GPU, each target worker's utilisation (busy seconds / training seconds), the stream's
micro-batches/s and the start-up: process start to the fan-out call (interpreter, imports), set-up (target
copies, drafters, held-out features), warm-up (compiles) and the first step. With --parallel > 1 runs
share the GPUs, which skews the throughput and start-up figures (the counts stay valid). --set KEY=VALUE
adds a config override to every run (e.g. train.compile=off: only the attention compiled).

    python benchmarks/topology.py                    # 8 GPUs: 10 repetitions with 5 workers + sweep 1..4
    python benchmarks/topology.py --gpus 2           # 2 GPUs: workers on cuda:0, cuda:1; drafters on cuda:1
    python benchmarks/topology.py --smoke            # CPU: a tiny target, sdpa, 2 workers, under a minute

It prints a table and writes JSON to $OUT/topology.json if OUT is set (after every run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fanout as bench  # noqa: E402  (benchmarks/fanout.py: target, data, counting, the child runner)
from report import fill_defaults, print_result, write_report  # noqa: E402

# (name, overrides of the base: block --block-size, 1 layer, lr 6e-4)
VARIANTS = (
    ("b16-l1", {}),
    ("b16-l2", {"drafter.layers": 2}),
    ("b8-lr3e-4", {"drafter.block_size": 8, "train.lr": 3.0e-4}),
)
TARGET_LAYERS = 5  # as the paper's Qwen3-8B drafter: layers [1, 9, 17, 25, 33]


# --------------------------------------------------------------------------------------------------
# Placement


def max_workers(gpus: int, smoke: bool) -> int:
    """Target workers of the full topology: every GPU but the drafters' three (at least 4 GPUs), else
    every GPU, the last one beside the drafters; 2 on the CPU."""
    if smoke:
        return 2
    return gpus - 3 if gpus >= 4 else gpus


def layout(gpus: int, workers: int, smoke: bool) -> tuple[list[str], list[str]]:
    """(the target workers' devices, the three drafters' devices) with `workers` workers on `gpus` GPUs:
    the workers on cuda:0.., the drafters on the last three GPUs (or all on the last one, with fewer than
    4 GPUs)."""
    if smoke:
        return ["cpu"] * workers, ["cpu"] * len(VARIANTS)
    if gpus >= 4:
        drafters = [f"cuda:{g}" for g in range(gpus - len(VARIANTS), gpus)]
    else:
        drafters = [f"cuda:{gpus - 1}"] * len(VARIANTS)
    return [f"cuda:{i}" for i in range(workers)], drafters


# --------------------------------------------------------------------------------------------------
# One run (the child process)


def run_config(args: argparse.Namespace, out: Path, targets: list[str], drafters: list[str]):
    from dflashkit.config import load_config

    variants = ", ".join(
        f"{{name: {name}, overrides: {json.dumps(over)}, device: '{dev}'}}"
        for (name, over), dev in zip(VARIANTS, drafters, strict=True)
    )
    over = bench.base_overrides(args, out) | {
        "drafter.num_target_layers": TARGET_LAYERS,
        "fanout.target_devices": f"[{', '.join(targets)}]",
        "fanout.variants": f"[{variants}]",
    }
    return load_config(None, [f"{k}={v}" for k, v in over.items()] + args.set)


def first_step_s(metrics: Path) -> float | None:
    """Seconds from a drafter's training loop start to its first step's log line."""
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("seconds") is not None:
            return float(row["seconds"])
    return None


def startup(result, launched_at: float | None, called_at: float, firsts: list[float | None]) -> dict:
    """Where a run's time to its first step went."""
    setup = result.seconds - result.training_seconds - result.warmup_seconds
    first = min((f for f in firsts if f is not None), default=None)
    parts = {
        "process_to_fanout_s": round(called_at - launched_at, 2) if launched_at else None,
        "setup_s": round(setup, 2),  # target copies, drafters, held-out features, fingerprint
        "warmup_s": result.warmup_seconds,
        "first_step_s": first,
    }
    known = [v for v in parts.values() if v is not None]
    parts["to_first_step_s"] = round(sum(known), 2) if len(known) == len(parts) else None
    return parts


def child(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    workers = int(args.child)
    targets, drafters = layout(args.gpus, workers, args.smoke)
    report: dict = {"workers": workers, "target_devices": targets, "drafter_devices": drafters}
    if not args.smoke and torch.cuda.device_count() < args.gpus:
        return report | {"skipped": f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}"}
    dense_warnings = bench.watch_dense_warnings()
    out = Path(tempfile.mkdtemp(prefix=f"topology-w{workers}-"))
    try:
        cfg = run_config(args, out / "fan", targets, drafters)
        called_at = time.time()
        result = bench.counted_fanout(cfg, args, report, dense_warnings)
        if result is not None:
            firsts = [first_step_s(Path(d.out_dir) / "metrics.jsonl") for d in result.drafters]
            launched = os.environ.get("BENCH_LAUNCHED_AT")
            report["startup"] = startup(result, float(launched) if launched else None, called_at, firsts)
            report["target_workers"] = [dataclasses.asdict(t) for t in result.target_workers]
            report["target_utilisation"] = round(
                statistics.mean(t.utilisation for t in result.target_workers), 3
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the drafters' checkpoints: GBs each at the 8B shape
    return report


# --------------------------------------------------------------------------------------------------
# The driver


def jobs(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(workers, rep) of every run: the repetitions of the full topology interleaved with the sweep."""
    full = [(args.workers, r) for r in range(args.reps)]
    sweep = [(w, r) for r in range(args.sweep_reps) for w in args.sweep_workers]
    out = []
    while full or sweep:
        for queue_ in (full, sweep):
            if queue_:
                out.append(queue_.pop(0))
    return out


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarize(runs: list[dict], worker_counts: list[int]) -> list[dict]:
    """One row per number of target workers: counts summed, figures the median of the runs."""
    rows = []
    for w in worker_counts:
        mine = [r for r in runs if r["workers"] == w and "skipped" not in r]
        failed = [r for r in mine if r.get("errors")]
        drafters = [d for r in mine for d in r.get("drafters", [])]
        names = [n for n, _ in VARIANTS]
        rows.append(
            {
                "workers": w,
                "runs": len(mine),
                "runs_with_error": len(failed),
                "errors": dict(Counter(m for r in failed for m in r["errors"].values()).most_common()),
                "dense_fallbacks": sum(r.get("dense_fallbacks", 0) for r in mine),
                "compiles_after_warmup": sum(r.get("compiles_after_warmup", 0) for r in mine),
                "median_steps_per_s": {
                    n: _median([d["steps_per_s"] for d in drafters if d["name"] == n]) for n in names
                },
                "drafter_devices": {n: d["device"] for n in names for d in drafters if d["name"] == n},
                "median_target_utilisation": _median([r.get("target_utilisation") for r in mine]),
                "median_stream_batches_per_s": _median([r.get("stream_batches_per_s") for r in mine]),
                "median_startup": {
                    k: _median([r["startup"][k] for r in mine if "startup" in r])
                    for k in ("process_to_fanout_s", "setup_s", "warmup_s", "first_step_s", "to_first_step_s")
                },
                "median_process_s": _median([r.get("process_s") for r in mine]),
            }
        )
    return rows


def print_table(rows: list[dict], parallel: int) -> None:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    print()
    print(
        f"{'workers':>7} {'runs':>4} {'w/ error':>8} {'dense':>5} {'compiles':>8} {'to 1st step s':>13} "
        f"{'set-up s':>8} {'warm-up s':>9} {'target util':>11} {'stream b/s':>10}  drafter steps/s"
    )
    for r in rows:
        s = r["median_startup"]
        steps = ", ".join(
            f"{n} {f(v)} ({r['drafter_devices'].get(n, '?')})" for n, v in r["median_steps_per_s"].items()
        )
        print(
            f"{r['workers']:>7} {r['runs']:>4} {r['runs_with_error']:>8} {r['dense_fallbacks']:>5} "
            f"{r['compiles_after_warmup']:>8} {f(s['to_first_step_s'], '.1f'):>13} "
            f"{f(s['setup_s'], '.1f'):>8} {f(s['warmup_s'], '.1f'):>9} "
            f"{f(r['median_target_utilisation']):>11} {f(r['median_stream_batches_per_s']):>10}  {steps}"
        )
        for msg, n in r["errors"].items():
            print(f"{r['workers']} workers: {n} x {msg}")
    print("(medians over the runs; errors, dense fall-backs and compiles after warm-up summed over all runs)")
    if parallel > 1:
        print(f"({parallel} runs at a time shared the devices: throughput and start-up figures are skewed)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, sdpa, a tiny random target, 2 workers")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs to use (default 8)")
    ap.add_argument("--workers", type=int, default=None, help="target workers of the full topology")
    ap.add_argument("--reps", type=int, default=None, help="runs of the full topology (default 10; smoke 1)")
    ap.add_argument("--sweep", default=None, help="worker counts of the sweep, comma-separated ('' none)")
    ap.add_argument("--sweep-reps", type=int, default=1, help="runs per sweep point")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (skews throughput if > 1)")
    ap.add_argument("--budget-s", type=float, default=480, help="start no new run after this")
    ap.add_argument("--timeout-s", type=int, default=None, help="per run (default 300; smoke 600)")
    ap.add_argument("--target", default=None, help=f"{', '.join(bench.TARGET_SHAPES)} (default qwen3-8b)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="the base variants' block (default 16)")
    ap.add_argument("--rows", type=int, default=64, help="random training rows")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads in each run")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--target-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke
    defaults = {
        "reps": 1 if smoke else 10,
        "timeout_s": 600 if smoke else 300,
        "target": "tiny" if smoke else "qwen3-8b",
        "steps": 12 if smoke else 30,
        "max_len": 128 if smoke else 3072,
        "anchors": 8 if smoke else 512,
        "block_size": 16,
        "workers": max_workers(args.gpus, smoke),
    }
    fill_defaults(args, defaults)
    if args.sweep is None:
        args.sweep = ",".join(str(w) for w in range(1, args.workers))
    args.sweep_workers = [int(w) for w in args.sweep.split(",") if w.strip()]
    return args


def prepare(args: argparse.Namespace, work: Path) -> None:
    """The random-weight target (built on cuda:0, or the CPU for --smoke) and the random-token data."""
    if args.smoke:
        args.target_dir = str(bench.make_target(args.target, work / "target", "float32"))
    else:
        args.target_dir = str(bench.make_target(args.target, work / "target", "bfloat16", device="cuda:0"))
    args.data = str(bench.make_dataset(work / "data", args.target_dir, args.rows, 2, args.max_len))


def passthrough(args: argparse.Namespace) -> list[str]:
    return [
        *(["--smoke"] if args.smoke else []),
        *("--gpus", str(args.gpus), "--target", args.target, "--target-dir", args.target_dir),
        *("--data", args.data, "--steps", str(args.steps), "--max-len", str(args.max_len)),
        *("--anchors", str(args.anchors), "--block-size", str(args.block_size)),
        *("--parallel", str(args.parallel)),
        *(["--threads", str(args.threads)] if args.threads else []),
        *(x for kv in args.set for x in ("--set", kv)),
    ]


def status_line(r: dict) -> str:
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    if r.get("errors"):
        return "error: " + "; ".join(str(v) for v in r["errors"].values())
    s = r["startup"]
    steps = [d["steps_per_s"] and round(d["steps_per_s"], 2) for d in r["drafters"]]
    return (
        f"ok, first step after {s['to_first_step_s']} s (set-up {s['setup_s']}, warm-up {s['warmup_s']}), "
        f"compiles after {r['compiles_after_warmup']}, steps/s {steps}, target util {r['target_utilisation']}"
    )


def main() -> int:
    args = parse_args()
    if args.child:
        print_result(child(args))
        return 0
    if not args.smoke:
        import torch

        found = torch.cuda.device_count()
        if found < args.gpus:
            hint = f"pass --gpus {found}" if found else "run --smoke on the CPU"
            print(f"this machine has {found} GPU(s), not {args.gpus}; {hint}")
            return 2
    if not 1 <= args.workers <= max_workers(args.gpus, args.smoke) or any(
        not 1 <= w <= args.workers for w in args.sweep_workers
    ):
        most = max_workers(args.gpus, args.smoke)
        print(f"--workers and --sweep: 1 .. {most} target workers on this layout (--sweep at most --workers)")
        return 2

    if args.set:  # a misspelt key fails here, before the target is built
        from dflashkit.config import load_config
        from dflashkit.errors import ConfigError

        try:
            load_config(None, args.set)
        except ConfigError as e:
            print(f"--set: {e}")
            return 2
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="topology-bench-"))
    prepare(args, work)
    targets, drafters = layout(args.gpus, args.workers, args.smoke)
    print(
        f"target {args.target} ({args.target_dir}), data {args.data}: ready in "
        f"{time.perf_counter() - t0:.0f} s; full topology: target workers on {', '.join(targets)}, "
        f"drafters on {', '.join(drafters)}"
    )
    runs: list[dict] = []
    lock = threading.Lock()
    counts = sorted({args.workers, *args.sweep_workers})

    def report() -> dict:
        config = {k: v for k, v in vars(args).items() if k != "child"}
        return {"config": config, "summary": summarize(runs, counts), "runs": runs}

    def job(workers_rep: tuple[int, int]) -> None:
        workers, rep = workers_rep
        if time.perf_counter() - t0 > args.budget_s:
            return
        r = bench.run_one(str(workers), rep, args, passthrough(args), script=__file__)
        r.setdefault("workers", workers)
        with lock:
            runs.append(r)
            write_report("topology.json", report() | {"total_s": round(time.perf_counter() - t0, 1)})
            print(
                f"[{time.perf_counter() - t0:6.0f}s] {workers} workers, run {rep}: {r['process_s']} s, "
                f"{status_line(r)[:260]}",
                flush=True,
            )

    try:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(job, jobs(args)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(summarize(runs, counts), args.parallel)
    write_report("topology.json", report() | {"total_s": round(time.perf_counter() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

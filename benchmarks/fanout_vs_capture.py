"""Which placement wins for a sweep of K=3 drafters, measured: the fan-out (one process: one target pass per
micro-batch feeding three drafter threads) against capturing the features once (`dflashkit capture`) and
training the three drafters as separate processes from the capture.

Both train the same three variants (1, 2 and 3 drafter layers) for --steps steps on the same rows, each
placement in fresh processes with a cold compile cache. Measured per placement:
- wall time from the first process's start to the last drafter's --steps (target loading, capture,
  warm-up and checkpoints included), and the capture's and each drafter process's own seconds;
- peak memory: per GPU the largest allocation any of the placement's processes made there (torch's
  max_memory_allocated), on the CPU the largest process's peak resident set;
- the capture's size on disk.

Devices: with 2+ GPUs the fan-out puts the target on cuda:0 and the drafters on cuda:1; the capture runs on
cuda:0 and the three drafter processes run at once, spread over the GPUs (cuda:1, cuda:0, cuda:1, ...).
With one GPU everything shares cuda:0 (drafter processes one after another unless --concurrent).

It prints a table and writes fanout_vs_capture.json to --out (default $OUT), if given. Both placements must
reach --steps on every drafter; a process that fails or stops short is an error in the JSON (exit 1).

    python benchmarks/fanout_vs_capture.py --out results/        # GPU: Qwen3-0.6B-shaped random target
    python benchmarks/fanout_vs_capture.py --target qwen3-8b --max-len 3072 --anchors 512
    python benchmarks/fanout_vs_capture.py --smoke --out /tmp/x  # CPU: a tiny random target, sdpa (~3 min)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fanout as bench  # noqa: E402  (benchmarks/fanout.py: random target and data, config keys)
from report import fill_defaults, print_result, run_child, write_report  # noqa: E402

VARIANTS = (("l1", {}), ("l2", {"drafter.layers": 2}), ("l3", {"drafter.layers": 3}))


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def config(args: argparse.Namespace, out: Path, **over: object):
    """The run config of one drafter (the base keys of benchmarks/fanout.py) plus ``over``."""
    from dflashkit.config import load_config

    keys = bench.base_overrides(args, out) | over
    return load_config(None, [f"{k}={v}" for k, v in keys.items() if v is not None])


def peak_memory() -> dict[str, int]:
    """This process's peak: bytes allocated on each GPU, or the peak resident set on the CPU."""
    import torch

    if gpu_count():
        return {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in range(gpu_count())}
    return {"cpu_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# --------------------------------------------------------------------------------------------------
# The child processes


def child_fanout(args: argparse.Namespace) -> dict:
    from rich.console import Console

    from dflashkit.train import fanout

    t0 = time.perf_counter()
    gpus = gpu_count()
    target = "cuda:0" if gpus else "cpu"
    drafters = "cuda:1" if gpus > 1 else target

    def variant(name: str, over: dict) -> str:
        keys = ", ".join(f"{k}: {v}" for k, v in over.items())
        return f"{{name: {name}, device: '{drafters}'" + (f", overrides: {{{keys}}}}}" if keys else "}")

    variants = "[" + ", ".join(variant(name, over) for name, over in VARIANTS) + "]"
    keys = {"fanout.target_device": target, "fanout.variants": variants}
    cfg = config(args, Path(args.work) / "fanout", **keys)
    result = fanout.train_fanout(cfg, console=Console(quiet=True))
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "steps": {d.name: d.steps for d in result.drafters},
        "ok": result.ok,
        "peak": peak_memory(),
    }


def child_capture(args: argparse.Namespace) -> dict:
    from dflashkit.data.features import CaptureSettings, capture_features

    t0 = time.perf_counter()
    device = "cuda:0" if gpu_count() else "cpu"
    cfg = config(args, Path(args.work) / "unused", **{"run.device": device})
    dtype = "float32" if args.smoke else "bfloat16"
    manifest = capture_features(
        cfg, CaptureSettings(out=Path(args.work) / "features", dtype=dtype), progress=False
    )
    return {"seconds": round(time.perf_counter() - t0, 2), "bytes": manifest["bytes"], "peak": peak_memory()}


def child_train(args: argparse.Namespace) -> dict:
    from rich.console import Console

    from dflashkit.train.trainer import train

    t0 = time.perf_counter()
    over = dict(dict(VARIANTS)[args.variant])
    over |= {"run.device": args.device, "data.features_dir": str(Path(args.work) / "features")}
    result = train(
        config(args, Path(args.work) / "separate" / args.variant, **over), console=Console(quiet=True)
    )
    return {"seconds": round(time.perf_counter() - t0, 2), "steps": result.steps, "peak": peak_memory()}


# --------------------------------------------------------------------------------------------------
# The driver


def merge_peaks(results: list[dict]) -> dict[str, int]:
    """The largest peak per device over a placement's processes."""
    out: dict[str, int] = {}
    for r in results:
        for k, v in r.get("peak", {}).items():
            out[k] = max(out.get(k, 0), v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, sdpa, a tiny random target")
    ap.add_argument("--target", default=None, help=f"{', '.join(bench.TARGET_SHAPES)} or embedded")
    ap.add_argument("--data", default=None, help="a prepared dataset folder (default: random tokens)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="random training rows")
    ap.add_argument("--concurrent", action="store_true", help="drafter processes at once on one device too")
    ap.add_argument("--timeout-s", type=int, default=None, help="per process")
    ap.add_argument("--out", default=None, help="folder for fanout_vs_capture.json (default: $OUT)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--target-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke
    fill_defaults(
        args,
        {
            "target": "tiny" if smoke else "qwen3-0.6b",
            "steps": 4 if smoke else 30,
            "max_len": 128 if smoke else 1024,
            "anchors": 8 if smoke else 128,
            "block_size": 8 if smoke else 16,
            "rows": 16 if smoke else 64,
            "timeout_s": 900 if smoke else 1800,
        },
    )
    if args.child:
        run = {"fanout": child_fanout, "capture": child_capture, "train": child_train}[args.child]
        print_result(run(args))
        return 0

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fanout-vs-capture-"))
    gpus = gpu_count()
    if smoke and gpus:
        print("--smoke runs on the CPU: hiding the GPUs")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        gpus = 0
    if args.target == "embedded":
        args.target_dir = "embedded"
    else:
        build_on = "cuda" if gpus else "cpu"
        args.target_dir = str(
            bench.make_target(args.target, work / "target", "float32" if smoke else "bfloat16", build_on)
        )
    if args.data is None:
        args.data = str(bench.make_dataset(work / "data", args.target_dir, args.rows, 2, args.max_len))
    print(f"target {args.target}, data {args.data}: ready in {time.perf_counter() - t0:.0f} s; {gpus} GPU(s)")

    common = [
        *(["--smoke"] if smoke else []),
        *("--target", args.target, "--target-dir", args.target_dir, "--data", args.data),
        *("--steps", str(args.steps), "--max-len", str(args.max_len), "--anchors", str(args.anchors)),
        *("--block-size", str(args.block_size)),
    ]
    env = dict(os.environ)

    def child(kind: str, place: Path, *extra: str) -> dict:
        place.mkdir(parents=True, exist_ok=True)
        cache = {"TORCHINDUCTOR_CACHE_DIR": str(place / "inductor-cache")}  # cold, per process
        cmd = [sys.executable, __file__, "--child", kind, "--work", str(place), *common, *extra]
        return run_child(cmd, env | cache, args.timeout_s)

    # 1. the fan-out: one process
    t = time.perf_counter()
    fan = child("fanout", work / "fanout")
    fan_wall = time.perf_counter() - t
    print(f"fan-out: {fan_wall:.1f} s wall, {fan}")

    # 2. capture once, then one process per drafter
    place = work / "capture"
    t = time.perf_counter()
    cap = child("capture", place)
    devices = [f"cuda:{(i + 1) % gpus}" for i in range(len(VARIANTS))] if gpus else ["cpu"] * len(VARIANTS)
    at_once = args.concurrent or gpus > 1
    with ThreadPoolExecutor(max_workers=len(VARIANTS) if at_once else 1) as pool:
        trains = list(
            pool.map(
                lambda nd: child("train", place, "--variant", nd[0], "--device", nd[1]),
                [(name, dev) for (name, _), dev in zip(VARIANTS, devices, strict=True)],
            )
        )
    sep_wall = time.perf_counter() - t
    print(
        f"capture + {len(VARIANTS)} processes ({'at once' if at_once else 'one after another'}): {sep_wall:.1f} s wall"
    )

    def short(steps: dict[str, int | None]) -> dict | None:
        """Drafters that did not reach --steps (the comparison is of the same steps)."""
        bad = {k: v for k, v in steps.items() if v != args.steps}
        return {"steps": f"expected {args.steps} for each drafter, got {bad}"} if bad else None

    fan_steps = fan.get("steps") or {name: None for name, _ in VARIANTS}
    sep_steps = {name: r.get("steps") for (name, _), r in zip(VARIANTS, trains, strict=True)}
    rows = [
        {
            "placement": "fan-out (one process, K drafter threads)",
            "wall_s": round(fan_wall, 1),
            "errors": fan.get("errors") or short(fan_steps),
            "peak_bytes": merge_peaks([fan]),
        },
        {
            "placement": f"capture + {len(VARIANTS)} processes",
            "wall_s": round(sep_wall, 1),
            "capture_s": cap.get("seconds"),
            "capture_bytes": cap.get("bytes"),
            "drafter_process_s": [r.get("seconds") for r in trains],
            "errors": [
                e for e in [cap.get("errors"), *(r.get("errors") for r in trains), short(sep_steps)] if e
            ]
            or None,
            "peak_bytes": merge_peaks([cap, *trains]),
        },
    ]
    print(f"\n{'placement':45} {'wall s':>8}  peak memory")
    for r in rows:
        peaks = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["peak_bytes"].items())
        print(
            f"{r['placement']:45} {r['wall_s']:8.1f}  {peaks}{'  ERRORS ' + str(r['errors']) if r['errors'] else ''}"
        )
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "variant", "device", "work")},
        "gpus": gpus,
        "placement": {
            "fanout": {"target": "cuda:0" if gpus else "cpu", "drafters": "cuda:1" if gpus > 1 else "same"},
            "separate": {"capture": "cuda:0" if gpus else "cpu", "drafters": devices, "at_once": at_once},
        },
        "summary": rows,
        "fanout": fan,
        "capture": cap,
        "trains": trains,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    write_report("fanout_vs_capture.json", report, args.out)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

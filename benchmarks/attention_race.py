"""The threaded compile race, counted: threads over the available GPUs, one stepping a warm compiled flex_attention
while the others bring new shapes, each repetition in a fresh subprocess with a fresh compile cache.

Two modes, N repetitions each:
- plain: what a threaded trainer without our runtime does. Each thread has its own `torch.compile(flex_attention)`; thread 0
  compiles its shape, then steps it (building the mask with `create_block_mask` every step) while threads
  1..T-1 compile their new shapes concurrently.
- ours: dflashkit's runtime. Each thread's length is padded into one of two buckets; every bucket is
  warmed serially under the compile lock (one warm_up() per device), then frozen; the same threads then
  step concurrently through `flex_attention_entry` with the tile-level `flex_block_mask`.

It prints a table (runs, runs with an error, the error messages) and writes JSON to $OUT if set.

    python benchmarks/attention_race.py                 # GPU: 20 repetitions of each mode
    python benchmarks/attention_race.py --smoke         # CPU: tiny shapes, 1 repetition, forward only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Run from a checkout without installing: make src/ importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import fill_defaults, print_result, run_child, write_report  # noqa: E402

# --------------------------------------------------------------------------------------------------
# One repetition (the child process)


def child(args: argparse.Namespace) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dflashkit.attention.block_mask import flex_block_mask
    from dflashkit.attention.buckets import bucket_layout, pick_bucket
    from dflashkit.attention.flex import flex_attention_entry
    from dflashkit.attention.masks import dflash_mask_mod
    from dflashkit.attention.warm_up import AttentionShape, example_inputs, example_layout, warm_up
    from dflashkit.runtime.compile import frozen_compiles

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(args.parallel, 1) // max(args.threads, 1)))
    if args.smoke:
        devices = ["cpu"]
    else:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    backward = args.backward and not args.smoke
    # Thread i's own (new) context length. Ours pads it into one of two buckets, so the run needs
    # fewer compiles than threads.
    shapes = [
        AttentionShape(
            batch=1,
            q_heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            context_len=args.context + 128 * i,
            num_blocks=args.anchors,
            block_size=16,
            dtype=dtype,
        )
        for i in range(args.threads)
    ]
    context_buckets = (args.context, args.context + 128 * max(args.threads - 1, 1))
    buckets = {"context_buckets": context_buckets, "anchor_buckets": (args.anchors,)}
    bucket_shapes = [
        dataclasses.replace(s, context_len=pick_bucket(s.context_len, context_buckets)) for s in shapes
    ]
    device_of = [devices[i % len(devices)] for i in range(args.threads)]

    results: dict[str, str] = {}
    steps = [0] * args.threads
    graphs_at_start = 0
    done = threading.Event()

    def run_step(i: int, fn, seed: int) -> None:
        layout = example_layout(shapes[i], device_of[i], seed=seed)
        if fn is None:  # ours: pad to the warmed bucket, tile-level block mask
            shape = bucket_shapes[i]
            q, k, v = example_inputs(shape, device_of[i], requires_grad=backward, seed=seed)
            out = flex_attention_entry(q, k, v, flex_block_mask(bucket_layout(layout, **buckets)))
        else:  # plain: a fresh create_block_mask every step, as such a trainer does
            shape = shapes[i]
            q, k, v = example_inputs(shape, device_of[i], requires_grad=backward, seed=seed)
            bm = create_block_mask(
                dflash_mask_mod(layout), 1, None, shape.q_len, shape.kv_len, device=device_of[i]
            )
            out = fn(q, k, v, block_mask=bm, enable_gqa=args.heads != args.kv_heads)
        if backward:
            out.float().square().mean().backward()
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        steps[i] += 1

    def worker(i: int, fn, barrier: threading.Barrier) -> None:
        try:
            barrier.wait()
            if i == 0:  # the warm thread: step until the others are done
                while not done.is_set() or steps[0] < args.min_steps:
                    run_step(0, fn, seed=steps[0])
            else:  # a thread with a new shape: its first step compiles (plain) or is warm (ours)
                for s in range(args.new_shape_steps):
                    run_step(i, fn, seed=1000 * i + s)
            results[f"t{i}"] = "ok"
        except Exception as e:  # counted, not raised: the table is the point
            results[f"t{i}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if os.environ.get("RACE_TRACEBACK"):
                traceback.print_exc()
        finally:
            if i != 0 and sum(1 for k in results if k != "t0") == args.threads - 1:
                done.set()

    t_start = time.perf_counter()
    frozen = contextlib.ExitStack()  # ours: compiles frozen for the concurrent phase
    if args.child == "plain":
        # On the CPU, torch 2.13's flex C++ template fails to build the dynamic-shape graph that
        # automatic dynamic recompiles produce for a second shape, so the smoke run pins shapes.
        dynamic = False if args.smoke else None
        fns = [torch.compile(flex_attention, dynamic=dynamic) for _ in range(args.threads)]
        run_step(0, fns[0], seed=0)  # thread 0 is warm before the others start
    else:
        fns = [None] * args.threads
        for dev in devices:  # each device's buckets, serially under the compile lock
            mine = sorted({s for s, d in zip(bucket_shapes, device_of, strict=True) if d == dev}, key=str)
            warm_up(mine, [dev], backward=backward)
        frozen.enter_context(frozen_compiles())
    warm_s = time.perf_counter() - t_start
    graphs_at_start = counters["stats"]["unique_graphs"]

    barrier = threading.Barrier(args.threads)
    threads = [threading.Thread(target=worker, args=(i, fns[i], barrier)) for i in range(args.threads)]
    if args.threads == 1:
        done.set()
    with frozen:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    errors = {k: v for k, v in results.items() if v != "ok"}
    return {
        "mode": args.child,
        "devices": devices,
        "threads": args.threads,
        "backward": backward,
        "warm_s": round(warm_s, 2),
        "concurrent_s": round(time.perf_counter() - t_start - warm_s, 2),
        "steps": steps,
        "compiles_in_concurrent_phase": counters["stats"]["unique_graphs"] - graphs_at_start,
        "errors": errors,
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
    }


# --------------------------------------------------------------------------------------------------
# The driver


def run_one(mode: str, rep: int, args: argparse.Namespace, passthrough: list[str]) -> dict:
    cache = tempfile.mkdtemp(prefix=f"race-{mode}-{rep}-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // args.parallel)))
    cmd = [sys.executable, __file__, "--child", mode, *passthrough]
    t0 = time.perf_counter()
    out = run_child(cmd, env, args.timeout_s)
    out.setdefault("mode", mode)
    out["rep"] = rep
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def summarize(runs: list[dict], modes: list[str]) -> list[dict]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        failed = [r for r in mine if r.get("errors")]
        messages = Counter(m for r in failed for m in r["errors"].values())
        rows.append(
            {
                "mode": mode,
                "runs": len(mine),
                "runs_with_error": len(failed),
                "threads_died": sum(len(r["errors"]) for r in failed),
                "compiles_after_warmup": sum(r.get("compiles_in_concurrent_phase", 0) for r in mine)
                if mode == "ours"
                else None,
                "median_wall_s": sorted(r["wall_s"] for r in mine)[len(mine) // 2] if mine else None,
                "errors": dict(messages.most_common()),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'mode':<6} {'runs':>5} {'runs with an error':>19} {'threads died':>13} {'median s':>9}")
    for r in rows:
        print(
            f"{r['mode']:<6} {r['runs']:>5} {r['runs_with_error']:>19} {r['threads_died']:>13} "
            f"{r['median_wall_s'] if r['median_wall_s'] is not None else '-':>9}"
        )
    for r in rows:
        if r["compiles_after_warmup"] is not None:
            print(f"{r['mode']}: compiles after warm-up, all runs: {r['compiles_after_warmup']}")
        for msg, n in r["errors"].items():
            print(f"{r['mode']}: {n} x {msg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 1 repetition, forward only")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per mode (default 20; smoke 1)")
    ap.add_argument("--modes", default="plain,ours")
    ap.add_argument("--threads", type=int, default=None, help="threads per run (default 4; smoke 2)")
    ap.add_argument("--parallel", type=int, default=None, help="repetitions run at once (default 4; smoke 1)")
    ap.add_argument("--budget-s", type=float, default=400, help="start no new repetition after this")
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--backward", action="store_true", help="step forward+backward (GPU only)")
    ap.add_argument("--context", type=int, default=None, help="thread 0's context length")
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--min-steps", type=int, default=5)
    ap.add_argument("--new-shape-steps", type=int, default=3)
    ap.add_argument("--child", choices=["plain", "ours"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke
    defaults = {
        "reps": 1 if smoke else 20,
        "threads": 2 if smoke else 4,
        "parallel": 1 if smoke else 4,
        "context": 256 if smoke else 1024,
        "anchors": 8 if smoke else 64,
        "heads": 2 if smoke else 16,
        "kv_heads": 1 if smoke else 4,
        "head_dim": 16 if smoke else 128,
    }
    fill_defaults(args, defaults)

    if args.child:
        print_result(child(args))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    passthrough = [
        *(["--smoke"] if smoke else []),
        *(["--backward"] if args.backward else []),
        *("--threads", str(args.threads), "--parallel", str(args.parallel)),
        *("--context", str(args.context), "--anchors", str(args.anchors)),
        *("--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)),
        *("--min-steps", str(args.min_steps), "--new-shape-steps", str(args.new_shape_steps)),
    ]
    # Interleave the modes so that both see the same machine conditions.
    jobs = [(mode, rep) for rep in range(args.reps) for mode in modes]
    t0 = time.perf_counter()
    runs: list[dict] = []
    lock = threading.Lock()

    def job(mode_rep: tuple[str, int]) -> None:
        mode, rep = mode_rep
        if time.perf_counter() - t0 > args.budget_s:
            return
        r = run_one(mode, rep, args, passthrough)
        with lock:
            runs.append(r)
            status = "error: " + "; ".join(r["errors"].values()) if r.get("errors") else "ok"
            print(
                f"[{time.perf_counter() - t0:6.0f}s] {mode} rep {rep}: {r['wall_s']} s, {status[:200]}",
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(job, jobs))

    rows = summarize(runs, modes)
    print_table(rows)
    report = {
        "config": vars(args),
        "summary": rows,
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    write_report("attention_race.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

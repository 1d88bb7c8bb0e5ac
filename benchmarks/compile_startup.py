"""Compile start-up: time to the first optimizer step with a cold compile cache, a warm local cache, and a
loaded portable cache artifact; for one process (`dflashkit` trainer) and for fan-out threads on 2 GPUs.

Every run is a fresh subprocess (so nothing compiled in-process helps), one at a time (so they do not
share the CPU cores that compile). Modes:
- cold:     a fresh, empty TORCHINDUCTOR_CACHE_DIR (Triton's cache lives under it too). After training,
            the child writes this process's compile artifacts with
            `dflashkit.runtime.compile.save_compile_cache` (torch.compiler.save_cache_artifacts behind a
            header keyed by the environment fingerprint), outside the timed part.
- warm:     the same cache directory as that cold run: Inductor's FX-graph, AOTAutograd and Triton caches
            are warm on local disk.
- portable: a fresh, empty cache directory, and the cold run's artifact loaded with
            `load_compile_cache` (fingerprint check, then torch.compiler.load_cache_artifacts) right after
            the imports, before setup and warm-up. The load is counted in the time to the first step.
Each repetition runs cold, then warm and portable from that cold run.

Placements:
- single: `trainer.train` on one config (drafter l1 of fanout.py's config: 1 layer), on cuda:0.
- fanout: `fanout.train_fanout`, the target on cuda:0 and two drafter variants (1 and 2 layers) on cuda:1,
          as fanout.py's `split` placement; needs 2 GPUs, skipped otherwise.

The target is a random-weight model of a real shape and the data are random tokens (fanout.py's
`make_target` / `make_dataset`), so nothing is downloaded.

What is measured (wall clock, time.time() of the driver and the child):
- first step s: from just before the driver starts the child process to the end of the first optimizer
  step (a global optimizer step post-hook, after a device synchronize): interpreter start and imports,
  (portable: the artifact load), setup (target, data, drafter), attention warm-up and the first step.
  For the fan-out, the first step of the *last* drafter to take one (all drafters have stepped).
- warm-up s: the attention warm-up alone (`trainer.warm_up`, or the fan-out's `warm_up` over
  every drafter): the compiles, or the cache loads that replace them.
- compiles after warm-up: Dynamo graphs compiled after warm-up ended, until training ended; must be 0.
- fx hit/miss: Inductor FX-graph cache hits and misses in the child (shows which cache answered).
On the CPU (`--smoke`) training uses sdpa (flex has no CPU backward), so the trainer compiles nothing; to
still exercise the cache plumbing, the warm-up there also compiles a flex_attention forward of the
drafter's shape on the CPU (`runtime.compile.warmup`, unfrozen). The CPU's portable artifact carries the
generated C++ source, not the built library, so a CPU portable run still builds it.

It prints a progress line per child, a table of medians with speed-ups against cold, and writes JSON to
$OUT/compile_startup.json when OUT is set.

    python benchmarks/compile_startup.py            # GPU (2 GPUs): up to 3 repetitions of 3 modes x 2 placements;
                                                    # no new child after --budget-s 300 (about 6 min in all)
    python benchmarks/compile_startup.py --placements single   # one placement at a time: all 3 repetitions
    python benchmarks/compile_startup.py --smoke    # CPU: tiny random target, 1 repetition, fan-out skipped
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

T_ENTER = time.time()  # the child's own start, before any heavy import

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import (  # noqa: E402
    TARGET_SHAPES,
    _median,
    make_dataset,
    make_target,
    placement_devices,
    run_config,
)
from report import fill_defaults, print_result, run_child, write_report  # noqa: E402

MODES = ("cold", "warm", "portable")
PLACEMENTS = ("single", "fanout")
ARTIFACT = "flex.compile-cache"


# --------------------------------------------------------------------------------------------------
# One run (the child process)


def config_for(args: argparse.Namespace, placement: str, out: Path):
    """fanout.py's run config: the fan-out as is, or its first variant (l1) alone for `single`."""
    fan_placement = args.fanout_placement if placement == "fanout" else ("cpu" if args.smoke else "shared")
    ns = SimpleNamespace(
        child=fan_placement,
        target=args.target,
        target_dir=args.target_dir,
        data=args.data,
        smoke=args.smoke,
        steps=args.steps,
        block_size=args.block_size,
        max_len=args.max_len,
        anchors=args.anchors,
    )
    cfg = run_config(ns, out)
    if placement == "fanout":
        return cfg
    from dflashkit.train import fanout

    return fanout.variant_configs(cfg)[0][1]  # l1 on the drafter device of `fan_placement`


def cpu_probe(run) -> None:
    """A flex_attention forward of the drafter's shape, compiled on the CPU (unfrozen): on the CPU the
    trainer compiles nothing, and this gives the cache plumbing a compile to save and load."""
    import torch

    from dflashkit.attention.warm_up import AttentionShape, warm_up

    config = run.drafter.config
    shape = AttentionShape(
        batch=1,
        q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        context_len=run.cfg.train.max_len,
        num_blocks=run.cfg.train.num_anchors,
        block_size=config.block_size,
        dtype=torch.float32,
    )
    warm_up([shape], ["cpu"], backward=False)


def cache_counters() -> dict:
    from torch._dynamo.utils import counters

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "fxgraph_cache_hit": int(ind["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(ind["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(aot["autograd_cache_hit"]),
        "autograd_cache_miss": int(aot["autograd_cache_miss"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
    }


def child(args: argparse.Namespace) -> dict:
    placement, mode = args.child, args.mode
    report: dict = {"placement": placement, "mode": mode, "rep": args.rep}
    marks: dict[str, float] = {"spawn": args.spawned_at, "enter": T_ENTER}

    import torch
    from rich.console import Console

    from dflashkit.runtime.compile_cache import CompileCacheError, load_compile_cache, save_compile_cache
    from dflashkit.train import fanout, trainer

    marks["imported"] = time.time()
    on_cpu = args.smoke or (placement == "fanout" and args.fanout_placement == "cpu")
    need = 0 if on_cpu else (2 if placement == "fanout" and args.fanout_placement == "split" else 1)
    if torch.cuda.device_count() < need:
        report["skipped"] = f"needs {need} GPU(s), found {torch.cuda.device_count()}"
        return report

    artifact = Path(args.artifact)
    if mode == "portable":
        if artifact.is_file():
            info = load_compile_cache(artifact)
            report["artifact_loaded"] = {k: len(v) for k, v in info.artifacts.items()}
        else:
            report["artifact_loaded"] = None  # the cold run saved none (it says why)
        marks["loaded"] = time.time()

    # The warm-up, timed (and on the CPU, with the probe compile).
    after: dict = {}

    def timed(fn, probe_runs):
        def wrapper(*a, **kw):
            marks["warmup_start"] = time.time()
            if on_cpu:
                for run in probe_runs(*a):
                    cpu_probe(run)
            out = fn(*a, **kw)
            after.update(cache_counters())
            marks["warmup_end"] = time.time()
            return out

        return wrapper

    if placement == "fanout":
        fanout.warm_up = timed(fanout.warm_up, lambda fo, *_: [fo.workers[0].run])
    else:
        trainer.warm_up = timed(trainer.warm_up, lambda run, *_: [run])

    # The end of each optimizer's first step.
    first: dict[int, float] = {}

    def on_step(optimizer, _args, _kwargs):
        if id(optimizer) in first:
            return
        p = optimizer.param_groups[0]["params"][0]
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        first[id(optimizer)] = time.time()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(on_step)
    out = Path(tempfile.mkdtemp(prefix=f"startup-{placement}-{mode}-", dir=args.work))
    cfg = None
    try:
        cfg = config_for(args, placement, out / "run")
        if placement == "fanout":
            result = fanout.train_fanout(cfg, console=Console(quiet=True))
            report["fanout_compiles_after_warmup"] = result.compiles_after_warmup
            errors = {d.name: d.error for d in result.drafters if d.status != "done"}
            if errors:
                report["errors"] = errors
        else:
            trainer.train(cfg, console=Console(quiet=True))
    except Exception as e:  # counted, not raised: the table is the point
        report["errors"] = {"run": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    finally:
        hook.remove()
    marks["trained"] = time.time()
    end = cache_counters()

    if mode == "cold":  # the portable artifact, outside the timed part
        t = time.time()
        try:
            path = save_compile_cache(artifact)
            report["artifact_saved"] = {"bytes": path.stat().st_size, "seconds": round(time.time() - t, 2)}
        except CompileCacheError as e:
            report["artifact_saved"] = None
            report["artifact_note"] = str(e)

    def span(a: str, b: str) -> float | None:
        return round(marks[b] - marks[a], 2) if a in marks and b in marks else None

    if first:
        marks["first_step"] = max(first.values())
    setup_from = "loaded" if "loaded" in marks else "imported"
    report.update(
        {
            "first_step_s": span("spawn", "first_step"),
            "interpreter_s": span("spawn", "enter"),
            "import_s": span("enter", "imported"),
            "load_s": span("imported", "loaded"),
            "setup_s": span(setup_from, "warmup_start"),
            "warmup_s": span("warmup_start", "warmup_end"),
            "first_step_after_warmup_s": span("warmup_end", "first_step"),
            "first_steps": sorted(round(t - marks["spawn"], 2) for t in first.values()),
            "compiles_after_warmup": end["graphs"] - after["graphs"] if after else None,
            "cache_at_warmup_end": after or None,
            "cache_at_end": end,
            "torch": torch.__version__,
            "devices": placement_devices(args.fanout_placement)
            if placement == "fanout"
            else [str(cfg.run.device) if cfg is not None else None],
        }
    )
    return report


# --------------------------------------------------------------------------------------------------
# The driver


def run_one(
    placement: str, mode: str, rep: int, cache: Path, artifact: Path, args, passthrough: list[str]
) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES"):  # Triton's cache: under Inductor's
        env.pop(k, None)
    cmd = [sys.executable, __file__, "--child", placement, "--mode", mode, "--rep", str(rep)]
    cmd += ["--artifact", str(artifact), *passthrough]
    t0 = time.time()
    out = run_child([*cmd, "--spawned-at", repr(time.time())], env, args.timeout_s)
    out.update(placement=placement, mode=mode, rep=rep, process_s=round(time.time() - t0, 1))
    return out


def summarize(runs: list[dict], placements: list[str]) -> list[dict]:
    rows = []
    for placement in placements:
        cold = None
        for mode in MODES:
            mine = [
                r for r in runs if r["placement"] == placement and r["mode"] == mode and "skipped" not in r
            ]
            ok = [r for r in mine if not r.get("errors") and r.get("first_step_s") is not None]
            failed = [r for r in mine if r.get("errors")]

            def med(key, ok=ok):
                return _median([r.get(key) for r in ok])

            row = {
                "placement": placement,
                "mode": mode,
                "runs": len(mine),
                "runs_with_error": len(failed),
                "errors": dict(Counter(m for r in failed for m in r["errors"].values()).most_common()),
                "skipped": sorted(
                    {r["skipped"] for r in runs if r["placement"] == placement and "skipped" in r}
                ),
                "median_first_step_s": med("first_step_s"),
                "median_import_s": med("import_s"),
                "median_load_s": med("load_s"),
                "median_setup_s": med("setup_s"),
                "median_warmup_s": med("warmup_s"),
                "median_first_step_after_warmup_s": med("first_step_after_warmup_s"),
                "compiles_after_warmup": sum(r.get("compiles_after_warmup") or 0 for r in mine),
                "fxgraph_cache_hit": sum(
                    (r.get("cache_at_end") or {}).get("fxgraph_cache_hit", 0) for r in ok
                ),
                "fxgraph_cache_miss": sum(
                    (r.get("cache_at_end") or {}).get("fxgraph_cache_miss", 0) for r in ok
                ),
                "graphs": _median([(r.get("cache_at_end") or {}).get("graphs") for r in ok]),
            }
            if mode == "cold":
                cold = row
                saved = [r["artifact_saved"]["bytes"] for r in ok if r.get("artifact_saved")]
                row["artifact_bytes"] = _median(saved)
                row["artifact_notes"] = sorted({r["artifact_note"] for r in mine if r.get("artifact_note")})
            for key in ("first_step", "warmup"):
                c, m = (cold or {}).get(f"median_{key}_s"), row[f"median_{key}_s"]
                row[f"{key}_speedup_vs_cold"] = round(c / m, 2) if c and m else None
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print()
    print(
        f"{'placement':<9} {'mode':<8} {'runs':>4} {'err':>3} {'1st step s':>10} {'import s':>8} "
        f"{'load s':>6} {'setup s':>7} {'warm-up s':>9} {'step s':>6} {'compiles':>8} {'fx hit/miss':>11} "
        f"{'vs cold (1st step / warm-up)':>28}"
    )
    for r in rows:
        if r["skipped"] and not r["runs"]:
            if r["mode"] == "cold":
                print(f"{r['placement']:<9} skipped: {r['skipped'][0]}")
            continue
        if not r["runs"]:
            print(f"{r['placement']:<9} {r['mode']:<8} not run (out of budget, or its cold run failed)")
            continue
        speed = (
            f"{f(r['first_step_speedup_vs_cold'], '.2f')}x / {f(r['warmup_speedup_vs_cold'], '.2f')}x"
            if r["mode"] != "cold"
            else ""
        )
        print(
            f"{r['placement']:<9} {r['mode']:<8} {r['runs']:>4} {r['runs_with_error']:>3} "
            f"{f(r['median_first_step_s']):>10} {f(r['median_import_s']):>8} {f(r['median_load_s']):>6} "
            f"{f(r['median_setup_s']):>7} {f(r['median_warmup_s']):>9} "
            f"{f(r['median_first_step_after_warmup_s']):>6} {r['compiles_after_warmup']:>8} "
            f"{r['fxgraph_cache_hit']:>5}/{r['fxgraph_cache_miss']:<5} {speed:>28}"
        )
        for msg, n in r["errors"].items():
            print(f"  {r['placement']} {r['mode']}: {n} x {msg}")
        if r["mode"] == "cold":
            if r.get("artifact_bytes"):
                print(f"  {r['placement']} cold: portable artifact {r['artifact_bytes'] / 2**20:.2f} MiB")
            for note in r.get("artifact_notes", []):
                print(f"  {r['placement']} cold: no portable artifact: {note}")
        if r["mode"] == "cold" and r["runs"] > r["runs_with_error"] and not r["graphs"]:
            print(f"  {r['placement']}: nothing compiled")
    print(
        "(medians over the runs; 1st step = process start to the end of the first optimizer step, the last "
        "drafter's in a fan-out; step s = warm-up end to that step; compiles after warm-up and FX-graph "
        "cache hits/misses summed over the runs)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, sdpa, a tiny random target, 1 repetition")
    ap.add_argument(
        "--reps", type=int, default=None, help="repetitions of each (placement, mode) (default 3; smoke 1)"
    )
    ap.add_argument("--placements", default="single,fanout", help="comma-separated: single, fanout")
    ap.add_argument(
        "--fanout-placement",
        default="split",
        choices=("split", "shared", "cpu"),
        help="fanout.py's placement of the fan-out (default split: target cuda:0, drafters cuda:1)",
    )
    ap.add_argument("--budget-s", type=float, default=300, help="start no new child after this")
    ap.add_argument("--timeout-s", type=int, default=None, help="per child (default 240; smoke 600)")
    ap.add_argument("--target", default=None, help=", ".join(TARGET_SHAPES))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rows", type=int, default=8, help="random training rows")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (target, data, caches)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--target-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke
    defaults = {
        "reps": 1 if smoke else 3,
        "timeout_s": 600 if smoke else 240,
        "target": "tiny" if smoke else "qwen3-0.6b",
        "steps": 2 if smoke else 4,
        "max_len": 128 if smoke else 1024,
        "anchors": 8 if smoke else 128,
        "block_size": 8 if smoke else 16,
    }
    fill_defaults(args, defaults)

    if args.child:
        print_result(child(args))
        return 0

    t0 = time.perf_counter()
    placements = [p for p in args.placements.split(",") if p]
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad:
        ap.error(f"unknown placement(s) {bad}; choose from {', '.join(PLACEMENTS)}")
    work = Path(tempfile.mkdtemp(prefix="compile-startup-"))
    args.work = str(work)
    args.target_dir = str(make_target(args.target, work / "target", "float32" if smoke else "bfloat16"))
    args.data = str(make_dataset(work / "data", args.target_dir, args.rows, 2, args.max_len))
    print(
        f"target {args.target}, data {args.rows} rows x {args.max_len}: ready in {time.perf_counter() - t0:.0f} s"
    )

    # Whether a fan-out can run here at all: one line, no child.
    skipped: list[dict] = []
    need = {"split": 2, "shared": 1, "cpu": 0}[args.fanout_placement]
    if "fanout" in placements and need:
        import torch

        found = torch.cuda.device_count()
        if found < need:
            reason = f"needs {need} GPU(s) for placement {args.fanout_placement}, found {found}"
            print(f"fanout: skipped ({reason})")
            placements.remove("fanout")
            skipped = [{"placement": "fanout", "mode": m, "skipped": reason} for m in MODES]

    passthrough = [
        *(["--smoke"] if smoke else []),
        *("--target", args.target, "--target-dir", args.target_dir, "--data", args.data),
        *("--steps", str(args.steps), "--max-len", str(args.max_len), "--anchors", str(args.anchors)),
        *("--block-size", str(args.block_size), "--fanout-placement", args.fanout_placement),
        *("--work", str(work)),
    ]
    runs: list[dict] = []
    out_of_time = False
    for rep in range(args.reps):
        for placement in placements:
            cache = work / f"cache-{placement}-{rep}"
            artifact = work / f"{placement}-{rep}.{ARTIFACT}"
            for mode in MODES:
                if time.perf_counter() - t0 > args.budget_s:
                    out_of_time = True
                    break
                if mode == "portable":
                    cache = work / f"cache-{placement}-{rep}-portable"
                cache.mkdir(exist_ok=True)
                r = run_one(placement, mode, rep, cache, artifact, args, passthrough)
                runs.append(r)
                if "skipped" in r:
                    status = "skipped: " + r["skipped"]
                elif r.get("errors"):
                    status = "error: " + "; ".join(str(v) for v in r["errors"].values())
                else:
                    c = r.get("cache_at_end") or {}
                    status = (
                        f"first step {r['first_step_s']} s (import {r['import_s']}, load {r['load_s']}, setup "
                        f"{r['setup_s']}, warm-up {r['warmup_s']}, step {r['first_step_after_warmup_s']}), "
                        f"compiles after warm-up {r['compiles_after_warmup']}, fx hit/miss "
                        f"{c.get('fxgraph_cache_hit')}/{c.get('fxgraph_cache_miss')}"
                    )
                print(
                    f"[{time.perf_counter() - t0:6.0f}s] {placement} {mode} rep {rep}: {r['process_s']} s, "
                    f"{status[:260]}",
                    flush=True,
                )
                if mode == "cold" and r.get("errors"):
                    break  # warm and portable need this cold run's cache and artifact
            if out_of_time:
                break
        if out_of_time:
            print(f"budget of {args.budget_s:.0f} s spent: no more children")
            break

    runs += skipped
    rows = summarize(runs, [p for p in PLACEMENTS if p in args.placements.split(",")])
    print_table(rows)
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "mode", "rep", "artifact")},
        "summary": rows,
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    write_report("compile_startup.json", report)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

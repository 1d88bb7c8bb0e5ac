"""Fan-out training on the GPU, counted: one target and two drafter variants as threads of one process,
compiled flex attention, each repetition a fresh subprocess with a fresh (cold) compile cache.

Placements (one repetition trains both drafters for --steps steps):
- split:  the target on cuda:0, both drafters on cuda:1 (needs 2 GPUs)
- shared: the target and both drafters on cuda:0

The target is a random-weight model of a real shape (transformers from_config; nothing to download) and
the data are random tokens, so no weights travel. Each repetition counts drafter errors, dense
fall-backs (DenseFallbackError, or torch's "flex_attention called without torch.compile" warning) and
compiles after warm-up, and measures throughput: each drafter's steady steps/s (from its metrics.jsonl,
warm-up, evaluation and checkpoints left out), the target's micro-batches/s (its own compute time) and
the stream's micro-batches/s over the whole training phase (in the JSON; the drafter threads' setup,
final evaluation and checkpoints included). `--sequential` also trains each variant alone after the
fan-out (same data, same steps), for the cost model: one target pass per micro-batch instead of one
per micro-batch per drafter.

It prints a table and writes JSON to $OUT if set.

    python benchmarks/fanout.py                       # GPU (2 GPUs): 10 repetitions of each placement (~7 min)
    python benchmarks/fanout.py --smoke               # CPU: a tiny random target, sdpa, 1 repetition
    python benchmarks/fanout.py --smoke --target embedded --steps 20 --max-len 256 --anchors 16 \
        --sequential --threads 1                      # CPU: the README's cost-model numbers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Run from a checkout without installing: make src/ importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import fill_defaults, print_result, run_child, write_report  # noqa: E402

# Random-weight targets: (transformers config class, its keyword arguments).
TARGET_SHAPES = {
    # SmolLM2-135M-Instruct, the embedded target
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    # Qwen3-0.6B
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    # Qwen3-4B
    "qwen3-4b": (
        "Qwen3Config",
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    # Qwen3-8B (the 8-GPU fan-out topology's target)
    "qwen3-8b": (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    ),
    # a tiny Llama for the CPU smoke run
    "tiny": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# Inputs made once by the driver: a random-weight target folder and a random-token dataset


def make_target(shape: str, folder: Path, dtype: str, device: str = "cpu") -> Path:
    """A random-weight target of a TARGET_SHAPES shape, saved to `folder`. Built on `device`: random
    initialisation of billions of weights takes seconds on a GPU and minutes on the CPU."""
    import torch
    import transformers

    cls_name, kwargs = TARGET_SHAPES[shape]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return folder


def make_dataset(folder: Path, target: str, rows: int, val_rows: int, length: int) -> Path:
    """Random token records of `length` tokens, the last three quarters supervised."""
    import torch

    from dflashkit.data.dataset import KIND, MANIFEST_FILE, SCHEMA, write_split
    from dflashkit.target.hf import identity_of_folder

    ident = identity_of_folder(target)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    splits = {}
    for split, n in (("train", rows), ("validation", val_rows)):
        ids = [f"{split}-{i}" for i in range(n)]
        tokens = [torch.randint(0, ident["vocab_size"] - 1, (length,), generator=g).tolist() for _ in ids]
        masks = [[0] * (length // 4) + [1] * (length - length // 4) for _ in ids]
        write_split(folder / f"{split}.safetensors", ids, tokens, masks)
        splits[split] = {"file": f"{split}.safetensors", "records": n, "tokens": n * length}
    manifest = {
        "kind": KIND,
        "schema": SCHEMA,
        "target": ident,
        "counts": {"records": rows + val_rows},
        "splits": splits,
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return folder


# --------------------------------------------------------------------------------------------------
# One repetition (the child process)


def placement_devices(placement: str) -> tuple[str, str]:
    """(target device, drafter device) of a placement."""
    return {"split": ("cuda:0", "cuda:1"), "shared": ("cuda:0", "cuda:0"), "cpu": ("cpu", "cpu")}[placement]


def base_overrides(args: argparse.Namespace, out: Path) -> dict:
    """The run config's keys besides the fanout section: the shapes of --steps, --max-len, --anchors and
    --block-size, flex on the GPU (sdpa with --smoke), checkpoints and evaluation only at the end."""
    over = {
        "target.path": args.target_dir,
        "target.dtype": "float32" if args.smoke else "bfloat16",
        "data.dir": args.data,
        "run.out_dir": str(out),
        "drafter.layers": 1,
        "drafter.block_size": args.block_size,
        "drafter.num_target_layers": 3,
        "train.max_steps": args.steps,
        "train.batch_size": 1,
        "train.max_len": args.max_len,
        "train.num_anchors": args.anchors,
        "train.lr": 6e-4,
        "train.warmup_ratio": 0.0,
        "train.log_every": 1,
        "train.eval_every": args.steps,
        "train.save_every": args.steps,
        "train.cache_features": False,  # the target runs for every micro-batch
        "attention.backend": "sdpa" if args.smoke else "flex",
    }
    if args.target != "embedded":
        from dflashkit.target.hf import load_target_config

        over["drafter.mask_token_id"] = int(load_target_config(args.target_dir).vocab_size) - 1
    return over


def run_config(args: argparse.Namespace, out: Path):
    from dflashkit.config import load_config

    target_dev, drafter_dev = placement_devices(args.child)
    variants = (
        f"[{{name: l1, device: '{drafter_dev}'}},"
        f" {{name: l2, overrides: {{drafter.layers: 2, train.lr: 3.0e-4}}, device: '{drafter_dev}'}}]"
    )
    over = base_overrides(args, out) | {"fanout.target_device": target_dev, "fanout.variants": variants}
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def steady_steps_per_s(metrics: Path, skip: int) -> float | None:
    """Steps/s between the first logged step after `skip` and the last one (the training loop alone)."""
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("seconds") is not None and r["step"] > skip]
    if len(rows) < 2 or rows[-1]["seconds"] <= rows[0]["seconds"]:
        return None
    return (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["seconds"] - rows[0]["seconds"])


def watch_dense_warnings() -> list[str]:
    """From now on, collect torch's "flex_attention called without torch.compile" warnings (the dense
    path) into the returned list."""
    import warnings

    dense_warnings: list[str] = []
    shown = warnings.showwarning

    def count_dense(message, category, filename, lineno, file=None, line=None):
        if "without torch.compile" in str(message):
            dense_warnings.append(str(message)[:120])
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = count_dense
    return dense_warnings


def counted_fanout(cfg, args: argparse.Namespace, report: dict, dense_warnings: list[str]):
    """Train the fan-out of `cfg` and count into `report`: errors, dense fall-backs, compiles after
    warm-up, each drafter's steady steps/s, the target's batches. Returns the FanoutResult, or None when
    the run raised (the error is counted, not raised: the table is the point)."""
    import torch
    from rich.console import Console

    from dflashkit.train import fanout

    t0 = time.perf_counter()
    try:
        result = fanout.train_fanout(cfg, console=Console(quiet=True))
    except Exception as e:
        report["errors"] = {"run": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        report["wall_s"] = round(time.perf_counter() - t0, 2)
        return None
    drafters = []
    for d in result.drafters:
        drafters.append(
            {
                "name": d.name,
                "device": d.device,
                "status": d.status,
                "steps": d.steps,
                "error": d.error,
                "steps_per_s": steady_steps_per_s(
                    Path(d.out_dir) / "metrics.jsonl", skip=min(3, args.steps // 4)
                ),
            }
        )
    errors = {d["name"]: d["error"] for d in drafters if d["status"] != "done"}
    dense = sum("DenseFallbackError" in (e or "") for e in errors.values()) + len(dense_warnings)
    report.update(
        {
            "warmup_s": result.warmup_seconds,
            "compiles_after_warmup": result.compiles_after_warmup,
            "dense_fallbacks": dense,
            "target_batches": result.target_batches,
            "target_batches_per_s": round(result.target_batches / result.target_seconds, 2)
            if result.target_seconds
            else None,
            "stream_batches_per_s": round(result.target_batches / result.training_seconds, 2)
            if result.training_seconds
            else None,
            "training_s": result.training_seconds,
            "drafters": drafters,
            "errors": errors,
            "wall_s": round(time.perf_counter() - t0, 2),
            "torch": torch.__version__,
            "torch_git": torch.version.git_version,
        }
    )
    return result


def child(args: argparse.Namespace) -> dict:
    import torch

    from dflashkit.target import packed
    from dflashkit.train import fanout, trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.smoke and torch.cuda.device_count() < (2 if args.child == "split" else 1):
        return {"placement": args.child, "skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    dense_warnings = watch_dense_warnings()
    out = Path(tempfile.mkdtemp(prefix=f"fanout-{args.child}-"))
    cfg = run_config(args, out / "fan")
    report: dict = {"placement": args.child, "devices": placement_devices(args.child)}
    if counted_fanout(cfg, args, report, dense_warnings) is None:
        return report
    if args.sequential:  # the same variants one after another, each with its own target pass per batch
        from dflashkit.config import apply_overrides

        calls = []
        real = packed.target_pass

        def counted(*a, **kw):
            calls.append(1)
            return real(*a, **kw)

        packed.target_pass = counted
        t1 = time.perf_counter()
        singles = {}
        for name, vcfg in fanout.variant_configs(cfg):
            r = trainer.train(apply_overrides(vcfg, {"run.out_dir": str(out / "single" / name)}, name))
            singles[name] = round(r.seconds, 2)
        packed.target_pass = real
        report["sequential"] = {
            "wall_s": round(time.perf_counter() - t1, 2),
            "train_loop_s": singles,
            "target_passes": len(calls),
        }
    return report


# --------------------------------------------------------------------------------------------------
# The driver


def run_one(
    placement: str, rep: int, args: argparse.Namespace, passthrough: list[str], script: str = __file__
) -> dict:
    """One repetition: `script --child placement ...` in a fresh process with a fresh (cold) compile cache;
    its RESULT line, or the error that ended it. The child finds its launch time in BENCH_LAUNCHED_AT."""
    cache = tempfile.mkdtemp(prefix=f"fanout-cache-{placement}-{rep}-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)  # cold: a fresh compile cache each time
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // args.parallel)))
    env["BENCH_LAUNCHED_AT"] = repr(time.time())
    cmd = [sys.executable, script, "--child", placement, *passthrough]
    t0 = time.perf_counter()
    out = run_child(cmd, env, args.timeout_s)
    out.setdefault("placement", placement)
    out["rep"] = rep
    out["process_s"] = round(time.perf_counter() - t0, 1)
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def summarize(runs: list[dict], placements: list[str]) -> list[dict]:
    rows = []
    for placement in placements:
        mine = [r for r in runs if r["placement"] == placement and "skipped" not in r]
        failed = [r for r in mine if r.get("errors")]
        names = sorted({d["name"] for r in mine for d in r.get("drafters", [])})
        rows.append(
            {
                "placement": placement,
                "runs": len(mine),
                "runs_with_error": len(failed),
                "errors": dict(Counter(m for r in failed for m in r["errors"].values()).most_common()),
                "dense_fallbacks": sum(r.get("dense_fallbacks", 0) for r in mine),
                "compiles_after_warmup": sum(r.get("compiles_after_warmup", 0) for r in mine),
                "median_warmup_s": _median([r.get("warmup_s") for r in mine]),
                "median_steps_per_s": {
                    n: _median(
                        [d["steps_per_s"] for r in mine for d in r.get("drafters", []) if d["name"] == n]
                    )
                    for n in names
                },
                "median_target_batches_per_s": _median([r.get("target_batches_per_s") for r in mine]),
                "median_stream_batches_per_s": _median([r.get("stream_batches_per_s") for r in mine]),
                "median_process_s": _median([r.get("process_s") for r in mine]),
                "sequential": [r["sequential"] for r in mine if "sequential" in r],
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    print()
    print(
        f"{'placement':<9} {'runs':>4} {'w/ error':>8} {'dense':>5} {'compiles':>8} {'warm-up s':>9} "
        f"{'drafter steps/s':>22} {'target b/s':>10}"
    )
    for r in rows:
        steps = " ".join(f"{n} {f(v)}" for n, v in r["median_steps_per_s"].items())
        print(
            f"{r['placement']:<9} {r['runs']:>4} {r['runs_with_error']:>8} {r['dense_fallbacks']:>5} "
            f"{r['compiles_after_warmup']:>8} {f(r['median_warmup_s'], '.1f'):>9} {steps:>22} "
            f"{f(r['median_target_batches_per_s']):>10}"
        )
        for msg, n in r["errors"].items():
            print(f"{r['placement']}: {n} x {msg}")
        for s in r["sequential"]:
            print(f"{r['placement']}: one variant after another: {s}")
    print("(medians over the runs; compiles and dense fall-backs summed over all runs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, sdpa, a tiny random target, 1 repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per placement (default 10; smoke 1)")
    ap.add_argument("--placements", default=None, help="comma-separated (default split,shared; smoke cpu)")
    ap.add_argument("--parallel", type=int, default=None, help="repetitions at once (default 4; smoke 1)")
    ap.add_argument("--budget-s", type=float, default=360, help="start no new repetition after this")
    ap.add_argument("--timeout-s", type=int, default=None, help="per repetition (default 300; smoke 900)")
    ap.add_argument("--target", default=None, help=f"{', '.join(TARGET_SHAPES)} or embedded")
    ap.add_argument("--data", default=None, help="a prepared dataset folder (default: random tokens)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rows", type=int, default=64, help="random training rows")
    ap.add_argument("--sequential", action="store_true", help="also train each variant alone (cost model)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads in each repetition")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--target-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke
    defaults = {
        "reps": 1 if smoke else 10,
        "placements": "cpu" if smoke else "split,shared",
        "parallel": 1 if smoke else 4,
        "timeout_s": 900 if smoke else 300,
        "target": "tiny" if smoke else "qwen3-0.6b",
        "steps": 12 if smoke else 30,
        "max_len": 128 if smoke else 1024,
        "anchors": 8 if smoke else 128,
        "block_size": 8 if smoke else 16,
    }
    fill_defaults(args, defaults)

    if args.child:
        print_result(child(args))
        return 0

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    if args.target == "embedded":
        args.target_dir = "embedded"
    else:
        args.target_dir = str(make_target(args.target, work / "target", "float32" if smoke else "bfloat16"))
    if args.data is None:
        args.data = str(make_dataset(work / "data", args.target_dir, args.rows, 2, args.max_len))
    print(
        f"target {args.target} ({args.target_dir}), data {args.data}: ready in {time.perf_counter() - t0:.0f} s"
    )

    placements = [p for p in args.placements.split(",") if p]
    passthrough = [
        *(["--smoke"] if smoke else []),
        *(["--sequential"] if args.sequential else []),
        *("--target", args.target, "--target-dir", args.target_dir, "--data", args.data),
        *("--steps", str(args.steps), "--max-len", str(args.max_len), "--anchors", str(args.anchors)),
        *("--block-size", str(args.block_size), "--parallel", str(args.parallel)),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]
    jobs = [(p, rep) for rep in range(args.reps) for p in placements]  # interleaved: same conditions
    runs: list[dict] = []
    lock = threading.Lock()

    def job(placement_rep: tuple[str, int]) -> None:
        placement, rep = placement_rep
        if time.perf_counter() - t0 > args.budget_s:
            return
        r = run_one(placement, rep, args, passthrough)
        with lock:
            runs.append(r)
            if "skipped" in r:
                status = "skipped: " + r["skipped"]
            elif r.get("errors"):
                status = "error: " + "; ".join(str(v) for v in r["errors"].values())
            else:
                status = (
                    f"ok, warm-up {r['warmup_s']} s, compiles after {r['compiles_after_warmup']}, "
                    f"steps/s {[d['steps_per_s'] and round(d['steps_per_s'], 2) for d in r['drafters']]}"
                )
            print(
                f"[{time.perf_counter() - t0:6.0f}s] {placement} rep {rep}: {r['process_s']} s, {status[:240]}",
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(job, jobs))

    rows = summarize(runs, placements)
    print_table(rows)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "child"},
        "summary": rows,
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    write_report("fanout.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel training, measured: 1 GPU against 2 GPUs (DDP and FSDP2) with `dflashkit train` itself, each
case started by torchrun. Per case: steady step time, global rows/s, peak GPU memory per rank; across cases:
the scaling efficiency of DDP (2 GPUs x batch b against 1 GPU x batch b) and the loss gap between 2 ranks x
batch b and 1 GPU x batch 2b (the same global batch: equal up to float rounding, here bf16 autocast).

The target is a random-weight Qwen3 of the paper's width (hidden 4096, 32/8 heads, vocabulary 151936, 8 layers
so that it is made in seconds; nothing to download), the drafter the paper's (5 layers, B=16, 5 target layers),
rows of 3072 random tokens with 512 anchors, the target's features computed online every step, flex attention
warmed and frozen in each rank. The compile cache is shared across the cases (speed only: each process still
compiles, warm-up then freeze, and the first case pays the cold compile).

    python benchmarks/data_parallel.py --out results/  # 1 or 2 GPUs (estimated 6-9 min on 2: each case
                                                       # also writes, then deletes, a ~13 GB final checkpoint)
    python benchmarks/data_parallel.py --smoke         # CPU, gloo, a tiny random target (about 1 min)

With one GPU only the one-rank cases run (batch b and 2b: step time, rows/s, peak memory); the two-rank
cases and the figures that need them are reported as not run. It prints a table and writes
data_parallel.json to --out (default $OUT), if given. A case runs as
`python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/data_parallel.py --worker DIR
overrides...`, which is `dflashkit train` plus a per-rank record of peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from fanout import TARGET_SHAPES, make_dataset, make_target  # noqa: E402  (the random target and rows)
from report import write_report  # noqa: E402

# The paper's width at 8 layers (Qwen3-8B has 36): a real-sized frozen head and features, made in seconds.
TARGET_SHAPES.setdefault(
    "qwen3-8b-width",
    (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    ),
)

GPU = dict(shape="qwen3-8b-width", dtype="bfloat16", length=3072, anchors=512, block=16, layers=5, n_target=5)
SMOKE = dict(shape="tiny", dtype="float32", length=64, anchors=8, block=4, layers=1, n_target=2)


def overrides(p: dict, data: Path, target: Path, out: Path, steps: int, batch: int, smoke: bool) -> list[str]:
    vocab = TARGET_SHAPES[p["shape"]][1]["vocab_size"]
    o = {
        "target.path": str(target),
        "target.dtype": p["dtype"],
        "data.dir": str(data),
        "run.out_dir": str(out),
        "drafter.layers": p["layers"],
        "drafter.block_size": p["block"],
        "drafter.num_target_layers": p["n_target"],
        "drafter.mask_token_id": vocab - 1,  # a random target has no tokenizer to ask
        "train.max_steps": steps,
        "train.batch_size": batch,
        "train.max_len": p["length"],
        "train.num_anchors": p["anchors"],
        "train.warmup_ratio": 0.0,
        "train.lr": 6e-4,
        "train.log_every": 1,
        "train.eval_every": steps,
        "train.save_every": steps,
        "train.keep_last": 1,
        "train.chunk_blocks": 64,
        "attention.backend": "sdpa" if smoke else "flex",
        "train.autocast": "off" if smoke else "bf16",
        "distributed.fsdp_param_dtype": "float32" if smoke else "bfloat16",
    }
    return [f"{k}={v}" for k, v in o.items()]


def worker(out: str, words: list[str]) -> int:
    """One rank of one case: `dflashkit train`, then this rank's peak memory beside the run."""
    import torch
    from rich.console import Console

    from dflashkit.config import load_config
    from dflashkit.train import trainer

    cfg = load_config(None, words)
    rank = int(os.environ.get("RANK", "0"))
    result = trainer.train(cfg, console=Console() if rank == 0 else Console(quiet=True))
    peak = 0.0
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_gib": peak, "steps": result.steps}))
    return 0


def run_case(name: str, nproc: int, words: list[str], out: Path, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        *words,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"case {name} failed (exit {proc.returncode})")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds = [r["seconds"] for r in records]  # since the loop started (after warm-up), 10 ms resolution
    # steady step time: from the end of step 2 to the end of the last-but-one (the last one evaluates)
    step_s = (
        (seconds[-2] - seconds[1]) / (len(seconds) - 3) if len(seconds) > 3 else seconds[-1] / len(seconds)
    )
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    for folder in ("checkpoints", "best"):  # a paper-shape checkpoint is ~13 GB: keep the disk free
        shutil.rmtree(out / folder, ignore_errors=True)
    return {
        "case": name,
        "processes": nproc,
        "losses": [r["loss"] for r in records],
        "step_s": step_s,
        "peak_gib": max(r["peak_gib"] for r in ranks),
        "wall_s": round(wall, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny random target")
    ap.add_argument("--steps", type=int, default=None, help="steps per case (default 20; smoke 6)")
    ap.add_argument("--batch", type=int, default=1, help="rows per rank per step (b)")
    ap.add_argument(
        "--ranks",
        type=int,
        choices=(1, 2),
        default=None,
        help="1: the one-rank cases only (default: 2 with 2+ GPUs or --smoke)",
    )
    ap.add_argument("--out", default=None, help="folder for data_parallel.json (default: $OUT)")
    ap.add_argument(
        "--work", default=None, help="working folder (default: a new temporary one); reused if set"
    )
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.worker:
        return worker(args.worker, rest)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.smoke and gpus < 1:
        raise SystemExit("needs a GPU (or --smoke on the CPU)")
    ranks = args.ranks or (2 if args.smoke or gpus >= 2 else 1)  # the CPU (gloo) runs two ranks as well
    if ranks == 2 and not args.smoke and gpus < 2:
        raise SystemExit(f"--ranks 2 needs 2 GPUs; this host has {gpus}")
    p = SMOKE if args.smoke else GPU
    steps = args.steps or (6 if args.smoke else 20)
    b = args.batch
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dflashkit-dp-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    target, data = work / "target", work / "data"
    if not (target / "config.json").is_file():
        make_target(
            p["shape"], target, p["dtype"], "cpu" if args.smoke else "cuda"
        )  # GPU: seconds, not minutes
    if not (data / "manifest.json").is_file():
        make_dataset(data, str(target), steps * 2 * b + 8, 4, p["length"])
    print(f"target and data made in {time.perf_counter() - t0:.0f} s under {work}", flush=True)

    cases = [
        ("1 rank, batch b", 1, b, "ddp"),
        ("1 rank, batch 2b", 1, 2 * b, "ddp"),
        ("2 ranks DDP, batch b", 2, b, "ddp"),
        ("2 ranks FSDP2, batch b", 2, b, "fsdp"),
    ]
    if ranks < 2:
        print("one rank: the two-rank cases are not run", flush=True)
        cases = cases[:2]
    results = []
    for i, (name, nproc, batch, strategy) in enumerate(cases):
        words = overrides(p, data, target, work / f"case{i}", steps, batch, args.smoke)
        words.append(f"distributed.strategy={strategy}")
        r = run_case(name, nproc, words, work / f"case{i}", env)
        r["global_batch"] = nproc * batch
        r["rows_per_s"] = r["global_batch"] / r["step_s"]
        results.append(r)
        print(
            f"{name}: {r['step_s'] * 1e3:.1f} ms/step, {r['rows_per_s']:.2f} rows/s, "
            f"peak {r['peak_gib']:.2f} GiB ({r['wall_s']} s)",
            flush=True,
        )

    one_b, one_2b, *two = results

    def gap(a: dict, c: dict) -> float:
        return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], c["losses"], strict=True))

    summary: dict[str, float | str | None] = {
        "batch_2b_vs_b_rows_per_s": one_2b["rows_per_s"] / one_b["rows_per_s"]
    }
    if two:
        ddp, fsdp = two
        summary |= {
            "ddp_scaling_efficiency": ddp["rows_per_s"] / (2 * one_b["rows_per_s"]),
            "ddp_vs_one_rank_2b_max_rel_loss_gap": gap(one_2b, ddp),
            "fsdp_vs_one_rank_2b_max_rel_loss_gap": gap(one_2b, fsdp),
            "fsdp_peak_vs_ddp_peak": fsdp["peak_gib"] / ddp["peak_gib"] if ddp["peak_gib"] else None,
        }
    else:
        summary["two_rank_cases"] = "not run (one GPU, or --ranks 1)"
    device = "cpu (gloo)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"\ndevice: {device}, torch {torch.__version__}, {steps} steps per case, b={b}")
    print("| case | global batch | ms/step | rows/s | peak GiB per rank |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r['global_batch']} | {r['step_s'] * 1e3:.1f} | {r['rows_per_s']:.2f} | "
            f"{r['peak_gib']:.2f} |"
        )
    for k, v in summary.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    report = {"device": device, "gpus": gpus, "torch": torch.__version__, "shape": p, "steps": steps, "b": b}
    report |= {"cases": results, "summary": summary}
    write_report("data_parallel.json", report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

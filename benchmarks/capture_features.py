"""Offline target features: capture speed, training from a capture vs online, and the reader at paper shapes.

1. End to end on the embedded target: prepare a chitchat dataset, `capture` it (bf16 features, the
   target in the training dtype), then train the same steps online (the target runs every step), online
   again (the noise floor of the drafter's own kernels) and from the capture. Reports capture tokens/s,
   seconds per step of each run and the largest loss difference of each run against the first.
2. The reader at a Qwen3-8B-shaped capture (T=3072, 5 x 4096 features): synthetic shards in bf16 and
   fp8, read 16-row micro-batches onto the device through `FeatureStore` (page cache warm) and report
   GB/s and ms per micro-batch, next to the bytes a step needs.

Prints tables and writes JSON to $OUT/capture_features.json if $OUT is set.

    python benchmarks/capture_features.py --data runs/embedded/data   # GPU (embedded target: benchmarks/README.md)
    python benchmarks/capture_features.py --smoke    # CPU, small shapes (about a minute)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# Run from a checkout without installing: make src/ importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dflashkit.config import load_config  # noqa: E402
from dflashkit.data import features  # noqa: E402
from report import write_report  # noqa: E402

GB = 1e9


def end_to_end(work: Path, smoke: bool, steps: int, data: Path | None) -> dict:
    from rich.console import Console

    from dflashkit.data.dataset import PrepareSettings, prepare_dataset
    from dflashkit.train import trainer

    device = "cpu" if smoke else "cuda"
    if data is None:
        data = work / "data"
        prepare_dataset(
            PrepareSettings(
                out=data,
                max_prompts=10 if smoke else 400,
                val_fraction=0.2 if smoke else 0.05,
                max_turns=1,
                max_new_tokens=40 if smoke else 128,
                batch_size=10 if smoke else 64,
                dtype="float32" if smoke else "bfloat16",
                device=device,
            ),
            progress=False,
        )
    over = {
        "data.dir": str(data),
        "run.device": device,
        "target.dtype": "float32" if smoke else "bfloat16",
        "train.autocast": "auto" if smoke else "bf16",
        "attention.backend": "sdpa" if smoke else "flex",
        "train.max_steps": steps,
        "train.eval_every": steps,
        "train.save_every": steps,
        "train.log_every": max(1, steps // 4),
        "train.cache_features": False,
    }
    if smoke:
        over |= {
            "train.max_len": 96,
            "train.num_anchors": 12,
            "drafter.block_size": 4,
            "train.chunk_blocks": 4,
        }

    def cfg(name: str, **extra):
        return load_config(
            "configs/embedded.yaml",
            [f"{k}={v}" for k, v in {**over, "run.out_dir": work / name, **extra}.items()],
        )

    t0 = time.perf_counter()
    m = features.capture_features(
        cfg("unused"), features.CaptureSettings(out=work / "features", dtype="bfloat16"), progress=False
    )
    capture_wall = time.perf_counter() - t0
    quiet = Console(quiet=True)
    runs = {}
    for name, extra in (
        ("online", {}),
        ("online again", {}),
        ("offline bf16", {"data.features_dir": str(work / "features")}),
    ):
        result = trainer.train(cfg(name.replace(" ", "-"), **extra), console=quiet)
        # Steady training time from the log: between the first and the last logged step (no evaluation
        # runs in between; warm-up is before the clock starts).
        log = [json.loads(x) for x in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in log if "seconds" in r]
        per_step = (timed[-1]["seconds"] - timed[0]["seconds"]) / max(1, timed[-1]["step"] - timed[0]["step"])
        runs[name] = {"losses": result.losses, "seconds_per_step": per_step}
    first = runs["online"]["losses"]
    rows = []
    for name, r in runs.items():
        rows.append(
            {
                "run": name,
                "seconds_per_step": r["seconds_per_step"],
                "max_abs_loss_diff_vs_online": max(
                    abs(a - b) for a, b in zip(r["losses"], first, strict=True)
                ),
                "identical_losses": r["losses"] == first,
            }
        )
    print(
        f"\ncapture: {m['splits']['train']['rows']} + {m['splits']['validation']['rows']} rows of {m['max_len']} tokens "
        f"in {capture_wall:.1f} s ({m['run']['tokens_per_second']} tokens/s in the target passes), "
        f"{m['bytes'] / 2**20:.1f} MiB, {m['bytes_per_token']['total']} B per token"
    )
    print(f"{'run':14} {'s/step':>8} {'max |dloss|':>12} {'identical':>9}")
    for r in rows:
        print(
            f"{r['run']:14} {r['seconds_per_step']:8.4f} {r['max_abs_loss_diff_vs_online']:12.3e} {r['identical_losses']!s:>9}"
        )
    return {"capture": {k: m[k] for k in ("splits", "bytes", "bytes_per_token", "run")}, "runs": rows}


def synthetic_capture(
    folder: Path, rows: int, T: int, hidden: int, layers: int, dtype: str, per_shard: int
) -> None:
    """A capture-shaped folder of random features (only what `FeatureStore` reads is in the manifest)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shards = []
    for index, (start, stop) in enumerate(features.shard_ranges(rows, per_shard)):
        feats = torch.randn(stop - start, T, layers * hidden, generator=g, dtype=torch.float32)
        tensors = {
            **features.encode_features(feats, dtype, layers),
            "labels": torch.zeros(stop - start, T, dtype=torch.int32),
        }
        name = features.shard_name("train", index)
        features.write_shard(folder / name, tensors, {"split": "train", "start": start, "stop": stop})
        shards.append({"file": name, "start": start, "stop": stop})
    manifest = {
        "kind": features.KIND,
        "schema": features.SCHEMA,
        "dtype": dtype,
        "splits": {"train": {"rows": rows, "shards": shards}},
    }
    (folder / features.MANIFEST_FILE).write_text(json.dumps(manifest))


def reader(work: Path, smoke: bool) -> list[dict]:
    device = torch.device("cpu" if smoke else "cuda")
    T, hidden, layers, batch = (256, 576, 3, 4) if smoke else (3072, 4096, 5, 16)
    rows = 2 * batch if smoke else 64
    results = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        folder = work / f"reader-{dtype}"
        synthetic_capture(folder, rows, T, hidden, layers, dtype, per_shard=batch)
        store = features.FeatureStore(folder)
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).tolist()
        store.read("train", order[:batch], device, torch.bfloat16)  # page cache and allocator warm
        if device.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for s in range(0, rows - batch + 1, batch):
            t0 = time.perf_counter()
            feats, _ = store.read("train", order[s : s + batch], device, torch.bfloat16)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        stored = batch * T * features.bytes_per_token(hidden, layers, dtype)["total"]
        best = min(times)
        results.append(
            {
                "dtype": dtype,
                "micro_batch": f"{batch} x {T} x {layers * hidden}",
                "stored_bytes_per_micro_batch": stored,
                "ms_per_micro_batch": 1000 * sum(times) / len(times),
                "best_ms": 1000 * best,
                "stored_GB_per_s": stored / best / GB,
            }
        )
        del feats
    print(
        f"\n{'reader':14} {'micro-batch':>22} {'stored MB':>10} {'ms (mean)':>10} {'ms (best)':>10} {'GB/s':>7}"
    )
    for r in results:
        print(
            f"{r['dtype']:14} {r['micro_batch']:>22} {r['stored_bytes_per_micro_batch'] / 1e6:10.0f} "
            f"{r['ms_per_micro_batch']:10.1f} {r['best_ms']:10.1f} {r['stored_GB_per_s']:7.2f}"
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 100; smoke 4)")
    ap.add_argument(
        "--skip-end-to-end", action="store_true", help="only the reader (no embedded target needed)"
    )
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    ap.add_argument(
        "--data", help="a prepared dataset folder (e.g. runs/embedded/data) instead of preparing one"
    )
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke")
    steps = args.steps or (4 if args.smoke else 100)
    with tempfile.TemporaryDirectory(prefix="capture-bench-") as tmp:
        work = Path(args.work or tmp)
        out = {"smoke": args.smoke, "torch": torch.__version__, "steps": steps}
        if not args.skip_end_to_end:
            out["end_to_end"] = end_to_end(work, args.smoke, steps, Path(args.data) if args.data else None)
        out["reader"] = reader(work, args.smoke)
    out["bytes_per_token"] = {
        "embedded 3 x 576 bf16": features.bytes_per_token(576, 3, "bfloat16"),
        "qwen3-8b 5 x 4096 bf16": features.bytes_per_token(4096, 5, "bfloat16"),
        "qwen3-8b 5 x 4096 fp8": features.bytes_per_token(4096, 5, "float8_e4m3fn"),
    }
    write_report("capture_features.json", out)


if __name__ == "__main__":
    main()

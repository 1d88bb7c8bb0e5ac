"""A run's metrics: one JSON record per logged step in metrics.jsonl (and, with train.tensorboard, the
same scalars in TensorBoard), the curves as training.png at the end. Rank 0 writes; every rank may call.

A training record holds the step's loss, learning rate, gradient norm and the acceptance of the training
batches since the last record; an evaluation adds "val": the held-out measurement (`validation.validate`),
with, at train.serve_temperature > 0, the expected acceptance lengths at that temperature beside the
greedy ones (and the curve of the served-order one in training.png).
A resumed run first drops the records of the steps it trains again (`trim_metrics`), so every step is
logged once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflashkit.atomic import atomic_file, json_text
from dflashkit.config import RunConfig
from dflashkit.errors import ConfigError
from dflashkit.model.acceptance import served_tau

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training.png"


class MetricsLog:
    """metrics.jsonl (+ TensorBoard) of a run folder. ``resumed_at``: the step a resume continues from
    (later records are dropped); None: a new run (an old file is removed). ``write=False``: a rank that
    does not write."""

    def __init__(self, cfg: RunConfig, out_dir: Path, *, resumed_at: int | None, write: bool = True):
        self.path = out_dir / METRICS_FILE
        self.write = write
        self.tensorboard = None
        if not write:
            return
        if resumed_at is not None:
            trim_metrics(self.path, resumed_at)
        elif self.path.exists():
            self.path.unlink()
        self.tensorboard = open_tensorboard(cfg, out_dir)

    def log(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(json_text(record, indent=None) + "\n")
        if self.tensorboard is not None:
            step = record["step"]
            for key in ("loss", "lr", "grad_norm", "acceptance_length"):
                if record.get(key) is not None:
                    self.tensorboard.add_scalar(f"train/{key}", record[key], step)
            for key, value in record.get("val", {}).items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(f"val/{key}", value, step)

    def close(self) -> None:
        """Close TensorBoard and draw the curves (training.png)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.write:
            plot_training(self.path, self.path.with_name(PLOT_FILE))


def open_tensorboard(cfg: RunConfig, out: Path) -> Any:
    if not cfg.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.tensorboard=true needs the tensorboard package: pip install tensorboard"
        ) from None
    return SummaryWriter(str(out / "tensorboard"))


def trim_metrics(path: Path, step: int) -> int:
    """Drop the records after ``step`` from metrics.jsonl (steps a resume will train again, so that they
    are not logged twice); returns how many were dropped. The file is replaced atomically."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a torn last line of a crash: dropped
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in step order, one per step: where a step was logged twice (a run
    resumed by an older dflashkit trained it again) the later record wins; a torn line is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def plot_training(metrics_path: Path, png: Path) -> Path | None:
    """Loss and acceptance length (training batches and held-out) over steps, as one PNG."""
    if not metrics_path.is_file():
        return None
    from matplotlib.figure import Figure  # not pyplot: its global state is not for threads (fan-out)

    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("loss") is not None]
    val = [r for r in records if "val" in r]
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], color="#3b7dd8")
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted block cross-entropy")
    ax2.plot(
        [r["step"] for r in train],
        [r["acceptance_length"] for r in train],
        label="training batches",
        color="#3b7dd8",
    )
    ax2.plot(
        [r["step"] for r in val],
        [r["val"]["acceptance_length"] for r in val],
        "o-",
        label="held-out, mean over anchors",
        color="#d8663b",
    )
    ax2.plot(
        [r["step"] for r in val],
        [served_tau(r["val"]) for r in val],
        "s--",
        label="held-out, served order (what serving measures)",
        color="#2a9d5c",
    )
    expected = [r for r in val if "served_expected_acceptance_length" in r["val"]]
    if expected:  # train.serve_temperature > 0: the figure best/ is chosen by
        ax2.plot(
            [r["step"] for r in expected],
            [r["val"]["served_expected_acceptance_length"] for r in expected],
            "^:",
            label=f"held-out, served order, expected at T={expected[-1]['val']['serve_temperature']:g} "
            f"({expected[-1]['val']['serve_draft_sampling']})",
            color="#8a3bd8",
        )
    ax2.set_xlabel("step")
    ax2.set_ylabel("exact block acceptance length")
    ax2.legend()
    fig.tight_layout()
    with atomic_file(png) as tmp:  # never a half-written plot
        fig.savefig(tmp, dpi=110, format="png")
    return png

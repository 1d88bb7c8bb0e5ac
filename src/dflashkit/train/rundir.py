"""A run folder's two rules: a new run never lands on an earlier one, and `--resume` continues a run only
with the settings it was trained with.

- `claim_run_folder`: training without ``--resume`` into a folder that holds a run's files refuses, naming
  the choices (``--resume``, another ``--out``, or ``--move-aside``, which moves the earlier run's files to
  ``<folder>.old-<time>``; nothing is ever deleted).
- `check_resume_config`: on ``--resume`` the config is compared with the one the checkpoint was trained
  with (its run_config.yaml); a change to the model, the data, the loss or the optimizer is refused, each
  key named with both values. `RESUMABLE_KEYS` lists what may change.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from dflashkit.config import RunConfig
from dflashkit.errors import ConfigError

# What a training run writes into its folder (run.out_dir). Anything else there (a dataset folder, say)
# is not the run's and stays where it is.
RUN_FILES = (
    "config.yaml",
    "fingerprint.json",
    "metrics.jsonl",
    "training.png",
    "checkpoints",
    "best",
    "eval",
    "bench",
    "tensorboard",
    "error.txt",
    "fanout.json",
)

# Keys that may change on --resume: how long it trains, how often it logs, evaluates and saves, where and
# how fast it runs (device, ranks, attention kernels, compile, precision of the forward), and the
# evaluation settings of `dflashkit eval`. A key ending in "." stands for its whole section. Every other
# key (the target, the drafter, the data, the loss, the optimizer and its schedule, and any key added
# later) must stay as the run was trained.
RESUMABLE_KEYS = (
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.tensorboard",
    "train.batch_size",  # the global batch may change: the log says so
    "train.grad_accum",
    "train.cache_features",
    "train.chunk_blocks",
    "train.compile",
    "train.autocast",
    "drafter.init",  # the checkpoint holds the weights
    "data.features_dir",  # a capture is checked against the data and the target when it is used
    "data.batch_size",  # how `prepare` generates (replies at once, backend), not what the data holds
    "data.backend",
    "attention.",
    "run.",
    "distributed.",
    "eval.",
    "fanout.",
)

# What a refused key changes, for the message (first match wins; anything else: "the training").
_KINDS = (
    ("target.", "the model"),
    ("drafter.", "the model"),
    ("data.", "the data"),
    ("train.max_len", "the data"),
    ("train.seed", "the data"),
    ("train.num_anchors", "the loss"),
    ("train.gamma", "the loss"),
    ("train.loss_weighting", "the loss"),
    ("train.dpace_alpha", "the loss"),
    ("train.labels", "the loss"),
    ("train.distill", "the loss"),
    ("train.loss", "the loss"),  # train.loss_temperature too
    ("train.serve_", "the best/ choice"),
    ("train.lr", "the optimizer"),
    ("train.betas", "the optimizer"),
    ("train.weight_decay", "the optimizer"),
    ("train.warmup_ratio", "the optimizer"),
    ("train.min_lr_ratio", "the optimizer"),
    ("train.grad_clip", "the optimizer"),
)


# --------------------------------------------------------------------------------------------------
# A new run never lands on an earlier one


class RunExistsError(ConfigError):
    """Training without --resume into a folder that holds a run."""


def run_files(out_dir: Path, names: Iterable[str] = RUN_FILES) -> list[str]:
    """The names among ``names`` that exist in ``out_dir``."""
    return [n for n in names if (out_dir / n).exists()]


def claim_run_folder(
    out_dir: Path,
    *,
    move_aside: bool,
    report: Callable[[str], None],
    names: Iterable[str] = RUN_FILES,
    what: str = "a run",
) -> Path | None:
    """Make sure a new run may write into ``out_dir``: refuse when it holds ``names`` (a run's files), or,
    with ``move_aside``, move them to a new folder ``<out_dir>.old-<time>`` and return it."""
    found = run_files(out_dir, names)
    if not found:
        return None
    if not move_aside:
        raise RunExistsError(
            f"{out_dir} already holds {what} ({', '.join(found)}); continue it with --resume, train into "
            f"another folder with --out DIR, or pass --move-aside to move its files to "
            f"{out_dir}.old-<time> first (nothing is deleted)"
        )
    dest = _aside_path(out_dir)
    dest.mkdir(parents=True)
    for name in found:
        os.rename(out_dir / name, dest / name)
    stayed = [p.name for p in out_dir.iterdir()] if out_dir.is_dir() else []
    note = f"; {', '.join(sorted(stayed))} stayed" if stayed else ""
    report(f"moved the earlier run's files ({', '.join(found)}) to {dest}{note}")
    return dest


def _aside_path(out_dir: Path) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    dest = out_dir.with_name(f"{out_dir.name}.old-{stamp}")
    k = 1
    while dest.exists():
        k += 1
        dest = out_dir.with_name(f"{out_dir.name}.old-{stamp}-{k}")
    return dest


# --------------------------------------------------------------------------------------------------
# --resume continues with the run's own settings

RUN_CONFIG_FILE = "run_config.yaml"  # in every checkpoint: the config it was trained with


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists and scalars are values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def is_resumable_key(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS)


def _kind(key: str) -> str:
    return next((kind for prefix, kind in _KINDS if key == prefix or key.startswith(prefix)), "the training")


def config_changes(saved: dict[str, Any], current: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of every key whose change a resume refuses. A key the saved config
    lacks (added to dflashkit since) counts with its default; a key it has that no longer exists is ignored."""
    now = flatten(current.model_dump(mode="json"))
    defaults = flatten(RunConfig().model_dump(mode="json"))
    then = flatten(saved)
    changes = []
    for key, value in now.items():
        before = then.get(key, defaults.get(key))
        if not is_resumable_key(key) and _normalise(before) != _normalise(value):
            changes.append((key, before, value))
    return changes


def _normalise(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def read_run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config a checkpoint was trained with (its run_config.yaml, else its run folder's config.yaml),
    as a plain mapping; None when neither is there."""
    for path in (checkpoint / RUN_CONFIG_FILE, checkpoint.parent.parent / "config.yaml"):
        if path.is_file():
            try:
                data = yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                raise ConfigError(
                    f"{path} is not valid YAML ({e}); the run's config cannot be compared"
                ) from None
            if isinstance(data, dict):
                return data
    return None


def check_resume_config(checkpoint: Path, cfg: RunConfig) -> None:
    """Refuse to resume ``checkpoint`` with a config that changes what it was trained with (the model, the
    data, the loss, the optimizer): one `ConfigError` naming each key with both values."""
    saved = read_run_config(checkpoint)
    if saved is None:
        return
    changes = config_changes(saved, cfg)
    if not changes:
        return
    listed = "; ".join(f"{key} {_show(old)} -> {_show(new)} ({_kind(key)})" for key, old, new in changes)
    run = checkpoint.parent.parent
    raise ConfigError(
        f"--resume: {checkpoint} was trained with other settings: {listed}. A checkpoint continues only the "
        f"run it belongs to: resume with the run's own values ({run / 'config.yaml'}), or start a new run "
        f"with --out DIR (drafter.init={run / 'best'} starts it from this run's drafter). What may change on "
        "--resume: train.max_steps, train.epochs, the log/eval/save cadence, train.keep_last, "
        "train.tensorboard, the batch split, run.*, attention.*, distributed.*, eval.* (docs/training.md, Resuming)"
    )


def _show(value: Any) -> str:
    return "(unset)" if value is None else str(value)

"""A run's checkpoints: where a resume continues from, and writing checkpoints and best/.

    checkpoints/step-000100/  (z-lab drafter + training state + run config + fingerprint; atomic)
    checkpoints/latest        (name of the newest complete checkpoint)
    best/                     (z-lab drafter, bf16, with the best held-out served-order acceptance length)

The run folder's rules come first, before anything slow loads (`open_run_folder`): a new run never
replaces an earlier one (`rundir.claim_run_folder`), and a resume continues from the newest intact
checkpoint if the config keeps what it was trained with (`rundir.check_resume_config`) and the
environment has not drifted (`check_env_drift`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.atomic import atomic_dir, json_text
from dflashkit.config import RunConfig, dump_config
from dflashkit.data.dataset import dataset_identity, held_out_prompts_fingerprint
from dflashkit.errors import CheckpointError, EnvironmentDriftError
from dflashkit.lock import hold_folder
from dflashkit.model.checkpoint import write_checkpoint
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.runtime import fingerprint
from dflashkit.runtime.doctor import show_diff_changes
from dflashkit.train import distributed, state
from dflashkit.train.rundir import RUN_CONFIG_FILE, check_resume_config, claim_run_folder
from dflashkit.train.setup import Run

CHECKPOINTS = "checkpoints"
BEST = "best"
BEST_METRICS = "metrics.json"
# The training state's record of the best held-out served-order acceptance length so far. Checkpoints
# written before evaluation measured the served order kept the mean over anchors under
# "best_acceptance_length": never compared with a served-order figure (`best_so_far`).
BEST_KEY = "best_served_acceptance_length"
# In every checkpoint: the dataset it trained on ({"dir", "splits": {split: sha256}}); a resume refuses
# a dataset whose splits changed (`check_resume_dataset`).
DATASET_FILE = "dataset.json"
# The train settings best/metrics.json records under "train": the loss and the serving it was chosen for.
TRAINED_WITH = {"loss", "loss_temperature", "distill", "serve_temperature", "serve_draft_sampling"}


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume continues from, and its training state as read (checked) from disk."""

    checkpoint: Path
    saved: state.SavedState


def find_resume_point(cfg: RunConfig, d: distributed.Dist, console: Any) -> ResumePoint | None:
    """The checkpoint a resume continues from (the newest intact one, `state.pick_resume_checkpoint`) and
    its training state, checked against the config before anything slow loads. None: no checkpoint."""
    root = Path(cfg.run.out_dir) / CHECKPOINTS
    while True:
        ckpt = state.pick_resume_checkpoint(
            root, lambda m: console.print(f"[yellow]{m}[/]"), set_aside=d.is_main
        )
        if ckpt is None:
            return None
        check_resume_config(ckpt, cfg)
        check_resume_dataset(ckpt, cfg)
        try:
            return ResumePoint(ckpt, state.read_training_state(ckpt))
        except CheckpointError as e:  # unreadable in a way its checksums could not tell: try an older one
            console.print(f"[yellow]checkpoint {ckpt.name} is damaged: {e}[/]")
            if not d.is_main:
                raise
            state.set_aside_damaged(ckpt, lambda m: console.print(f"[yellow]{m}[/]"))


def check_resume_dataset(ckpt: Path, cfg: RunConfig) -> None:
    """Refuse to resume ``ckpt`` on a dataset whose splits differ from the ones it trained on (re-split or
    rewritten in place), naming each changed split. A checkpoint without the record is not checked."""
    try:
        recorded = json.loads((ckpt / DATASET_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    now = dataset_identity(cfg.data.dir)
    if now is None:  # no finished dataset there: setting up the run says so, naming the folder
        return
    changed = [f"{name} split" for name, digest in recorded.items() if now.get(name) != digest]
    if changed:
        raise CheckpointError(
            f"--resume: the dataset {cfg.data.dir} changed since {ckpt} trained on it ({' and '.join(changed)}: "
            "other records); resume on the dataset it trained on, or start a new run with --out DIR "
            f"(drafter.init={ckpt.parent.parent / BEST} starts it from this run's drafter)"
        )


def open_run_folder(
    cfg: RunConfig, d: distributed.Dist, *, resume: bool, move_aside: bool, console: Any
) -> ResumePoint | None:
    """The run folder's rules, before anything slow loads (every rank reads the same files): without
    ``resume`` a folder holding a run is refused (or, with ``move_aside``, its files are moved to
    ``<out>.old-<time>`` first); with it, the point to continue from (None: start from scratch)."""
    out = Path(cfg.run.out_dir)
    if d.is_main:  # one writer per run folder, until the command ends (`dflashkit.lock`)
        hold_folder(out)
    point = find_resume_point(cfg, d, console) if resume else None
    if resume and point is None:
        console.print(f"[yellow]no checkpoint in {out / CHECKPOINTS}: starting from scratch[/]")
    if not resume and (d.is_main or not move_aside):  # every rank refuses alike; rank 0 alone moves
        claim_run_folder(out, move_aside=move_aside, report=console.print)
    distributed.barrier(d)
    if point is not None:
        check_env_drift(point.checkpoint, cfg.run.allow_env_drift, console)
    return point


def check_env_drift(ckpt: Path, allow: bool, console: Any) -> None:
    """Resuming in a changed environment shows the diff, and refuses a critical change unless allowed."""
    changes = fingerprint.diff(fingerprint.load(ckpt), fingerprint.collect())
    if not changes:
        return
    show_diff_changes(changes, str(ckpt), "this environment", console)
    if fingerprint.has_critical(changes) and not allow:
        keys = ", ".join(c.key for c in changes if c.critical)
        raise EnvironmentDriftError(
            f"the checkpoint {ckpt} was written in another environment (critical: {keys}); resume there, or "
            "pass --allow-env-drift (run.allow_env_drift=true) to continue anyway"
        )


def load_weights(drafter: DFlashDrafter, weights: dict[str, Tensor], where: Path) -> None:
    """Put a checkpoint's weights into the run's drafter; a mismatch is one clear error, never a traceback."""
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as e:
        detail = (str(e).strip().splitlines() or [""])[-1].strip()[:200]
        raise CheckpointError(
            f"{where} holds a drafter of another shape than this config makes ({detail}); resume with the "
            "run's own drafter settings, or start a new run"
        ) from None


def best_figure(cfg: RunConfig) -> str:
    """The held-out figure best/ is chosen by: the served-order acceptance length at the temperature the
    config serves at (train.serve_temperature), exact at 0 and expected above (`validation.validate`)."""
    return (
        "served_expected_acceptance_length" if cfg.train.serve_temperature > 0 else "served_acceptance_length"
    )


def best_metric(val: dict[str, Any], cfg: RunConfig) -> float:
    """``val``'s `best_figure` (nan where it is missing)."""
    return float(val.get(best_figure(cfg), float("nan")))


def best_so_far(extra: dict[str, Any], out_dir: Path, cfg: RunConfig) -> float:
    """The best held-out served-order acceptance length of a resumed run (`best_figure`; a resume keeps
    train.serve_temperature). A checkpoint written before it was recorded holds another figure (the mean
    over anchors, higher than the served order), so the best is then read from best/metrics.json where
    that holds a served-order figure; without one, none is known (-inf) and the next evaluation writes
    best/ again."""
    if BEST_KEY in extra:
        return float(extra[BEST_KEY])
    try:
        served = json.loads((out_dir / BEST / BEST_METRICS).read_text()).get(best_figure(cfg))
    except (OSError, ValueError, AttributeError):
        served = None
    return float(served) if isinstance(served, (int, float)) and math.isfinite(served) else float("-inf")


def save_checkpoint(
    run: Run,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    cursor: dict[str, int],
    generator: torch.Generator,
    extra: dict[str, Any],
) -> Path:
    """Atomically write drafter + training state + run config + fingerprint as checkpoints/step-N.

    Under torchrun every rank calls this (FSDP gathers the full weights and optimizer state); rank 0
    writes the one checkpoint, and the ranks meet at a barrier once it is published."""
    d = run.dist
    root = run.out_dir / CHECKPOINTS
    name = state.step_dir_name(step)
    weights = distributed.full_state_dict(run.drafter, d)
    opt = distributed.checkpoint_optimizer(run.drafter, optimizer, d, gather=True)
    if d.is_main:
        with atomic_dir(root / name, checksums=True) as tmp:
            _write_weights(run, weights, tmp, torch.float32)
            state.save_training_state(
                tmp, opt, scheduler, step, cursor, state.capture_rng({"anchors": generator}), extra
            )
            (tmp / RUN_CONFIG_FILE).write_text(dump_config(run.cfg))
            (tmp / DATASET_FILE).write_text(json.dumps(trained_dataset(run), indent=2) + "\n")
            fingerprint.save(fingerprint.collect(), tmp / fingerprint.FINGERPRINT_FILE)
        state.write_latest(root, name)
        state.rotate_checkpoints(root, run.cfg.train.keep_last)
    distributed.barrier(d)
    return root / name


def save_best(run: Run, step: int, metrics: dict[str, Any]) -> None:
    """Atomically write best/ (every rank calls this under torchrun; rank 0 writes)."""
    d = run.dist
    weights = distributed.full_state_dict(run.drafter, d)
    if not d.is_main:
        return
    with atomic_dir(run.out_dir / BEST, checksums=True) as tmp:
        _write_weights(run, weights, tmp, torch.bfloat16)  # bf16 z-lab layout: what serving loads
        # data_dir and its held-out prompts: what these numbers were measured on (eval and bench compare like
        # with like: the same folder, or another dataset holding out the same prompts)
        record = {
            "step": step,
            "data_dir": str(Path(run.cfg.data.dir).resolve()),
            "held_out_prompts": held_out_prompts_fingerprint(run.cfg.data.dir),
            # how it was trained, for a best/ copied out of its run (bench's sampling table names the loss)
            "train": run.cfg.train.model_dump(include=TRAINED_WITH),
            **metrics,
        }
        (tmp / BEST_METRICS).write_text(json_text(record) + "\n")
        fingerprint.save(fingerprint.collect(), tmp / fingerprint.FINGERPRINT_FILE)


def trained_dataset(run: Run) -> dict[str, Any]:
    """What `DATASET_FILE` records: the dataset folder and each split's sha256, as the run loaded it (its
    manifest; computed from the files for a dataset made before the manifest held them)."""
    splits = run.manifest.get("splits", {})
    digests = {name: info.get("sha256") for name, info in splits.items()}
    if not digests or not all(digests.values()):
        digests = dataset_identity(run.cfg.data.dir) or {}
    return {"dir": str(Path(run.cfg.data.dir).resolve()), "splits": digests}


def _write_weights(run: Run, weights: dict[str, Tensor], folder: Path, dtype: torch.dtype) -> None:
    write_checkpoint(folder, run.drafter.config, {k: v.to(dtype) for k, v in weights.items()})

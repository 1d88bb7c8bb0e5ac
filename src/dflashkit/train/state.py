"""Training state that survives a crash: random-number streams, atomic checkpoint folders, resume.

A checkpoint is a folder `<root>/step-00001000/` written through `atomic_dir`: everything goes into a
temporary folder beside it, every file is fsynced, and one rename publishes it. A crash (an exception, or
the process dying) before that rename leaves the previous checkpoints as they were. `<root>/latest` is a
small text file naming the newest complete checkpoint, replaced atomically after the rename;
`rotate_checkpoints` keeps the last k. Typical use by the trainer:

    with atomic_dir(root / step_dir_name(step), checksums=True) as tmp:
        save_model(tmp, ...)                                   # the drafter in the z-lab layout
        save_training_state(tmp, optimizer, scheduler, step, data_cursor, capture_rng(gens), extra)
    write_latest(root, step_dir_name(step))
    rotate_checkpoints(root, keep_last=3)

The training state is two files: `training_state.pt` (optimizer, scheduler and RNG tensors; loads with
torch.load(weights_only=True)) and `training_state.json` (step, data cursor, extra: human-readable).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.atomic import fsync_path
from dflashkit.errors import CheckpointError
from dflashkit.integrity import CorruptFileError, MissingChecksumsError, read_checksums, verify_files

STATE_TENSORS = "training_state.pt"
STATE_JSON = "training_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------------
# Random-number streams


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Snapshot of every random stream: python `random`, numpy (if installed), torch CPU, every CUDA device,
    and each named torch.Generator in `generators`. Contains only plain types and tensors."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put every random stream back as `capture_rng` saw it.

    CUDA streams are restored for the devices present both then and now. A named generator must be in the
    snapshot (a missing one is an error: its stream would silently start over).
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state["torch_cuda"]
    if cuda_states and torch.cuda.is_available():
        for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device=i)
    for name, g in (generators or {}).items():
        if name not in state["generators"]:
            raise CheckpointError(
                f"the checkpoint has no random state for generator {name!r}; resume from a "
                "checkpoint saved by the same training setup"
            )
        g.set_state(state["generators"][name])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------------------------------
# Atomic checkpoint folders


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint at `step`: step-00001000 (sorts by step)."""
    return f"step-{step:08d}"


def write_latest(root: str | Path, name: str) -> None:
    """Point `<root>/latest` at checkpoint folder `name` (atomic replace of a one-line text file)."""
    root = Path(root)
    if not (root / name).is_dir():
        raise CheckpointError(f"cannot mark {root / name} as latest: it is not a checkpoint folder")
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def read_latest(root: str | Path) -> Path | None:
    """The checkpoint folder `<root>/latest` names, or None when there is no checkpoint yet."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(
            f"{pointer} names {path.name}, which does not exist; point it at an existing "
            "step-* folder or delete it to start over"
        )
    return path


def rotate_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step-* folders (never the one `latest` names), and leftovers of
    interrupted saves (.step-*.tmp-* / .old-*). Returns the deleted paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
    root = Path(root)
    latest = read_latest(root)
    steps = sorted(
        (p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name
    )
    doomed = [p for p in steps[:-keep_last] if p != latest]
    doomed += [p for p in root.iterdir() if p.is_dir() and re.match(r"^\.step-\d+\.(tmp|old)-", p.name)]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


# ---------------------------------------------------------------------------------------------------------
# Optimizer, scheduler, progress


@dataclass(frozen=True)
class TrainingState:
    """What `load_training_state` returns besides the optimizer and scheduler it fills in place."""

    step: int
    data_cursor: Any
    rng: dict[str, Any]
    extra: dict[str, Any]


def save_training_state(
    directory: str | Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    step: int,
    data_cursor: Any,
    rng: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the training state into `directory` (normally the temporary folder of `atomic_dir`).

    data_cursor and extra must be JSON-serialisable (e.g. {"epoch": 2, "index": 5120}).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    progress = {"step": step, "data_cursor": data_cursor, "extra": dict(extra or {})}
    text = json.dumps(progress, indent=2)  # fails before anything is written if not serialisable
    tensors = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": dict(rng),
    }
    torch.save(tensors, directory / STATE_TENSORS)
    (directory / STATE_JSON).write_text(text + "\n")


def load_training_state(
    directory: str | Path, optimizer: torch.optim.Optimizer, scheduler: Any | None = None
) -> TrainingState:
    """Load the state in `directory`: fills `optimizer` and `scheduler` in place, returns the rest.

    Call `restore_rng(state.rng, generators)` afterwards to resume the random streams.
    """
    return apply_training_state(read_training_state(directory), optimizer, scheduler)


@dataclass(frozen=True)
class SavedState:
    """A checkpoint's training state as read from disk, before it goes into an optimizer."""

    directory: Path
    progress: dict[str, Any]
    tensors: dict[str, Any]


def read_training_state(directory: str | Path) -> SavedState:
    """Read (and check against its checksums) the training state of a checkpoint folder; a missing,
    truncated or corrupted file is a `CheckpointError` naming it."""
    directory = Path(directory)
    if not (directory / STATE_TENSORS).exists() or not (directory / STATE_JSON).exists():
        raise CheckpointError(
            f"{directory} holds no training state ({STATE_TENSORS} and {STATE_JSON}); "
            "point the resume path at a step-* folder written by `dflashkit train`"
        )
    verify_files(directory, [STATE_JSON, STATE_TENSORS])
    try:
        progress = json.loads((directory / STATE_JSON).read_text())
        progress["step"], progress["data_cursor"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{directory / STATE_JSON} is corrupted ({e})") from None
    try:
        tensors = torch.load(directory / STATE_TENSORS, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CorruptFileError(
            f"{directory / STATE_TENSORS} cannot be read ({str(e).strip().splitlines()[0][:200]}); the file is "
            "truncated or corrupted"
        ) from None
    return SavedState(directory, progress, tensors)


def apply_training_state(
    saved: SavedState, optimizer: torch.optim.Optimizer, scheduler: Any | None = None
) -> TrainingState:
    """Fill `optimizer` and `scheduler` from a read training state; returns the rest."""
    progress, tensors = saved.progress, saved.tensors
    try:
        optimizer.load_state_dict(tensors["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(
            f"{saved.directory}: its optimizer state does not fit this drafter ({str(e).strip()[:200]}); "
            "resume with the run's own settings, or start a new run"
        ) from None
    if scheduler is not None:
        if tensors["scheduler"] is None:
            raise CheckpointError(
                f"{saved.directory} was saved without a scheduler; resume with the same schedule"
            )
        scheduler.load_state_dict(tensors["scheduler"])
    return TrainingState(progress["step"], progress["data_cursor"], tensors["rng"], progress.get("extra", {}))


# ---------------------------------------------------------------------------------------------------------
# Which checkpoint a resume continues from


def step_dirs(root: str | Path) -> list[Path]:
    """The step-* checkpoint folders of `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), reverse=True)


def check_checkpoint(folder: str | Path) -> None:
    """That every file of a checkpoint folder is whole: checked against its checksums (a folder without
    them is refused, `integrity.require_checksums`, unless allowed: then by structure), and its training
    state readable. Raises `CheckpointError`."""
    folder = Path(folder)
    verify_files(folder, None if read_checksums(folder) is not None else _STRUCTURED_FILES)
    for name in ("config.json", STATE_JSON):
        try:
            json.loads((folder / name).read_text())
        except FileNotFoundError:
            raise CorruptFileError(f"{folder / name} is missing; the checkpoint is incomplete") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptFileError(f"{folder / name} is corrupted ({e})") from None


_STRUCTURED_FILES = ("model.safetensors", STATE_TENSORS)


def pick_resume_checkpoint(
    root: str | Path, report: Callable[[str], None], *, set_aside: bool = True
) -> Path | None:
    """The checkpoint a resume continues from: the one `latest` names when it is intact, else the newest
    intact step-* folder. Each damaged one is reported (and, with ``set_aside``, renamed to
    step-N.damaged-<k> so that rotation and later resumes pass over it; nothing is deleted). None when
    there is no checkpoint; a `CheckpointError` when none is intact."""
    root = Path(root)
    try:
        latest = read_latest(root)
    except CheckpointError as e:
        report(str(e))
        latest = None
    candidates = ([latest] if latest is not None else []) + [p for p in step_dirs(root) if p != latest]
    damaged: list[str] = []
    for folder in candidates:
        try:
            check_checkpoint(folder)
        except MissingChecksumsError:  # not damaged, unverifiable: the user decides (its message says how)
            raise
        except (CheckpointError, OSError) as e:
            damaged.append(folder.name)
            report(f"checkpoint {folder.name} is damaged: {e}")
            if set_aside:
                set_aside_damaged(folder, report)
            continue
        if folder != latest:
            report(f"resuming from {folder.name}, the newest intact checkpoint")
        return folder
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {root} (damaged: {', '.join(damaged)}); start the run again "
            "(dflashkit train --move-aside keeps the old files), or copy a good checkpoint into it"
        )
    return None


def set_aside_damaged(folder: Path, report: Callable[[str], None]) -> None:
    """Rename a damaged checkpoint folder to step-N.damaged-<k>: kept, but no longer a step-* folder."""
    k = 0
    while (dest := folder.with_name(f"{folder.name}.damaged-{k}")).exists():
        k += 1
    try:
        os.rename(folder, dest)
    except OSError:  # another rank renamed it first, or the filesystem refuses: leave it
        return
    report(f"renamed {folder.name} to {dest.name} (kept for inspection; delete it when done)")

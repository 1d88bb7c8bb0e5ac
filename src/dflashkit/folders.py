"""What a folder is, when a command is about to replace or write into it: a training run, a training
checkpoint (or anything inside a run's checkpoints/), or a dataset. `convert --force`, `init --force` and
`prepare` refuse such folders in one line naming what they are (`training_folder`)."""

from __future__ import annotations

from pathlib import Path

# Files only a training run's folder holds (`dflashkit.train.rundir.RUN_FILES` lists all it writes).
RUN_MARKS = ("checkpoints", "metrics.jsonl", "best", "training.png")
# Files only a training checkpoint holds besides its drafter (`dflashkit.train.state`).
TRAINING_STATE_MARKS = ("training_state.json", "training_state.pt")


def run_marks(folder: str | Path) -> list[str]:
    """The names among `RUN_MARKS` that exist in ``folder``."""
    folder = Path(folder)
    return [n for n in RUN_MARKS if (folder / n).exists()]


def training_folder(folder: str | Path) -> str | None:
    """What ``folder`` holds of a training run, in words, or None: a run folder, a checkpoint with training
    state, or a folder inside a run's checkpoints/ (its resume may fall back to it)."""
    folder = Path(folder).absolute()
    found = run_marks(folder) if folder.is_dir() else []
    if found:
        return f"a training run's folder (it holds {', '.join(found)})"
    state = [n for n in TRAINING_STATE_MARKS if (folder / n).exists()]
    if state:
        return f"a training checkpoint (it holds {', '.join(state)}, the state a resume continues from)"
    for parent in folder.parents:
        if parent.name == "checkpoints" and run_marks(parent.parent):
            return f"inside the training run {parent.parent}'s checkpoints/"
    return None

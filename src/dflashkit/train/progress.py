"""A live progress line for training (rich): step, loss, train and validation acceptance length."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflashkit.train.metrics import served_tau


class TrainProgress:
    def __init__(self, total: int, start: int, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
            disable=not console.is_terminal and console.quiet,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")
        self.info = ""

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, record: dict[str, Any] | None, best: float) -> None:
        if record is not None:
            parts = [f"loss {loss:.3f}"]
            if record.get("acceptance_length") is not None:
                parts.append(f"tau(train) {record['acceptance_length']:.2f}")
            if "val" in record:
                val = record["val"]
                parts.append(
                    f"tau(val) {val['acceptance_length']:.2f}, served order {served_tau(val):.2f} (best {best:.2f})"
                )
            self.info = "  ".join(parts)
            if not self.console.is_terminal:
                self.console.print(f"step {step}: {self.info}")
        self.progress.update(self.task, completed=step, info=self.info)

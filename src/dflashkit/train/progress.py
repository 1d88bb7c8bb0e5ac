"""Live progress of training (rich): a bar of steps with loss, train and validation acceptance length, and,
while the held-out rows are measured, a bar of its own for that evaluation (the step bar stands still then)."""

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

from dflashkit.model.acceptance import served_tau


class TrainProgress:
    def __init__(self, total: int, start: int, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
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
        self.eval_task: Any = None
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
                served = f"served order {served_tau(val):.2f}"
                if "served_expected_acceptance_length" in val:  # best/ is chosen by the figure at T
                    served += (
                        f", at T={val['serve_temperature']:g} {val['served_expected_acceptance_length']:.2f}"
                    )
                parts.append(f"tau(val) {val['acceptance_length']:.2f}, {served} (best {best:.2f})")
            self.info = "  ".join(parts)
            if not self.console.is_terminal:
                self.console.print(f"step {step}: {self.info}")
        self.progress.update(self.task, completed=step, info=self.info)

    def evaluating(self, done: int, total: int) -> None:
        """Held-out rows measured so far (`validation.validate`'s ``on_row``): a bar of its own."""
        if self.eval_task is None:
            self.eval_task = self.progress.add_task(
                "validation", total=total, info="held-out rows, a block at every anchor"
            )
            if not self.console.is_terminal:
                self.console.print(f"validation: measuring {total} held-out rows")
        self.progress.update(self.eval_task, completed=done)

    def evaluated(self) -> None:
        """The evaluation is over: its bar goes."""
        if self.eval_task is not None:
            self.progress.remove_task(self.eval_task)
            self.eval_task = None

"""Held-out acceptance length of several training runs on one plot, against the training rows read (steps x
rows per step), so runs of different batch sizes compare by the data they saw.

    python benchmarks/plot_heldout.py OUT.png LABEL=metrics.jsonl:ROWS_PER_STEP [...]

A run continued from another's drafter (`drafter.init`) joins it with `+`: LABEL=first.jsonl+next.jsonl:ROWS
plots them as one curve, the next run's steps counted after the first's last.

Reads the `val` records a training run writes to metrics.jsonl; plots the served-order acceptance length
(what decoding gets) solid and the mean over anchors dashed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without installing

from dflashkit.train.metrics import read_metrics  # noqa: E402


def curve(path: Path) -> list[tuple[int, float, float]]:
    """(step, served-order tau, mean-over-anchors tau) of every validation record."""
    points = []
    for record in read_metrics(path):
        val = record.get("val")
        if val and "served_acceptance_length" in val:
            points.append((record["step"], val["served_acceptance_length"], val["acceptance_length"]))
    return points


def joined(files: str) -> list[tuple[int, float, float]]:
    """The curves of runs continued one from another ("a.jsonl+b.jsonl"), steps counted on."""
    points: list[tuple[int, float, float]] = []
    done = 0
    for file in files.split("+"):
        part = curve(Path(file))
        points += [(done + step, s, m) for step, s, m in part]
        done = points[-1][0] if points else done
    return points


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for spec in argv[1:]:
        label, rest = spec.split("=", 1)
        file, rows = rest.rsplit(":", 1)
        points = joined(file)
        x = [step * int(rows) for step, _, _ in points]
        line = ax.plot(x, [s for _, s, _ in points], marker="o", label=f"{label} (served order)")[0]
        ax.plot(x, [m for _, _, m in points], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("training rows read (steps x rows per step)")
    ax.set_ylabel("held-out acceptance length tau")
    ax.set_title(
        "Held-out tau (196 records: 100 chitchat, 96 ShareGPT); dashed: mean over anchors", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=120)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

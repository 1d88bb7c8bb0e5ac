"""benchmarks/train_step.py's same-run comparison carries the keys results/train_step.json is read by."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step  # noqa: E402


def test_ours_over_speculators_rows_carry_the_issue_keys():
    rows = [
        {"backend": "flex", "anchors": 512, "ms_per_step": 150.0, "peak_gib": 23.5, "fraction_of_peak": 0.6},
        {"backend": "speculators", "anchors": 512, "ms_per_step": 200.0, "peak_gib": 37.0},
        {
            "backend": "flex",
            "anchors": 1024,
            "ms_per_step": 280.0,
            "peak_gib": 30.0,
            "fraction_of_peak": 0.62,
        },
        {"backend": "speculators", "anchors": 2048, "error": "out of memory"},
    ]
    (row,) = train_step.ratios(rows, "NVIDIA H100 80GB HBM3")  # 1,024 anchors: no peer row to compare with
    assert row["anchors"] == 512 and row["device"] == "NVIDIA H100 80GB HBM3"
    assert (row["ours_ms"], row["speculators_ms"], row["peak_gib"]) == (150.0, 200.0, 23.5)
    assert row["ratio"] == pytest.approx(0.75) and row["fraction_of_peak"] == 0.6

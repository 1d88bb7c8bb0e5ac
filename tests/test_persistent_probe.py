"""benchmarks/persistent_probe.py: a step's matmul phases launched one by one and as one persistent kernel give
the same numbers to the bit, and the torch reference's (on the CPU: Triton's interpreter, one program, one
layer; a GPU runs every program at once)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import persistent_probe  # noqa: E402


@pytest.mark.parametrize("rows", [2])
def test_the_persistent_step_gives_the_launched_phases_numbers(rows):
    if torch.cuda.is_available():
        step, programs = persistent_probe.Step(2, torch.device("cuda"), torch.bfloat16), 8
        tolerance = 3e-2
    else:
        step, programs = persistent_probe.Step(1, torch.device("cpu"), torch.float32), 1
        tolerance = 1e-4
    result = persistent_probe.check(step, rows, programs, 16, 64)
    assert result["equal_to_the_bit"] and result["relative_error"] < tolerance, result
    # the check can fail: the launched phases with the output projection's residual add dropped
    real = step.phases

    def faulty(i):
        phases = real(i)
        phases[1] = (*phases[1][:-1], False)
        return phases

    step.phases = faulty
    broken = persistent_probe.check(step, rows, programs, 16, 64)
    assert not broken["equal_to_the_bit"] and broken["relative_error"] > 10 * tolerance, broken

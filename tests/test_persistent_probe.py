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


def test_a_phase_boundary_is_timed_after_every_program_counted_each_phase():
    """The boundaries' probe: every program's counter reads the phases after a step, launched or persistent;
    on the CPU more than one program is refused (the interpreter would wait forever at the barrier)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    programs = 8 if device.type == "cuda" else 1
    out = persistent_probe.boundaries(5, programs, device)
    assert out == {"phases": 5, "programs": programs}
    if device.type == "cpu":
        with pytest.raises(ValueError, match="a barrier needs one"):
            persistent_probe.boundaries(5, 2, device)


COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import persistent_probe as p

act = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "m": "i32"}
step = {n: "*bf16" for n in ("h_ptr", "t1_ptr", "t2_ptr", "wqkv_ptr", "wo_ptr", "wgu_ptr", "wd_ptr")}
cases = [
    (p._phase_kernel, act, dict(X_STRIDE=576, K=576, N=960, SWIGLU=False, RESIDUAL=False, BLOCK_N=16, BLOCK_K=64), {}),
    (p._phase_kernel, act, dict(X_STRIDE=3072, K=1536, N=576, SWIGLU=True, RESIDUAL=True, BLOCK_N=32, BLOCK_K=64), {}),
    (p._step_kernel, {**step, "counter_ptr": "*i32", "m": "i32"},
     dict(PROGRAMS=132, LAYERS_=30, H=576, Q=960, INTER=1536, BLOCK_N=16, BLOCK_K=64), {}),
    (p._tick_kernel, {"x_ptr": "*i32"}, dict(GDC=False), {}),
    (p._tick_kernel, {"x_ptr": "*i32"}, dict(GDC=True), {"launch_pdl": True}),
    (p._ticks_kernel, {"x_ptr": "*i32", "counter_ptr": "*i32"}, dict(PHASES=180, PROGRAMS=132), {}),
]
failures = []
for fn, sig, consts, options in cases:
    try:
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:
        failures.append(f"{fn.__name__} {consts}: {type(e).__name__}: {str(e)[-600:]}")
print(json.dumps({"compiled": len(cases) - len(failures), "failures": failures}))
"""


def test_the_probe_kernels_compile_for_hopper(tmp_path):
    """The interpreter never meets what Triton's compiler refuses: every probe kernel (the phases, the
    persistent step with its grid barrier, the boundaries' kernels with and without dependent launch) is
    compiled for sm_90 in a child process, so that a GPU run of the probe spends no device time on a refusal."""
    import json
    import os
    import subprocess

    ptxas = Path(persistent_probe.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("this Triton has no NVIDIA backend (ptxas)")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE, str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert not out["failures"], "\n".join(out["failures"])
    assert out["compiled"] == 6

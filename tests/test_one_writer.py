"""One writer per folder and nothing lost to a second one: an exclusive lock on every folder a command
writes (tried with two real processes), `--force` that never replaces training state, checksums that a
folder dflashkit wrote must keep, `--move-aside` that takes bench/ along and never meets `--resume`, and the
debris of a killed writer cleaned by the next one (plots written atomically)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflashkit.atomic import atomic_file, clean_debris
from dflashkit.cli import main
from dflashkit.integrity import ALLOW_MISSING_ENV, CHECKSUMS_FILE, MissingChecksumsError, write_checksums
from dflashkit.lock import LOCK_FILE, FolderInUseError, folder_lock
from dflashkit.model.checkpoint import load_drafter
from dflashkit.train import state
from dflashkit.train.rundir import claim_run_folder

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOLD = (
    "import sys\n"
    "from dflashkit.lock import folder_lock\n"
    "with folder_lock(sys.argv[1], beside=sys.argv[2] == '1'):\n"
    "    print('locked', flush=True)\n"
    "    sys.stdin.read()\n"
)


@contextmanager
def holder(folder: Path, *, beside: bool = False) -> Iterator[subprocess.Popen]:
    """Another process holding ``folder``'s lock until the block ends (then killed with SIGKILL)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), "1" if beside else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        yield p
    finally:
        p.kill()  # kill -9: the kernel lets go of the lock
        p.wait()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """An untrained drafter for the embedded target, written by `dflashkit init` (with checksums)."""
    out = tmp_path_factory.mktemp("init") / "drafter"
    assert main(["init", "--out", str(out), "--layers", "1", "--block-size", "4"]) == 0
    return out


# ---------------------------------------------------------------------------------------- the lock


def test_a_second_writer_fails_at_once_naming_the_holder_until_it_is_gone(tmp_path):
    folder = tmp_path / "run"
    with holder(folder) as p:
        with pytest.raises(FolderInUseError, match=rf"pid {p.pid} on host \S+"), folder_lock(folder):
            pass
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == p.pid
    assert (folder / LOCK_FILE).exists()  # left by the killed holder: stale, it blocks nobody
    with folder_lock(folder):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_FILE).exists()  # a holder that lets go takes its file along


def test_train_into_a_run_being_written_fails_before_anything_loads(tmp_path, capsys, monkeypatch):
    from dflashkit.target.hf import TargetModel

    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("the target was loaded"))
    run = tmp_path / "run"
    with holder(run) as p:
        assert main(["train", "--out", str(run), "train.max_steps=1"]) == 2
        line = one_line(capsys.readouterr().err)
        assert str(run) in line and f"pid {p.pid}" in line
    assert sorted(x.name for x in run.iterdir()) == [LOCK_FILE]  # nothing written beside the lock


def test_prepare_into_a_dataset_being_written_fails(tmp_path, capsys):
    data = tmp_path / "data"
    with holder(data) as p:
        assert main(["prepare", "--out", str(data), "--max-prompts", "2"]) == 2
        assert f"pid {p.pid}" in one_line(capsys.readouterr().err)


def test_convert_into_a_destination_being_written_fails_then_succeeds(drafter, tmp_path, capsys):
    dst = tmp_path / "converted"
    debris = tmp_path / ".converted.tmp-k1ll3d_9"  # what a convert killed mid-write leaves
    other = tmp_path / ".elsewhere.tmp-abcd1234"  # another destination's: not this command's to clean
    other.mkdir()
    with holder(dst, beside=True) as p:
        debris.mkdir()  # the live holder's temporary folder, then (once it is killed) its debris
        (debris / "model.safetensors").write_bytes(b"\0" * 4096)
        assert main(["convert", str(drafter), str(dst), "--to", "speculators"]) == 2
        assert f"pid {p.pid}" in one_line(capsys.readouterr().err)
        assert debris.is_dir()  # a live writer's temporary folder is never cleaned
    assert main(["convert", str(drafter), str(dst), "--to", "speculators"]) == 0
    assert not debris.exists() and other.is_dir()
    assert sorted(x.name for x in tmp_path.iterdir()) == [".elsewhere.tmp-abcd1234", "converted"]


# --------------------------------------------------------------------- --force and training state


@pytest.fixture
def run_with_checkpoint(drafter, tmp_path):
    """A run folder with a training checkpoint (drafter + training state, checksums) and metrics.jsonl."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000003"
    shutil.copytree(drafter, step)
    (step / state.STATE_JSON).write_text(json.dumps({"step": 3, "data_cursor": None}))
    (step / CHECKSUMS_FILE).unlink()
    write_checksums(step)
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    return run


def test_force_never_replaces_a_training_checkpoint(drafter, run_with_checkpoint, tmp_path, capsys):
    step = run_with_checkpoint / "checkpoints" / "step-00000003"
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    for args in (
        ["convert", str(drafter), str(step), "--to", "zlab", "--force"],
        ["init", "--out", str(step), "--layers", "1", "--block-size", "4", "--force"],
    ):
        assert main(args) == 2
        line = one_line(capsys.readouterr().err)
        assert str(step) in line and "a training checkpoint" in line and "--force never replaces" in line
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before
    copied = tmp_path / "copied-step"  # a training checkpoint outside its run: its state is still its own
    shutil.copytree(step, copied)
    assert main(["convert", str(drafter), str(copied), "--to", "zlab", "--force"]) == 2
    assert "a training checkpoint" in one_line(capsys.readouterr().err)


def test_force_never_replaces_anything_in_a_runs_checkpoints_or_a_run(drafter, run_with_checkpoint, capsys):
    plain = run_with_checkpoint / "checkpoints" / "by-hand"  # a plain drafter, but where a resume looks
    shutil.copytree(drafter, plain)
    assert main(["convert", str(drafter), str(plain), "--to", "zlab", "--force"]) == 2
    assert "inside the training run" in one_line(capsys.readouterr().err)
    assert main(["convert", str(drafter), str(run_with_checkpoint), "--to", "zlab", "--force"]) == 2
    assert "a training run's folder" in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- required checksums


def test_a_training_checkpoint_without_checksums_is_refused_not_set_aside(run_with_checkpoint, monkeypatch):
    root = run_with_checkpoint / "checkpoints"
    step = root / "step-00000003"
    (step / CHECKSUMS_FILE).unlink()
    weights = step / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte: only a checksum would notice
    weights.write_bytes(bytes(data))
    with pytest.raises(MissingChecksumsError, match=rf"checksums.json is missing.*{ALLOW_MISSING_ENV}=1"):
        state.pick_resume_checkpoint(root, lambda m: None)
    assert step.is_dir()  # refused, not renamed as damaged: the user decides
    monkeypatch.setenv(ALLOW_MISSING_ENV, "1")
    state.check_checkpoint(step)  # structural checks only, as asked


def test_a_drafter_folder_of_ours_without_checksums_is_refused_a_foreign_one_loads(drafter, tmp_path):
    foreign = tmp_path / "zlab-download"  # z-lab and speculators folders have no checksums.json
    shutil.copytree(drafter, foreign)
    (foreign / CHECKSUMS_FILE).unlink()
    load_drafter(foreign)
    ours = tmp_path / "best"
    shutil.copytree(foreign, ours)
    (ours / "fingerprint.json").write_text("{}")  # what dflashkit writes beside a drafter
    with pytest.raises(MissingChecksumsError, match="written by dflashkit"):
        load_drafter(ours)


# ---------------------------------------------------------------------------------- --move-aside


def test_resume_with_move_aside_is_refused(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--move-aside"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--resume" in line and "--move-aside" in line and "one of them" in line
    assert not (tmp_path / "run").exists()


def test_move_aside_takes_bench_along(tmp_path):
    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    (run / "bench" / "bench.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    aside = claim_run_folder(run, move_aside=True, report=lambda m: None)
    assert aside is not None and (aside / "bench" / "bench.json").is_file()
    assert not (run / "bench").exists()  # the new run's default bench/ starts empty


# ------------------------------------------------------------------------------------------- debris


def test_an_interrupted_replace_is_put_back_and_a_finished_ones_leftover_goes(tmp_path):
    moved = tmp_path / ".best.old-ab12cd34"  # killed after moving best/ aside, before the new one came
    moved.mkdir()
    (moved / "model.safetensors").write_text("the only copy")
    done = tmp_path / "checkpoints" / ".step-00000002.old-zz99"  # its replacement arrived
    done.mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    kept = tmp_path / ".notes.tmp"  # not a name dflashkit makes
    kept.write_text("mine")
    assert clean_debris(tmp_path) == [done]
    assert (tmp_path / "best" / "model.safetensors").read_text() == "the only copy"
    assert kept.is_file() and not moved.exists()


def test_plots_are_written_atomically(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from dflashkit.train.metrics import plot_training

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0, "acceptance_length": 1.5}\n')
    png = tmp_path / "training.png"

    def dies_mid_write(self, fname, **kwargs):
        Path(fname).write_bytes(b"")  # a 0-byte plot, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        plot_training(metrics, png)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no plot, no temporary file
    monkeypatch.undo()
    plot_training(metrics, png)
    assert png.read_bytes().startswith(b"\x89PNG")


def test_atomic_file_leaves_the_old_file_on_failure(tmp_path):
    path = tmp_path / "eval.png"
    path.write_bytes(b"old")
    with pytest.raises(OSError), atomic_file(path) as tmp:
        tmp.write_bytes(b"ne")
        raise OSError("No space left on device")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.png"]

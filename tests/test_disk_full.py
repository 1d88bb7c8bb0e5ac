"""A full disk is one line naming the path and the space (needed or written, and free), never a traceback,
and nothing is lost: the same command (a training run with --resume) goes on once there is room."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dflashkit import atomic
from dflashkit.cli import main
from dflashkit.errors import DflashkitError


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_publishing_a_folder_keeps_what_was_there(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "w").write_text("old")
    with (
        pytest.raises(
            DflashkitError, match=r"the disk is full writing .*ckpt \(5 B written when it filled, .* free\)"
        ),
        atomic.atomic_dir(tmp_path / "ckpt") as tmp,
    ):
        (tmp / "w").write_text("new!!")
        _full()
    assert (tmp_path / "ckpt" / "w").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left


def test_a_full_disk_while_writing_json_names_what_it_needed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(atomic.os, "fsync", _full)
    with pytest.raises(DflashkitError, match=r"writing .*m\.json \(9 B needed, .* free\)"):
        atomic.write_json(tmp_path / "m.json", {"a": 1}, indent=None)
    assert list(tmp_path.iterdir()) == []


def test_train_on_a_full_disk_is_one_line_and_resumes(
    tiny_dataset, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dflashkit.model import checkpoint

    real = checkpoint.save_file

    def full_at_step_2(tensors, path, *args, **kwargs):
        if "step-00000002" in str(Path(path).parent.name) or ".step-00000002" in str(path):
            _full()
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_at_step_2)
    run = tmp_path / "run"
    from test_train import TINY

    over = {**TINY, "train.max_steps": 2, "train.save_every": 1, "train.eval_every": 2}
    argv = ["train", "--out", str(run), f"data.dir={tiny_dataset}", *(f"{k}={v}" for k, v in over.items())]
    capsys.readouterr()
    assert main(argv) == 2
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("dflashkit ")]  # not the loading bars
    assert "Traceback" not in text
    assert len(err) == 1 and "the disk is full writing" in err[0] and "step-00000002" in err[0], err
    assert "free" in err[0] and "--resume" in err[0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert main([*argv, "--resume"]) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"


def test_prepare_on_a_full_disk_is_one_line_and_the_next_run_reuses_the_replies(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import safetensors.torch

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", _full)
    out = tmp_path / "data"
    argv = ["prepare", "--out", str(out), "--max-prompts", "4", "--max-new-tokens", "8", "--dtype", "float32"]
    argv += ["--no-progress", "--val-fraction", "0.25"]
    capsys.readouterr()
    assert main(argv) == 2
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("dflashkit ")]  # not the loading bars
    assert "Traceback" not in text
    assert len(err) == 1 and "the disk is full writing" in err[0] and "needed" in err[0], err
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert main(argv) == 0
    assert "0 now, 4 from the cache" in capsys.readouterr().out

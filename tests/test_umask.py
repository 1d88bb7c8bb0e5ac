"""Folders and files dflashkit writes get the user's umask (a group sharing a run can read it), not the
private modes of tempfile.mkdtemp (0700) and safetensors (0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dflashkit import atomic
from dflashkit.cli import main


@pytest.fixture
def group_umask():
    old = os.umask(0o002)
    atomic._umask.cache_clear()
    yield 0o002
    os.umask(old)
    atomic._umask.cache_clear()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_published_folder_and_its_files_follow_the_umask(tmp_path: Path, group_umask) -> None:
    import torch
    from safetensors.torch import save_file

    with atomic.atomic_dir(tmp_path / "ckpt", checksums=True) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir(mode=0o700)
    assert _mode(tmp_path / "ckpt") == 0o775 and _mode(tmp_path / "ckpt" / "sub") == 0o775
    assert _mode(tmp_path / "ckpt" / "model.safetensors") == 0o664
    assert _mode(tmp_path / "ckpt" / "checksums.json") == 0o664


def test_init_writes_a_checkpoint_a_group_can_read(tmp_path: Path, group_umask) -> None:
    out = tmp_path / "d"
    assert main(["init", "--out", str(out), "--layers", "1", "--block-size", "4"]) == 0
    assert _mode(out) == 0o775
    assert {p.name: _mode(p) for p in out.iterdir()} == {p.name: 0o664 for p in out.iterdir()}

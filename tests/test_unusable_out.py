"""An output folder that cannot be made or written (an existing file, a path under a file, a folder this
user may not write) is refused in one line before the work starts: no decoded prompt, no trained step is
lost to a NotADirectoryError at the end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.cli import main
from dflashkit.errors import ConfigError


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("drafter") / "d"
    assert main(["init", "--out", str(out), "--layers", "1", "--block-size", "4"]) == 0
    return out


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("x")
    return path


def _one_line(capsys, *said: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(s in err[0] for s in said), err
    return err[0]


def test_the_check_names_the_part_that_is_a_file(a_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--out .*notes.txt is a file, not a folder"):
        check_folder_can_be_made(a_file)
    with pytest.raises(ConfigError, match=r"cannot be made: .*notes.txt is a file, not a folder"):
        check_folder_can_be_made(a_file / "run" / "eval")
    check_folder_can_be_made(tmp_path / "new" / "deeper")  # to be made: fine
    assert not (tmp_path / "new").exists()  # the check makes nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_this_user_may_not_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="may not write in"):
        check_folder_can_be_made(locked / "eval")


def test_eval_refuses_an_out_under_a_file_before_decoding(drafter, a_file, monkeypatch, capsys) -> None:
    from dflashkit.infer import bench

    monkeypatch.setattr(bench, "decode_set", lambda *a, **k: pytest.fail("decoded before the check"))
    capsys.readouterr()
    assert main(["eval", "--drafter", str(drafter), "--max-prompts", "1", "--out", str(a_file / "eval")]) == 2
    _one_line(capsys, "dflashkit eval: error: --out", "is a file, not a folder")


def test_prepare_and_capture_refuse_a_file_as_their_folder(a_file, monkeypatch, capsys) -> None:
    from dflashkit.data import dataset

    monkeypatch.setattr(dataset, "prepare_dataset", lambda *a, **k: pytest.fail("prepared before the check"))
    capsys.readouterr()
    assert main(["prepare", "--out", str(a_file)]) == 2
    _one_line(capsys, "dflashkit prepare: error: --out", "is a file, not a folder")
    assert main(["capture", "--out", str(a_file / "features")]) == 2
    _one_line(capsys, "dflashkit capture: error: --out", "cannot be made")


def test_train_fanout_and_their_dry_runs_refuse_a_run_folder_under_a_file(a_file, capsys) -> None:
    for command in ("train", "fanout"):
        for extra in (["--dry-run"], []):
            capsys.readouterr()
            assert main([command, "--out", str(a_file / "run"), *extra]) == 2
            _one_line(capsys, f"dflashkit {command}: error: the run folder", "is a file, not a folder")


def test_convert_and_init_refuse_a_destination_under_a_file(drafter, a_file, capsys) -> None:
    capsys.readouterr()
    assert main(["convert", str(drafter), str(a_file / "out"), "--to", "speculators"]) == 2
    _one_line(capsys, "dflashkit convert: error: DST", "is a file, not a folder")
    assert main(["init", "--out", str(a_file / "d"), "--layers", "1"]) == 2
    _one_line(capsys, "dflashkit init: error: --out", "is a file, not a folder")

"""Reading a config file: a key given twice, a folder or a binary file in place of the YAML file."""

import pytest

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.errors import ConfigError


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-3\ndata:\n  dir: d\ntrain:\n  lr: 5.0\n")
    with pytest.raises(ConfigError, match=r"the key 'train' is given twice \(lines 1 and 5\)"):
        load_config(path)
    path.write_text("train:\n  lr: 1.0e-3\n  lr: 5.0\n")  # inside a section too
    with pytest.raises(ConfigError, match=r"'lr' is given twice \(lines 2 and 3\)"):
        load_config(path)


def test_the_dry_run_refuses_a_key_given_twice_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-3\ntrain:\n  lr: 5.0\n")
    assert main(["train", "-c", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'train' is given twice" in err


def test_a_folder_or_a_binary_file_as_config_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="is a folder: --config takes a YAML file"):
        load_config(tmp_path)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(ConfigError, match="not a text"):
        load_config(binary)

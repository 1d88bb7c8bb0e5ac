"""A prompt file that is not UTF-8 text (a binary file, another encoding) is one clear line, or, with
--skip-malformed, its undecodable lines are counted as malformed records: never a UnicodeDecodeError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.data.sources import load_prompts
from dflashkit.errors import DataError

LATIN1 = "Qu'est-ce qu'un café ?".encode("latin-1")  # not UTF-8: the é is byte 0xe9


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_line_in_another_encoding_is_malformed(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"p{suffix}"
    good = json.dumps({"prompt": "hello"}).encode() if suffix == ".jsonl" else b"hello"
    bad = json.dumps({"prompt": "x"}).encode().replace(b"x", LATIN1) if suffix == ".jsonl" else LATIN1
    path.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(DataError, match=rf"{path.name}:2: not UTF-8 text; .* --skip-malformed"):
        load_prompts(str(path))
    found = load_prompts(str(path), skip_malformed=True)
    assert [p.turns[0] for p in found.prompts] == ["hello"] and found.malformed == 1


def test_a_binary_file_is_all_malformed_and_a_json_array_says_so(tmp_path: Path) -> None:
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(128, 256)) * 4 + b"\n" + b"\xff\xfe\x00" * 9)
    with pytest.raises(DataError, match="weights.jsonl:1: not UTF-8 text"):
        load_prompts(str(binary))
    found = load_prompts(str(binary), skip_malformed=True)
    assert found.prompts == [] and found.malformed == 2
    array = tmp_path / "p.json"
    array.write_bytes(b'[{"prompt": "' + LATIN1 + b'"}]')
    with pytest.raises(DataError, match=r"p.json is not UTF-8 text \(byte \d+\)"):
        load_prompts(str(array), skip_malformed=True)


def test_eval_of_a_binary_prompt_file_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    drafter = tmp_path / "d"
    assert main(["init", "--out", str(drafter), "--layers", "1", "--block-size", "4"]) == 0
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(b"\x80\x81\xfe\xff" * 64)
    out = tmp_path / "eval"
    base = ["eval", "--drafter", str(drafter), "--prompts", str(binary), "--out", str(out)]
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8 text" in err[0]
    assert main([*base, "--skip-malformed"]) == 2  # every record skipped: nothing to measure
    captured = capsys.readouterr()
    assert "skipped 1 malformed records" in captured.out
    assert captured.err.strip().splitlines() == [
        f"dflashkit eval: error: no prompts to evaluate in {binary}; give a file or a split that holds some"
    ]
    assert not out.exists()

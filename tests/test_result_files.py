"""Every result file is valid JSON (no NaN literals), and "nothing to measure" is refused before a file is
touched."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dflashkit.atomic import json_text, write_json
from dflashkit.cli import main


def _strict(text: str):
    """Parse as strict JSON parsers do: NaN, Infinity and -Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_a_measurement_that_is_not_a_number_is_written_as_null(tmp_path: Path) -> None:
    data = {"tau": math.nan, "speedup": math.inf, "per_position": [0.5, -math.inf], "n": 3, "name": "x"}
    path = write_json(tmp_path / "eval.json", data)
    assert _strict(path.read_text()) == {
        "tau": None,
        "speedup": None,
        "per_position": [0.5, None],
        "n": 3,
        "name": "x",
    }
    assert _strict(json_text({"loss": math.nan}, indent=None)) == {"loss": None}
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]  # no temporary file left


def test_the_result_writers_go_through_the_one_helper(tmp_path: Path) -> None:
    from dflashkit.infer import bench
    from dflashkit.runtime import fingerprint

    bench._write_json(tmp_path / "b.json", {"tau": math.nan})
    assert _strict((tmp_path / "b.json").read_text()) == {"tau": None}
    fingerprint.save({"torch": {"x": math.nan}}, tmp_path / "fp.json")
    assert _strict((tmp_path / "fp.json").read_text()) == {"torch": {"x": None}}


def test_eval_with_nothing_to_measure_leaves_the_last_evaluation(tmp_path: Path, capsys) -> None:
    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.json").write_text('{"mean_acceptance_length": 2.5}\n')
    for flags in (["--max-prompts", "0"], ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit) as refused:
            main(["eval", "--drafter", str(tmp_path / "d"), "--out", str(out), *flags])
        assert refused.value.code == 2
        assert "takes a whole number >= 1, got '0'" in capsys.readouterr().err
    assert (out / "eval.json").read_text() == '{"mean_acceptance_length": 2.5}\n'
    assert sorted(p.name for p in out.iterdir()) == ["eval.json"]

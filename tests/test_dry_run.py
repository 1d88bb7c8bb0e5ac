"""`dflashkit train --dry-run` runs the run's own checks: the packed rows of both splits, the attention
memory on this device (with a hint that fits it), and the run folder rules."""

import json
import shutil

import pytest

from dflashkit.attention.dense_budget import DenseBudgetError, preflight_dense
from dflashkit.cli import main

SETTINGS = {
    "target.dtype": "float32",
    "drafter.block_size": 4,
    "drafter.num_target_layers": 2,
    "train.max_len": 96,
    "train.num_anchors": 12,
    "run.device": "cpu",
}


def dry_run(data_dir, out_dir, *extra, **over) -> list[str]:
    settings = {"data.dir": data_dir, "run.out_dir": out_dir} | SETTINGS | over
    return ["train", "--dry-run", *extra, *(f"{k}={v}" for k, v in settings.items())]


def test_a_dataset_without_records_is_an_error(tiny_dataset, tmp_path, capsys):
    from dflashkit.data.dataset import write_split

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    write_split(data / manifest["splits"]["train"]["file"], [], [], [])  # every prompt was left out
    assert main(dry_run(data, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"the train split of {data} holds no records" in err and "Traceback" not in err
    assert "everything checks out" not in err


def test_too_few_rows_for_a_batch_is_an_error(tiny_dataset, tmp_path, capsys):
    assert main(dry_run(tiny_dataset, tmp_path / "run", **{"train.batch_size": 1000})) == 2
    assert "fewer than train.batch_size=1000" in capsys.readouterr().err


def test_the_attention_memory_is_checked_with_a_hint_for_the_cpu(tiny_dataset, tmp_path, capsys):
    assert main(dry_run(tiny_dataset, tmp_path / "run", **{"train.num_anchors": 100000})) == 2
    err = capsys.readouterr().err
    assert "score matrix" in err and "GiB > budget" in err
    assert "does not train on the CPU" in err and "train.num_anchors" in err
    assert "use the flex backend" not in err


def test_a_dry_run_that_checks_out_shows_rows_steps_and_attention_memory(tiny_dataset, tmp_path):
    from rich.console import Console

    from dflashkit.config import load_config
    from dflashkit.train.plan import dry_run as plan_dry_run

    cfg = load_config(None, dry_run(tiny_dataset, tmp_path / "run")[2:])
    plan = plan_dry_run(cfg, Console(quiet=True))
    assert "training and" in plan["data"] and "held-out rows of 96 tokens" in plan["data"]
    assert (
        "sdpa (dense) on cpu" in plan["attention memory"]
        and "within the 4 GiB budget" in plan["attention memory"]
    )
    assert not (tmp_path / "run").exists()


def test_a_dry_run_over_an_earlier_run_says_what_training_would(tiny_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(dry_run(tiny_dataset, run)) == 2
    assert "--move-aside" in capsys.readouterr().err
    assert main(dry_run(tiny_dataset, run, "--move-aside")) == 0
    assert ".old-<time>" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing moved by a dry run


def test_dense_hints_fit_the_device():
    with pytest.raises(DenseBudgetError, match="does not train on the CPU") as cpu:
        preflight_dense(1, 16, 16384, 16384, what="x", device="cpu")
    assert "use the flex backend" not in str(cpu.value)
    with pytest.raises(DenseBudgetError, match="use the flex backend"):
        preflight_dense(1, 16, 16384, 16384, what="x", device="cuda:0")

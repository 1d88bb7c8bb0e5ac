"""A run folder keeps its work: a new run never replaces a finished one, --resume continues only with the
run's own settings, from the newest intact checkpoint, and metrics.jsonl holds each step once."""

import io
import json
import shutil

import pytest

from dflashkit.cli import main
from dflashkit.data.dataset import dataset_identity
from dflashkit.errors import CheckpointError
from dflashkit.integrity import ALLOW_MISSING_ENV, CHECKSUMS_FILE, write_checksums
from dflashkit.target.hf import TargetModel
from dflashkit.train import checkpoints, metrics, state, trainer
from dflashkit.train.rundir import RunExistsError, config_changes, is_resumable_key

SETTINGS = {
    "target.dtype": "float32",
    "drafter.layers": 1,
    "drafter.block_size": 4,
    "drafter.num_target_layers": 2,
    "train.max_steps": 4,
    "train.max_len": 96,
    "train.num_anchors": 12,
    "train.lr": 3e-3,
    "train.warmup_ratio": 0.0,
    "train.log_every": 1,
    "train.eval_every": 2,
    "train.save_every": 2,
    "train.cache_features": True,
    "train.chunk_blocks": 4,
}


def words(data_dir, **over) -> list[str]:
    return [f"{k}={v}" for k, v in ({"data.dir": str(data_dir)} | SETTINGS | over).items()]


def config(data_dir, out_dir, **over):
    from dflashkit.config import load_config

    return load_config(None, [*words(data_dir, **over), f"run.out_dir={out_dir}"])


def quiet():
    from rich.console import Console

    return Console(quiet=True)


@pytest.fixture(scope="module")
def finished_run(tiny_dataset, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4, best/, metrics.jsonl), made once: tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer.train(config(tiny_dataset, out), console=quiet())
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def metrics_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ item 1


def test_training_over_a_finished_run_refuses_and_names_the_choices(tiny_dataset, run_copy, capsys):
    before = (run_copy / "metrics.jsonl").read_text()
    best = (run_copy / "best" / "model.safetensors").read_bytes()
    code = main(["train", "--out", str(run_copy), *words(tiny_dataset, **{"train.max_steps": 1})])
    err = capsys.readouterr().err
    assert code == 2
    assert str(run_copy) in err and "--resume" in err and "--out" in err and "--move-aside" in err
    assert "Traceback" not in err
    assert (run_copy / "metrics.jsonl").read_text() == before  # nothing touched
    assert (run_copy / "best" / "model.safetensors").read_bytes() == best
    assert state.read_latest(run_copy / "checkpoints").name == "step-00000004"


def test_move_aside_keeps_the_earlier_run_and_what_is_not_the_runs(tiny_dataset, run_copy, capsys):
    (run_copy / "data").mkdir()  # e.g. data.dir inside the run folder (the demo's layout): it stays
    before = (run_copy / "metrics.jsonl").read_text()
    code = main(
        ["train", "--out", str(run_copy), "--move-aside", *words(tiny_dataset, **{"train.max_steps": 1})]
    )
    assert code == 0, capsys.readouterr().err
    (aside,) = list(run_copy.parent.glob("run.old-*"))
    assert (aside / "metrics.jsonl").read_text() == before
    assert state.read_latest(aside / "checkpoints").name == "step-00000004"
    assert (aside / "best" / "model.safetensors").is_file()
    assert (run_copy / "data").is_dir()
    assert metrics_steps(run_copy) == [1]
    assert state.read_latest(run_copy / "checkpoints").name == "step-00000001"


def test_a_fan_out_over_an_earlier_one_refuses_before_the_target_loads(tmp_path, monkeypatch):
    from dflashkit.config import load_config
    from dflashkit.train import fanout

    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path / 'sweep'}",
            "fanout.target_device=cpu",
            "fanout.variants=[{name: b4, overrides: {drafter.block_size: 4}}, {name: b8}]",
        ],
    )
    (tmp_path / "sweep" / "b4" / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(fanout, "setup_fanout", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(RunExistsError, match="a fan-out run.*--move-aside"):
        fanout.train_fanout(cfg, console=quiet())
    with pytest.raises(RunExistsError, match="a fan-out run"):
        fanout.dry_run_fanout(cfg, quiet())  # the dry run says the same
    fanout.check_run_folders(cfg, resume=False, move_aside=True, console=quiet())
    (aside,) = list(tmp_path.glob("sweep.old-*"))
    assert (aside / "b4" / "checkpoints").is_dir() and not (tmp_path / "sweep" / "b4").exists()


def test_move_aside_reaches_every_rank_of_a_data_parallel_launch():
    from dflashkit.cli import build_parser
    from dflashkit.train import distributed

    args = build_parser().parse_args(["train", "-c", "configs/embedded.yaml", "--move-aside", "--nproc", "2"])
    assert "--move-aside" in distributed.train_argv(args)


def test_the_refusal_comes_before_the_target_loads(tiny_dataset, run_copy, monkeypatch):
    def no_target(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(TargetModel, "load", no_target)
    with pytest.raises(RunExistsError):
        trainer.train(config(tiny_dataset, run_copy), console=quiet())


# ------------------------------------------------------------------------------------------------ item 2


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"drafter.block_size": 8}, "drafter.block_size 4 -> 8 (the model)"),
        ({"drafter.layers": 2}, "drafter.layers 1 -> 2 (the model)"),
        ({"train.loss_weighting": "dpace"}, "train.loss_weighting decay -> dpace (the loss)"),
    ],
)
def test_resume_refuses_a_changed_model_or_loss(tiny_dataset, run_copy, capsys, override, named):
    code = main(["train", "--out", str(run_copy), "--resume", *words(tiny_dataset, **override)])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err and "load_state_dict" not in err
    assert metrics_steps(run_copy) == [1, 2, 3, 4]


def test_resume_refuses_changed_data_with_both_values(tiny_dataset, run_copy, tmp_path, capsys):
    other = tmp_path / "other-data"
    shutil.copytree(tiny_dataset, other)
    code = main(["train", "--out", str(run_copy), "--resume", *words(other)])
    err = capsys.readouterr().err
    assert code == 2 and f"data.dir {tiny_dataset} -> {other} (the data)" in err


def test_resume_allows_the_harmless_keys_and_shows_evaluation_as_its_own_progress(tiny_dataset, run_copy):
    from rich.console import Console

    cfg = config(
        tiny_dataset,
        run_copy,
        **{"train.max_steps": 6, "train.log_every": 2, "train.eval_every": 3, "train.keep_last": 3},
    )
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200)
    assert trainer.train(cfg, resume=True, console=console).steps == 6
    assert "validation" in screen.getvalue()  # a bar of its own while the held-out rows are measured


def test_the_validation_bar_comes_and_goes():
    from rich.console import Console

    from dflashkit.train.progress import TrainProgress

    with TrainProgress(10, 0, Console(file=io.StringIO(), force_terminal=True)) as progress:
        progress.evaluating(0, 5)
        (task,) = [t for t in progress.progress.tasks if t.description == "validation"]
        progress.evaluating(3, 5)
        assert task.total == 5 and task.completed == 3
        progress.evaluated()
        assert [t.description for t in progress.progress.tasks] == ["train"]


def test_every_data_key_is_compared_but_the_named_harmless_ones(tiny_dataset, tmp_path):
    from dflashkit.config import DataSection

    saved = config(tiny_dataset, tmp_path).model_dump(mode="json")
    for key in DataSection.model_fields:
        assert is_resumable_key(f"data.{key}") == (key in ("features_dir", "batch_size", "backend")), key
    # a key the saved config lacks (added to dflashkit since) counts with its default
    del saved["data"]["seed"]
    assert config_changes(saved, config(tiny_dataset, tmp_path)) == []
    assert config_changes(saved, config(tiny_dataset, tmp_path, **{"data.seed": 5})) == [("data.seed", 0, 5)]


# ----------------------------------------------------------------------------------- item 4 and metrics


def test_resume_falls_back_to_the_newest_intact_checkpoint(tiny_dataset, run_copy):
    newest = run_copy / "checkpoints" / "step-00000004" / state.STATE_TENSORS
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    from rich.console import Console

    log = io.StringIO()
    cfg = config(tiny_dataset, run_copy, **{"train.max_steps": 5})
    result = trainer.train(cfg, resume=True, console=Console(file=log, width=400))
    said = log.getvalue()
    assert "step-00000004 is damaged" in said and "training_state.pt" in said
    assert "resuming from step-00000002, the newest intact checkpoint" in said
    assert result.steps == 5
    assert (run_copy / "checkpoints" / "step-00000004.damaged-0").is_dir()  # kept, not deleted
    assert metrics_steps(run_copy) == [1, 2, 3, 4, 5]  # steps 3 and 4 trained again, logged once


def test_resume_without_any_intact_checkpoint_is_one_clear_error(tiny_dataset, run_copy, capsys):
    for step in ("step-00000002", "step-00000004"):
        weights = run_copy / "checkpoints" / step / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])  # 64 flipped bytes: same size, same header
        weights.write_bytes(bytes(data))
    code = main(["train", "--out", str(run_copy), "--resume", *words(tiny_dataset)])
    err = capsys.readouterr().err
    assert code == 2 and "no intact checkpoint" in err and "Traceback" not in err


def test_resume_refuses_a_checkpoint_that_lost_its_checksums(tiny_dataset, run_copy, capsys):
    step = run_copy / "checkpoints" / "step-00000004"
    (step / CHECKSUMS_FILE).unlink()
    weights = step / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped weight byte: only its checksum would have told
    weights.write_bytes(bytes(data))
    code = main(["train", "--out", str(run_copy), "--resume", *words(tiny_dataset, **{"train.max_steps": 6})])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "checksums.json is missing" in err and f"{ALLOW_MISSING_ENV}=1" in err
    assert step.is_dir() and metrics_steps(run_copy) == [1, 2, 3, 4]  # kept as it was, nothing trained


def test_resume_refuses_a_dataset_whose_splits_changed(tiny_dataset, run_copy, capsys):
    step = run_copy / "checkpoints" / "step-00000004"
    record = json.loads((step / checkpoints.DATASET_FILE).read_text())
    assert record["splits"] == dataset_identity(tiny_dataset)  # what it trained on, split by split
    record["splits"]["validation"] = "0" * 64  # as if the held-out split was re-made since
    (step / checkpoints.DATASET_FILE).write_text(json.dumps(record))
    write_checksums(step)
    code = main(["train", "--out", str(run_copy), "--resume", *words(tiny_dataset, **{"train.max_steps": 6})])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "changed" in err and "validation split" in err and "train split" not in err
    assert metrics_steps(run_copy) == [1, 2, 3, 4]


def test_resume_logs_each_step_once_and_the_plot_goes_forward(tiny_dataset, tmp_path):
    cfg = config(tiny_dataset, tmp_path / "run", **{"train.save_every": 3})
    trainer.train(cfg, console=quiet(), stop_after=4)  # checkpoint at 3 and at the stop (4)
    state.write_latest(tmp_path / "run" / "checkpoints", "step-00000003")  # as if killed before step 4's save
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000004")
    assert metrics_steps(tmp_path / "run") == [1, 2, 3, 4]
    trainer.train(cfg, resume=True, console=quiet())
    assert metrics_steps(tmp_path / "run") == [1, 2, 3, 4]


def test_trim_metrics_drops_replayed_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    assert metrics.trim_metrics(path, 2) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def test_the_plot_reads_each_step_once_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.4), (3, 3.0), (4, 2.9)]  # a resume that logged 3, 4 twice
    path.write_text(
        "".join(json.dumps({"step": s, "loss": x, "acceptance_length": 1.0}) + "\n" for s, x in steps)
    )
    records = metrics.read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.9)]
    assert metrics.plot_training(path, tmp_path / "training.png").stat().st_size > 1000


def test_a_checkpoint_of_another_shape_is_one_clear_error():
    from dflashkit.model.config import DrafterConfig
    from dflashkit.model.drafter import DFlashDrafter

    def drafter(layers):
        return DFlashDrafter(
            DrafterConfig(
                hidden_size=32,
                num_hidden_layers=layers,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                intermediate_size=64,
                vocab_size=50,
                num_target_layers=4,
                block_size=4,
                mask_token_id=0,
                target_layer_ids=[1],
                rope_theta=10000.0,
            )
        )

    with pytest.raises(CheckpointError, match="another shape"):
        checkpoints.load_weights(drafter(1), drafter(2).state_dict(), "ckpt")

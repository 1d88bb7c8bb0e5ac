"""Fan-out training on the embedded target: drafter variants as threads fed by one target pass per
micro-batch, each drafter exactly as its own single run; a failing drafter stops alone and resumes;
compiled flex forward in drafter threads while the target worker runs, with no compile after warm-up."""

import contextlib
import json
import os
import signal
import threading

import pytest
import torch

from dflashkit.attention.flex import entry_state
from dflashkit.config import apply_overrides, load_config
from dflashkit.errors import ConfigError, DeviceError, DflashkitError
from dflashkit.model.checkpoint import load_drafter
from dflashkit.runtime.compile import COMPILE_LOCK, frozen_compiles, is_frozen
from dflashkit.target import packed
from dflashkit.train import fanout, state, trainer
from dflashkit.train.validation import validate

STEPS = 6
# a: the base (block 4, 1 layer, 2 target layers); b: block 8 and another lr; c: 2 layers reading 3
# target layers, distilling (so the target computes the union of the drafters' layers and the last one
# c's loss reads, and each takes its own).
A = "{name: a}"
B = "{name: b, overrides: {drafter.block_size: 8, train.lr: 1.0e-3}}"
C = "{name: c, overrides: {drafter.layers: 2, drafter.num_target_layers: 3, train.distill: 0.5}}"
VARIANTS = f"[{A}, {B}, {C}]"


def fanout_config(data_dir, out_dir, variants=VARIANTS, **over):
    base = {
        "target.dtype": "float32",
        "data.dir": str(data_dir),
        "run.out_dir": str(out_dir),
        "run.device": "cpu",  # sdpa, deterministic: the same on a GPU machine
        "drafter.layers": 1,
        "drafter.block_size": 4,
        "drafter.num_target_layers": 2,
        "train.max_steps": STEPS,
        "train.max_len": 96,
        "train.num_anchors": 12,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.log_every": 1,
        "train.eval_every": STEPS,
        "train.save_every": 2,
        "train.keep_last": 4,
        "train.cache_features": False,  # the target runs for every micro-batch: what the fan-out shares
        "train.chunk_blocks": 4,
        "fanout.variants": variants,
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def quiet():
    from rich.console import Console

    return Console(quiet=True)


@contextlib.contextmanager
def counting_target_passes():
    calls = []
    real = packed.target_pass

    def counted(target, rows, layer_ids):
        calls.append(len(rows))
        return real(target, rows, layer_ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "target_pass", counted)
        yield calls


@pytest.fixture(scope="module")
def sweep(tiny_dataset, tmp_path_factory):
    """One fan-out of three variants, and each variant trained alone on the same data."""
    root = tmp_path_factory.mktemp("fanout")
    cfg = fanout_config(tiny_dataset, root / "fan")
    with counting_target_passes() as calls:
        result = fanout.train_fanout(cfg, console=quiet())
    singles = {
        name: trainer.train(
            apply_overrides(vcfg, {"run.out_dir": str(root / "single" / name)}, name), console=quiet()
        )
        for name, vcfg in fanout.variant_configs(cfg)
    }
    return cfg, result, singles, calls


def test_each_drafter_trains_exactly_as_its_own_run(sweep):
    cfg, result, singles, _ = sweep
    assert result.ok and [d.name for d in result.drafters] == ["a", "b", "c"]
    for name, single in singles.items():
        mine = result.results[name]
        assert mine.steps == STEPS and len(mine.losses) == STEPS
        assert mine.losses == single.losses, name  # bit for bit: same batches, anchors and features
        assert mine.final_val == single.final_val, name
        assert mine.best_served_acceptance_length == single.best_served_acceptance_length
    assert len(set(tuple(r.losses) for r in result.results.values())) == 3  # the variants do differ
    for d in result.drafters:
        folder = result.out_dir / d.name
        log = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == list(range(1, STEPS + 1))
        assert state.read_latest(folder / "checkpoints").name == state.step_dir_name(STEPS)
        assert (folder / "best" / "model.safetensors").is_file()
        assert d.status == "done" and d.steps == STEPS and d.final_loss == result.results[d.name].losses[-1]
    summary = json.loads((result.out_dir / fanout.SUMMARY_FILE).read_text())
    assert [d["status"] for d in summary["drafters"]] == ["done"] * 3
    assert (result.out_dir / "config.yaml").is_file() and (result.out_dir / "fingerprint.json").is_file()


def test_the_target_runs_once_per_micro_batch_for_all_drafters(sweep, tiny_dataset):
    _, result, _, calls = sweep
    val_rows = len(trainer.setup_run(fanout.variant_configs(sweep[0])[0][1]).val_rows)
    assert result.target_batches == STEPS
    assert len(calls) == STEPS + val_rows  # K=3 drafters, yet one pass per training and held-out row
    assert [d.micro_batches for d in result.drafters] == [STEPS] * 3
    assert result.compiles_after_warmup == 0


def test_a_failing_drafter_stops_alone_and_resumes(sweep, tiny_dataset, tmp_path):
    _, _, singles, _ = sweep
    cfg = fanout_config(tiny_dataset, tmp_path / "fan", variants=f"[{A}, {B}]")
    real = trainer.block_step
    steps = []

    def failing(drafter, *args, **kw):
        if drafter.config.block_size == 8 and torch.is_grad_enabled():  # variant b's training steps
            steps.append(1)
            if len(steps) == 5:
                raise RuntimeError("injected failure in step 5")
        return real(drafter, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "block_step", failing)
        result = fanout.train_fanout(cfg, console=quiet())
    a, b = result.drafters
    assert (a.status, a.steps, a.error) == ("done", STEPS, None)
    assert result.results["a"].losses == singles["a"].losses  # untouched by b's failure
    assert b.status == "failed" and "RuntimeError: injected failure in step 5" in b.error
    assert b.steps == 4 and b.micro_batches == 5  # the target stopped feeding it
    assert result.target_batches == STEPS
    assert not result.ok
    folder = tmp_path / "fan" / "b"
    assert "injected failure" in (folder / fanout.ERROR_FILE).read_text()
    latest = state.read_latest(folder / "checkpoints")
    assert latest.name == state.step_dir_name(4)  # the last good checkpoint, intact
    assert json.loads((latest / state.STATE_JSON).read_text())["step"] == 4
    load_drafter(latest)
    assert state.read_latest(tmp_path / "fan" / "a" / "checkpoints").name == state.step_dir_name(STEPS)
    table = json.loads((tmp_path / "fan" / fanout.SUMMARY_FILE).read_text())
    assert [d["status"] for d in table["drafters"]] == ["done", "failed"]

    again = fanout.train_fanout(cfg, resume=True, console=quiet())
    assert again.ok and again.target_batches == STEPS - 4  # only b needs batches 4 and 5
    assert again.results["b"].losses == singles["b"].losses[4:]  # resumed exactly
    assert again.results["a"].steps == STEPS and again.results["a"].losses == []


def test_sigterm_checkpoints_every_drafter_and_resume_finishes_exactly(sweep, tiny_dataset, tmp_path):
    """SIGTERM (here sent from variant a's second step) reaches the fan-out's main thread; each drafter
    ends the step under way, checkpoints it and stops; --resume gives each variant's uninterrupted losses."""
    _, _, singles, _ = sweep
    cfg = fanout_config(tiny_dataset, tmp_path / "fan", variants=f"[{A}, {B}]")
    real = trainer.accumulate

    def signalled(run, s, *args, **kw):
        out = real(run, s, *args, **kw)
        if run.cfg.drafter.block_size == 4 and s.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "accumulate", signalled)
        result = fanout.train_fanout(cfg, console=quiet())
    assert not result.ok
    for d in result.drafters:
        assert d.status == "stopped" and "SIGTERM" in d.error and 2 <= d.steps < STEPS, d
        latest = state.read_latest(tmp_path / "fan" / d.name / "checkpoints")
        assert latest.name == state.step_dir_name(d.steps)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    again = fanout.train_fanout(cfg, resume=True, console=quiet())
    assert again.ok
    for d in result.drafters:
        assert result.results[d.name].losses + again.results[d.name].losses == singles[d.name].losses, d.name


def test_a_drafter_whose_warm_up_fails_does_not_start(tiny_dataset, tmp_path):
    """Warm-up runs drafter by drafter before any thread starts; one that raises there (here: flex
    training asked of the CPU, which has no flex backward) is marked failed, the others train."""
    cfg = fanout_config(tiny_dataset, tmp_path / "fan", variants=f"[{A}, {B}]", **{"train.max_steps": 2})
    fan = fanout.setup_fanout(cfg)
    fan.workers[0].run.backend = "flex"
    result = fanout.train_all(fan, console=quiet())
    a, b = result.drafters
    assert a.status == "failed" and "no backward on cpu" in a.error and a.steps == 0 and a.micro_batches == 0
    assert (tmp_path / "fan" / "a" / fanout.ERROR_FILE).is_file()
    assert (b.status, b.steps) == ("done", 2) and result.target_batches == 2


def test_a_failing_target_stops_every_drafter_with_its_checkpoints(tiny_dataset, tmp_path):
    cfg = fanout_config(tiny_dataset, tmp_path / "fan", variants=f"[{A}, {B}]")
    val_rows = len(trainer.setup_run(fanout.variant_configs(cfg)[0][1]).val_rows)
    real = packed.target_pass
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == val_rows + 4:  # the held-out rows, then training micro-batches 0, 1, 2
            raise RuntimeError("injected target failure")
        return real(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "target_pass", failing)
        with pytest.raises(DflashkitError, match="the target worker failed .*injected target failure"):
            fanout.train_fanout(cfg, console=quiet())
    table = json.loads((tmp_path / "fan" / fanout.SUMMARY_FILE).read_text())
    assert [d["status"] for d in table["drafters"]] == ["stopped", "stopped"]
    assert table["target_batches"] == 3 and all(d["steps"] <= 3 for d in table["drafters"])
    for d in table["drafters"]:
        latest = state.read_latest(tmp_path / "fan" / d["name"] / "checkpoints")
        if latest is not None:  # whatever was saved before the stop is whole
            load_drafter(latest)


def test_compiled_flex_forward_in_drafter_threads_while_the_target_runs(tiny_dataset, tmp_path):
    """Warm the drafters' compiled flex attention serially, freeze, then step three drafter threads
    (forward: the CPU has no flex backward) on features the target worker produces meanwhile: no error,
    no compile, and the target still runs once per micro-batch."""
    variants = (
        "[{name: a}, {name: b, overrides: {drafter.layers: 2}}, {name: c, overrides: {train.lr: 1.0e-3}}]"
    )
    fan = fanout.setup_fanout(fanout_config(tiny_dataset, tmp_path / "fan", variants=variants))
    for w in fan.workers:
        w.run.backend = "flex"
    fanout.share_validation_features(fan)
    with COMPILE_LOCK:  # what warm_up does, forward only
        for w in fan.workers:
            validate(w.run, w.source, max_rows=1)
    with frozen_compiles():
        graphs, compiled = fanout.compiled_graph_count(), entry_state()["compiled_shapes"]
        errors, steps = [], [0] * len(fan.workers)

        def drafter(i, w):
            g = torch.Generator().manual_seed(i)
            try:
                with torch.no_grad():
                    for mb in w.run.stream.from_cursor(None):
                        if w.feed.taken == w.feed.end:
                            break
                        rows = w.run.train_rows.take(mb.rows, w.run.device)
                        feats, argmax = w.source.batch(mb, rows)  # from the feed, in stream order
                        out = trainer.block_step(
                            w.run.drafter,
                            w.run.target,
                            rows,
                            feats,
                            argmax,
                            w.run.cfg,
                            "flex",
                            g,
                            contextlib.nullcontext(),
                        )
                        assert torch.isfinite(out.loss.loss)
                        steps[i] += 1
            except Exception as e:
                errors.append(f"{w.name}: {type(e).__name__}: {e}")
            finally:
                w.feed.close()

        threads = [threading.Thread(target=drafter, args=(i, w)) for i, w in enumerate(fan.workers)]
        for t in threads:
            t.start()
        with counting_target_passes() as calls:
            stats = fanout.feed_drafters(fan)
        for t in threads:
            t.join(120)
        assert errors == []
        assert steps == [STEPS] * 3 and stats["batches"] == STEPS and len(calls) == STEPS
        assert fanout.compiled_graph_count() == graphs
        assert entry_state()["compiled_shapes"] == compiled and is_frozen()
    assert not is_frozen()


def test_variants_may_not_change_what_the_drafters_share(tiny_dataset, tmp_path):
    for key in ("train.max_len", "train.batch_size", "train.seed", "data.dir", "target.path", "run.device"):
        with pytest.raises(ConfigError, match=f"overrides {key}, which every fan-out drafter shares"):
            fanout_config(tiny_dataset, tmp_path, variants=f"[{{name: a, overrides: {{{key}: 1}}}}]")
    with pytest.raises(ConfigError, match="names must differ; a appears more than once"):
        fanout_config(tiny_dataset, tmp_path, variants="[{name: a}, {name: a}]")
    with pytest.raises(ConfigError, match="fanout variant a: drafter.block_size"):
        fanout_config(tiny_dataset, tmp_path, variants="[{name: a, overrides: {drafter.block_size: 1}}]")
    with pytest.raises(ConfigError, match="no fanout section"):
        fanout.placement(load_config(None))
    cfg = fanout_config(tiny_dataset, tmp_path, variants="[{name: a, device: cuda:1}]")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            fanout.placement(cfg)


def test_ready_config_and_dry_run(tiny_dataset, tmp_path, capsys):
    from dflashkit.cli import main

    cfg = load_config("configs/fanout.yaml")
    names = [name for name, _ in fanout.variant_configs(cfg)]
    assert names == ["b8-l1", "b4-l1", "b8-l2"]
    assert [v.drafter.block_size for _, v in fanout.variant_configs(cfg)] == [8, 4, 8]
    over = [f"data.dir={tiny_dataset}", f"run.out_dir={tmp_path / 'fan'}", "train.max_len=96"]
    for command in ("fanout", "train"):  # `dflashkit train` hands a config with a fanout section over
        assert main([command, "-c", "configs/fanout.yaml", "--dry-run", *over]) == 0
        said = capsys.readouterr().out
        assert "every variant checks out" in said
        # the earlier name says what it is now, once; train says nothing of it
        assert ("is `dflashkit train` on a config with a fanout section" in said) == (command == "fanout")
    assert main(["train", "-c", "configs/fanout.yaml", "--nproc", "2", *over]) == 2
    assert "drop --nproc" in capsys.readouterr().err
    assert not (tmp_path / "fan").exists()
    assert main(["fanout", f"data.dir={tiny_dataset}"]) == 2
    assert "no fanout section" in capsys.readouterr().err


@pytest.mark.gpu
def test_flex_fanout_on_gpu_warms_every_drafter_then_freezes(tiny_dataset, tmp_path):
    """On the GPU(s): compiled flex forward and backward for two block sizes and a distilling drafter (target
    on cuda:0, the drafters on cuda:1 when there are two GPUs), warmed serially, then frozen: no compile
    afterwards."""
    cfg = fanout_config(
        tiny_dataset,
        tmp_path / "fan",
        **{
            "run.device": "auto",
            "attention.backend": "flex",
            "target.dtype": "bfloat16",
            "train.autocast": "bf16",
        },
    )
    result = fanout.train_fanout(cfg, console=quiet())
    assert result.ok and result.compiles_after_warmup == 0 and not is_frozen()
    assert result.target_batches == STEPS and result.warmup_seconds > 0
    want = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    assert [d.device for d in result.drafters] == [want] * 3
    assert all(torch.isfinite(torch.tensor(r.losses)).all() for r in result.results.values())


@pytest.mark.gpu
def test_two_target_workers_on_the_gpus(tiny_dataset, tmp_path):
    """Target workers on cuda:0 and cuda:1 (fanout.target_devices), compiled flex drafters on the other
    GPUs (or beside the second worker): the workers share the passes, every drafter gets the stream in
    order (a wrong batch would raise FeedError), no compile after warm-up."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip("needs 2 GPUs")
    cfg = fanout_config(
        tiny_dataset,
        tmp_path / "fan",
        variants=f"[{A}, {B}]",
        **{
            "run.device": "auto",
            "attention.backend": "flex",
            "target.dtype": "bfloat16",
            "train.autocast": "bf16",
            "fanout.target_devices": "[cuda:0, cuda:1]",
        },
    )
    result = fanout.train_fanout(cfg, console=quiet())
    assert result.ok and result.compiles_after_warmup == 0 and not is_frozen()
    assert [(t.device, t.batches) for t in result.target_workers] == [("cuda:0", 3), ("cuda:1", 3)]
    pool = [f"cuda:{i}" for i in range(2, count)] or ["cuda:1"]
    assert [d.device for d in result.drafters] == [pool[0], pool[1 % len(pool)]]
    assert all(torch.isfinite(torch.tensor(r.losses)).all() for r in result.results.values())

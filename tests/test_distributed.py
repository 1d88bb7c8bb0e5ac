"""Data-parallel training (torchrun, gloo on the CPU): 2 ranks x batch 1 train exactly as 1 process x batch 2
(losses per step, validation, final weights, to float rounding), DDP and FSDP2 checkpoints resume on another
world size, `dflashkit train --nproc` relaunches itself through torchrun, and the pieces underneath."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import build_parser, main
from dflashkit.config import load_config
from dflashkit.data.rows import Rows
from dflashkit.data.stream import MicroBatchStream, anchor_seed
from dflashkit.errors import ConfigError
from dflashkit.train import distributed, trainer
from dflashkit.train.step import draw_anchors

STEPS = 4


def tiny_overrides(data_dir, out_dir, **over):
    base = {
        "target.dtype": "float32",
        "data.dir": str(data_dir),
        "run.out_dir": str(out_dir),
        "drafter.layers": 1,
        "drafter.block_size": 4,
        "drafter.num_target_layers": 2,
        "train.max_steps": STEPS,
        "train.max_len": 96,
        "train.num_anchors": 12,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.min_lr_ratio": 1.0,  # a constant rate: a run stopped at max_steps=2 resumes on the same schedule
        "train.log_every": 1,
        "train.eval_every": 2,
        "train.save_every": 2,
        "train.cache_features": True,
        "train.chunk_blocks": 4,
        "train.grad_accum": 2,  # 4 global rows per step: 4 steps walk 2 epochs of the 8 rows
    }
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


def quiet():
    from rich.console import Console

    return Console(quiet=True)


def torchrun_train(words, timeout=300):
    """`dflashkit train --nproc 2 ...` in a subprocess (the relaunch itself is part of what is tested)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for v in distributed.TORCHRUN_VARS:
        env.pop(v, None)
    proc = subprocess.run(
        [sys.executable, "-m", "dflashkit", "train", "--nproc", "2", *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir, step=STEPS):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def assert_same_weights(a, b, atol=5e-5, outlier_atol=1e-3, max_outlier_fraction=1e-4):
    """The same weights to rounding. Adam divides each gradient by its own running RMS, so an element whose
    gradient is near zero turns rounding noise (all-reduce order, thread count) into an update of up to
    about the learning rate (3e-3 here): a handful of elements may differ by more than `atol`, never by a
    third of one step (`outlier_atol`), and never many of them (a wrong gradient moves every element)."""
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs()
        assert float(diff.max()) <= outlier_atol, f"{k}: differs by {float(diff.max()):.2e}"
        outliers = int((diff > atol).sum())
        assert outliers <= max_outlier_fraction * diff.numel(), f"{k}: {outliers} elements beyond {atol}"


def restart_at(run_dir, copy_to, step):
    """A copy of a run folder whose latest checkpoint is `step` (as if it had stopped there)."""
    import shutil

    shutil.copytree(run_dir, copy_to)
    ckpts = Path(copy_to) / "checkpoints"
    for p in ckpts.glob("step-*"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    (ckpts / "latest").write_text(f"step-{step:08d}\n")
    lines = [r for r in metrics(copy_to) if r["step"] <= step]
    (Path(copy_to) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return Path(copy_to)


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory):
    """One process x batch 2, and 2 DDP ranks x batch 1 started with `dflashkit train --nproc 2`."""
    root = tmp_path_factory.mktemp("dp")
    single = trainer.train(
        load_config(None, tiny_overrides(tiny_dataset, root / "single", **{"train.batch_size": 2})),
        console=quiet(),
    )
    log = torchrun_train(tiny_overrides(tiny_dataset, root / "ddp", **{"train.batch_size": 1}))
    return {"root": root, "data": tiny_dataset, "single": single, "ddp": root / "ddp", "ddp_log": log}


# --------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
def test_two_ddp_ranks_train_as_one_process_with_the_global_batch(runs):
    single, ddp = runs["single"], metrics(runs["ddp"])
    assert "data-parallel (ddp): 2 ranks x batch 1 x accum 2 = 4 rows per step" in runs["ddp_log"]
    assert [r["step"] for r in ddp] == list(range(1, STEPS + 1))  # rank 0 alone logs
    torch.testing.assert_close([r["loss"] for r in ddp], single.losses, rtol=1e-5, atol=0)
    one = metrics(single.out_dir)
    for a, b in zip(one, ddp, strict=True):
        assert a["acceptance_length"] == pytest.approx(b["acceptance_length"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        if "val" in a:  # validation split over the ranks and reduced: the same numbers
            assert b["val"]["loss"] == pytest.approx(a["val"]["loss"], rel=1e-5)
            assert b["val"]["blocks"] == a["val"]["blocks"]
            assert b["val"]["acceptance_length"] == pytest.approx(a["val"]["acceptance_length"], abs=1e-9)
    assert_same_weights(weights(single.out_dir), weights(runs["ddp"]))
    ckpts = runs["ddp"] / "checkpoints"  # one checkpoint per save, written once, no leftovers
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    state = json.loads((ckpts / "step-00000004" / "training_state.json").read_text())
    one_state = single.out_dir / "checkpoints" / "step-00000004" / "training_state.json"
    assert state["data_cursor"] == json.loads(one_state.read_text())["data_cursor"]  # in global rows
    assert state["step"] == STEPS and state["data_cursor"] == {"epoch": 1, "index": 8}
    assert state["extra"]["world_size"] == 2 and state["extra"]["global_batch"] == 4
    assert (runs["ddp"] / "best" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ddp_checkpoint_resumes_on_one_process(runs):
    """2 ranks -> 1 process: the same global position, the same anchors, the same steps to rounding."""
    run_dir = restart_at(runs["ddp"], runs["root"] / "ddp-then-one", 2)
    cfg = load_config(None, tiny_overrides(runs["data"], run_dir, **{"train.batch_size": 2}))
    console_file = runs["root"] / "resume-log.txt"
    from rich.console import Console

    with open(console_file, "w") as f:
        resumed = trainer.train(cfg, resume=True, console=Console(file=f, width=400))
    assert resumed.steps == STEPS
    torch.testing.assert_close(resumed.losses, runs["single"].losses[2:], rtol=1e-5, atol=0)
    assert_same_weights(weights(runs["single"].out_dir), weights(run_dir))
    assert "written by 2 rank(s), this run has 1" in console_file.read_text()


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_fsdp_ranks(runs):
    """1 process -> 2 FSDP2 ranks (fp32 compute): full weights and optimizer state scattered into shards,
    then gathered again for the checkpoint; the result matches the uninterrupted one-process run."""
    run_dir = restart_at(runs["single"].out_dir, runs["root"] / "one-then-fsdp", 2)
    log = torchrun_train(
        [
            "--resume",
            *tiny_overrides(
                runs["data"],
                run_dir,
                **{
                    "train.batch_size": 1,
                    "distributed.strategy": "fsdp",
                    "distributed.fsdp_param_dtype": "float32",
                },
            ),
        ]
    )
    assert "data-parallel (fsdp)" in log and "written by 1 rank(s), this run has 2" in log
    resumed = [r["loss"] for r in metrics(run_dir) if r["step"] > 2]
    torch.testing.assert_close(resumed, runs["single"].losses[2:], rtol=1e-5, atol=0)
    assert_same_weights(weights(runs["single"].out_dir), weights(run_dir))
    saved = torch.load(run_dir / "checkpoints" / "step-00000004" / "training_state.pt", weights_only=True)[
        "optimizer"
    ]
    plain = torch.load(
        runs["single"].out_dir / "checkpoints" / "step-00000004" / "training_state.pt", weights_only=True
    )["optimizer"]
    assert saved["state"].keys() == plain["state"].keys()  # the full state, in the one-process layout
    for i, s in plain["state"].items():
        torch.testing.assert_close(saved["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# The pieces


def test_ranks_split_every_global_micro_batch():
    for world in (1, 2, 3, 4):
        for b in (1, 3):
            streams = [MicroBatchStream(40, b, 0, world_size=world, rank=r) for r in range(world)]
            got = [next(s.from_cursor({"epoch": 0, "index": 10})) for s in streams]
            assert sum((mb.rows for mb in got), []) == streams[0].order(0)[10 : 10 + world * b]
            assert sum((mb.seeds for mb in got), []) == [
                anchor_seed(0, 0, p) for p in range(10, 10 + world * b)
            ]
            assert {tuple(mb.cursor_after.items()) for mb in got} == {
                (("epoch", 0), ("index", 10 + world * b))
            }


def test_validation_rows_are_dealt_in_lockstep():
    for n in (1, 5, 8):
        for world in (1, 2, 3):
            shares = [
                distributed.lockstep_rows(n, distributed.Dist(torch.device("cpu"), r, world))
                for r in range(world)
            ]
            assert len({len(s) for s in shares}) == 1  # every rank runs as many forwards
            counted = sorted(i for s in shares for i, c in s if c)
            assert counted == list(range(n))  # every row counted exactly once
    assert distributed.lockstep_rows(0, distributed.Dist(torch.device("cpu"), 1, 2)) == []


def test_anchor_draw_of_a_row_does_not_depend_on_its_batch():
    T = 64
    g = torch.Generator()
    loss_mask = torch.rand(3, T, generator=g.manual_seed(1)) > 0.3
    doc_ids = torch.zeros(3, T, dtype=torch.long)
    z = torch.zeros(3, T, dtype=torch.long)
    rows = Rows(z, loss_mask, doc_ids, z)
    seeds = [anchor_seed(0, 0, p) for p in (4, 5, 6)]
    together = draw_anchors(rows, 8, 4, torch.Generator(), seeds)
    for i in range(3):
        alone = draw_anchors(rows.take([i], torch.device("cpu")), 8, 4, torch.Generator(), seeds[i : i + 1])
        assert torch.equal(alone.anchors[0], together.anchors[i])
        assert torch.equal(alone.block_valid[0], together.block_valid[i])
    other = draw_anchors(rows, 8, 4, torch.Generator(), [anchor_seed(0, 1, p) for p in (4, 5, 6)])
    assert not torch.equal(other.anchors, together.anchors)  # another epoch, other anchors
    assert len({anchor_seed(s, e, p) for s in (0, 1) for e in (0, 1) for p in range(100)}) == 400
    assert all(0 <= anchor_seed(2**40, 7, p) < 2**63 for p in range(10))


def test_one_process_keeps_its_own_loss():
    one = distributed.single_process(torch.device("cpu"))
    loss = torch.tensor(2.5, requires_grad=True)
    out, share = distributed.global_loss(loss * 4, torch.tensor(4.0), loss, one)
    assert out is loss and share == 2.5
    assert distributed.sum_over_ranks([1.0, 2.0], one) == [1.0, 2.0]
    assert not one.parallel and one.is_main


def test_resume_note_names_the_change():
    two = distributed.Dist(torch.device("cpu"), 0, 2)
    assert distributed.resume_note({"world_size": 2, "global_batch": 4}, two, 4) is None
    assert "written by 1 rank(s), this run has 2" in distributed.resume_note({"global_batch": 4}, two, 4)
    assert "global batch changed from 2 to 4" in distributed.resume_note(
        {"world_size": 2, "global_batch": 2}, two, 4
    )


def test_launch_command_for_one_and_several_hosts():
    args = build_parser().parse_args(["train", "-c", "configs/embedded.yaml", "--resume", "--nproc", "8"])
    args.overrides = ["train.lr=1e-4"]
    words = distributed.train_argv(args)
    assert words == ["train", "--config", "configs/embedded.yaml", "--resume", "train.lr=1e-4"]
    one = distributed.launch_command(words, 8)
    assert one[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=8",
        "--standalone",
        "-m",
        "dflashkit",
        *words,
    ]
    many = distributed.launch_command(words, 8, nnodes=2, rdzv_endpoint="node0:29500")
    assert "--nnodes=2" in many and "--rdzv-endpoint=node0:29500" in many and "--standalone" not in many
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        distributed.launch_command(words, 8, nnodes=2)
    with pytest.raises(ConfigError, match="at least 1"):
        distributed.launch_command(words, 0)


def test_nproc_dry_run_prints_the_launch(tiny_dataset, tmp_path, capsys):
    code = main(["train", "--nproc", "2", "--dry-run", *tiny_overrides(tiny_dataset, tmp_path / "run")])
    assert code == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "torch.distributed.run --nproc-per-node=2 --standalone -m dflashkit train" in out
    assert "everything checks out" in out and not (tmp_path / "run").exists()


def test_nproc_inside_torchrun_is_refused(monkeypatch, capsys):
    for v, x in zip(distributed.TORCHRUN_VARS, ("0", "2", "0"), strict=True):
        monkeypatch.setenv(v, x)
    assert main(["train", "--nproc", "2", "--dry-run"]) == 2
    assert "started by torchrun already" in capsys.readouterr().err
    assert main(["train", "--nnodes", "2"]) == 2
    assert "go with --nproc" in capsys.readouterr().err


def test_too_few_rows_for_the_ranks_is_one_clear_error(tiny_dataset, tmp_path):
    from dflashkit.errors import DataError

    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run"))
    with pytest.raises(DataError, match="64 ranks x train.batch_size=1"):
        trainer.setup_run(cfg, dist=distributed.Dist(torch.device("cpu"), 0, 64))


def test_torchrun_with_a_named_gpu_is_refused(monkeypatch, tmp_path):
    for v, x in zip(distributed.TORCHRUN_VARS, ("0", "2", "0"), strict=True):
        monkeypatch.setenv(v, x)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.device=cuda:1"])
    with pytest.raises(ConfigError, match="cuda:LOCAL_RANK"):
        distributed.init_distributed(cfg)


# --------------------------------------------------------------------------------------------------
# On 2 GPUs (nccl, compiled flex attention warmed and frozen in every rank)


def two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


GPU_FLEX = {"run.device": "cuda", "attention.backend": "flex", "train.autocast": "off"}


@pytest.mark.gpu
@two_gpus()
def test_two_gpu_ranks_train_as_one_gpu_with_the_global_batch(tiny_dataset, tmp_path):

    one = trainer.train(
        load_config(
            None, tiny_overrides(tiny_dataset, tmp_path / "one", **GPU_FLEX, **{"train.batch_size": 2})
        ),
        console=quiet(),
    )
    log = torchrun_train(
        tiny_overrides(tiny_dataset, tmp_path / "ddp", **GPU_FLEX, **{"train.batch_size": 1})
    )
    assert "data-parallel (ddp): 2 ranks" in log
    torch.testing.assert_close([r["loss"] for r in metrics(tmp_path / "ddp")], one.losses, rtol=1e-4, atol=0)
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "ddp"), atol=2e-4)


@pytest.mark.gpu
@two_gpus()
def test_two_gpu_fsdp_bf16_trains_and_resumes_on_ddp(tiny_dataset, tmp_path):
    fsdp = {"run.device": "cuda", "attention.backend": "flex", "target.dtype": "bfloat16"}
    words = tiny_overrides(tiny_dataset, tmp_path / "run", **fsdp, **{"train.batch_size": 1})
    torchrun_train([*words, "distributed.strategy=fsdp", "train.max_steps=2"])
    log = torchrun_train(["--resume", *words])  # DDP continues the FSDP2 checkpoint
    assert "resumed from" in log and "data-parallel (ddp)" in log
    losses = [r["loss"] for r in metrics(tmp_path / "run")]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)


def _stop_on_one_rank(rank: int, store_file: str, results: dict) -> None:
    import signal

    import torch.distributed as dist

    from dflashkit.train.stopping import StopRequest, stop_requested

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        d = distributed.Dist(torch.device("cpu"), rank=rank, world_size=2, strategy="ddp")
        request = StopRequest()
        first = stop_requested(request, d)  # no signal anywhere yet
        if rank == 1:
            request.signum = int(signal.SIGTERM)  # the signal reached rank 1 alone
        results[rank] = (first, stop_requested(request, d), request.name)
    finally:
        dist.destroy_process_group()


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_stop_on_one_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        assert dict(results) == {0: (False, True, "SIGTERM"), 1: (False, True, "SIGTERM")}

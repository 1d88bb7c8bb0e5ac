"""Training a DFlash drafter: `train()` is a short loop over components, read top to bottom.

    train(cfg)
      open_run_folder    the run folder's rules; the checkpoint a resume continues from   (checkpoints)
      setup_run          target, drafter, packed rows and their micro-batch stream        (setup)
      feature_source     where the target's features come from                             (sources)
      start              weights, optimizer and schedule, the resumed state, the metrics   (this module)
      warm_up            every compiled shape, serially, before compiles are frozen
      loop               optimizer steps over the stream; validation, best/, checkpoints

Each optimizer step takes train.grad_accum micro-batches of the stream (`data.stream`): their features
(`sources`), anchors and blocks, the drafter and the chunked, position-weighted loss (`step.block_step`),
backward. A non-finite loss stops the run before the optimizer applies it. Held-out acceptance
(`validation.validate`) picks best/ by the served-order acceptance length at the temperature the config
serves at (`checkpoints.best_metric`), what serving measures.
Started by torchrun, each process trains its share of every global batch (`distributed`); a fan-out's
drafter threads run `start` and `loop` themselves, fed by its target workers (`fanout`).

A run folder holds:
    config.yaml  fingerprint.json  metrics.jsonl  training.png
    checkpoints/step-000100/  (z-lab drafter + training state + run config + fingerprint; atomic)
    checkpoints/latest        (name of the newest complete checkpoint)
    best/                     (z-lab drafter with the best held-out served-order acceptance length)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import Tensor, nn

from dflashkit.config import RunConfig, dump_config
from dflashkit.data.stream import MicroBatch
from dflashkit.errors import NonFiniteLossError
from dflashkit.model.acceptance import add_stats, finalize_stats
from dflashkit.model.checkpoint import load_drafter
from dflashkit.runtime import fingerprint
from dflashkit.runtime.compile import COMPILE_LOCK, check_not_frozen, frozen_compiles
from dflashkit.runtime.compile_cache import portable_cache
from dflashkit.runtime.devices import autocast_context
from dflashkit.train import distributed, state
from dflashkit.train.checkpoints import (
    BEST_KEY,
    ResumePoint,
    best_metric,
    best_so_far,
    load_weights,
    open_run_folder,
    save_best,
    save_checkpoint,
)
from dflashkit.train.metrics import MetricsLog
from dflashkit.train.optimizer import build_optimizer
from dflashkit.train.progress import TrainProgress
from dflashkit.train.setup import Run, setup_run, start_note, with_init_shape
from dflashkit.train.sources import FeatureSource, feature_source
from dflashkit.train.step import block_step
from dflashkit.train.stopping import StopRequest, stop_on_signals, stop_requested
from dflashkit.train.validation import validate


@dataclass
class TrainResult:
    steps: int
    seconds: float
    best_served_acceptance_length: float  # the best held-out served-order acceptance length (best/)
    final_val: dict[str, Any]  # the last held-out measurement (`validation.validate`)
    out_dir: Path
    losses: list[float]  # one per step trained in this session
    stopped_by: str = ""  # the signal that ended the loop early (its step checkpointed), e.g. "SIGTERM"


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    console: Any = None,
    stop_after: int | None = None,
    move_aside: bool = False,
) -> TrainResult:
    """Train a drafter as the config says. ``resume``: continue the newest intact checkpoint, if the config
    keeps what it was trained with; without it a run folder that holds an earlier run is refused, or, with
    ``move_aside``, moved to ``<out>.old-<time>`` first. ``stop_after`` ends the loop after that many steps
    (as an interruption would), leaving the checkpoints for ``resume``."""
    cfg = with_init_shape(cfg)  # before the run folder: its config.yaml and a resume see the shape trained
    d = distributed.init_distributed(cfg)
    try:
        console = (console or Console()) if d.is_main else Console(quiet=True)  # rank 0 speaks
        resume_from = open_run_folder(cfg, d, resume=resume, move_aside=move_aside, console=console)
        t0 = time.perf_counter()  # long before the first step on large data: say what is under way
        console.print(f"setting up: the target, the drafter and the rows of {cfg.data.dir}")
        run = setup_run(cfg, dist=d)
        console.print(
            f"set up in {time.perf_counter() - t0:.1f} s: {len(run.train_rows):,} training and "
            f"{len(run.val_rows):,} held-out rows of {cfg.train.max_len} tokens"
        )
        source = feature_source(run)
        session = start(run, resume_from, console)
        t0 = time.perf_counter()
        with portable_cache(cfg.run.compile_cache, console, save=d.is_main):
            warm_up(run, source, session.model)
        console.print(f"warmed up in {time.perf_counter() - t0:.1f} s: every compiled shape is built")
        with frozen_compiles():  # any compile from here on is an error naming the shape
            return loop(run, session, source, console=console, stop_after=stop_after)
    finally:
        distributed.shutdown(d)


# --------------------------------------------------------------------------------------------------
# Start: what the loop carries from step to step


@dataclass
class Session:
    """A run's training state in this process: what steps, what optimizes, where the stream stands."""

    model: nn.Module  # what training steps: the drafter, or its DDP wrapper (FSDP shards it in place)
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    generator: torch.Generator  # the anchors' stream (each row re-seeds it: `data.stream.anchor_seed`)
    metrics: MetricsLog
    step: int = 0
    cursor: dict[str, int] | None = None  # the data cursor; None: the stream's start
    best: float = float("-inf")  # the best held-out served-order acceptance length so far


def start(run: Run, resume_from: ResumePoint | None, console: Any) -> Session:
    """The drafter's weights (the checkpoint's when resuming), its DDP / FSDP wrapper, the optimizer and
    schedule, and the resumed state: step, data cursor, random streams, the best so far."""
    cfg, d = run.cfg, run.dist
    if d.is_main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    if resume_from is not None:  # the full weights go in before DDP / FSDP takes the drafter
        ckpt = resume_from.checkpoint
        resumed = load_drafter(ckpt, run.target, dtype=torch.float32, device=run.device, verify=False)
        load_weights(run.drafter, resumed.state_dict(), ckpt)
    model = distributed.wrap_drafter(run.drafter, cfg, d).train()  # the drafter itself in one process
    params, optimizer, scheduler = build_optimizer(run.drafter, cfg, run.total_steps)
    generator = torch.Generator(device="cpu").manual_seed(cfg.train.seed)
    step, cursor, best = 0, None, float("-inf")
    if resume_from is not None:
        optimizer_io = distributed.checkpoint_optimizer(run.drafter, optimizer, d, gather=False)
        restored = state.apply_training_state(resume_from.saved, optimizer_io, scheduler)
        state.restore_rng(restored.rng, {"anchors": generator})
        step, cursor = restored.step, dict(restored.data_cursor)
        best = best_so_far(restored.extra, run.out_dir, run.cfg)
        console.print(f"resumed from {resume_from.checkpoint} at step {step}")
        note = distributed.resume_note(restored.extra, d, global_batch(run))
        if note:
            console.print(f"[yellow]{note}[/]")
    elif d.is_main:
        if cfg.drafter.init:
            console.print(f"starts from {start_note(cfg)}")
        (run.out_dir / "config.yaml").write_text(dump_config(cfg))
        fingerprint.save(fingerprint.collect(), run.out_dir / fingerprint.FINGERPRINT_FILE)
    metrics = MetricsLog(cfg, run.out_dir, resumed_at=step if resume_from else None, write=d.is_main)
    if d.parallel:
        console.print(
            f"data-parallel ({d.strategy}): {d.world_size} ranks x batch {cfg.train.batch_size} x accum "
            f"{cfg.train.grad_accum} = {global_batch(run)} rows per step"
        )
    return Session(model, params, optimizer, scheduler, generator, metrics, step, cursor, best)


def global_batch(run: Run) -> int:
    """Rows per optimizer step over all ranks."""
    return run.dist.world_size * run.cfg.train.batch_size * run.cfg.train.grad_accum


def warm_up(run: Run, source: FeatureSource, model: nn.Module | None = None) -> None:
    """Compile the flex attention of every shape this run uses (a training micro-batch forward and
    backward, an evaluation row) serially, before compiles are frozen (`frozen_compiles`): any later
    compile is an error, never a race or a silent dense path. Rows are padded to max_len and anchors are
    a fixed count, so these are all. ``model`` is what training steps (a DDP wrapper under torchrun;
    every rank warms up together)."""
    if run.backend != "flex" or len(run.train_rows) == 0:
        return
    g = torch.Generator().manual_seed(0)  # its own stream: warm-up must not move the training RNG
    idx = list(range(min(run.cfg.train.batch_size, len(run.train_rows))))
    rows = run.train_rows.take(idx, run.device)
    feats, argmax = source.features("train", idx, rows)
    autocast = autocast_context(run.cfg, run.device)
    with COMPILE_LOCK:
        check_not_frozen("the training warm-up")
        out = block_step(
            model or run.drafter, run.target, rows, feats, argmax, run.cfg, run.backend, g, autocast
        )
        out.loss.loss.backward()
        run.drafter.zero_grad(set_to_none=True)
        validate(run, source, max_rows=1)


# --------------------------------------------------------------------------------------------------
# The loop


def loop(
    run: Run,
    session: Session,
    source: FeatureSource,
    *,
    console: Any,
    stop_after: int | None = None,
    stop: StopRequest | None = None,
) -> TrainResult:
    """Optimizer steps from the session's step to the run's last (or to ``stop_after``, or to the step under
    way when SIGTERM or SIGINT comes: `stopping`): log, validate and keep the best, checkpoint, as the
    config's cadence says, and always at the step the loop stops after. ``stop``: a request that a signal
    sets elsewhere (a fan-out's main thread holds the handlers for its drafter threads); without it the
    loop holds them itself."""
    every, s = run.cfg.train, session  # how often to log, validate and save
    batches = run.stream.from_cursor(s.cursor)
    losses: list[float] = []
    window: dict[str, Tensor] | None = None  # acceptance of the training blocks since the last record
    last_val: dict[str, Any] = {}
    t0 = time.perf_counter()
    signals = nullcontext(stop) if stop is not None else stop_on_signals()
    with TrainProgress(run.total_steps, s.step, console) as progress, signals as request:
        while s.step < run.total_steps:
            loss, stats = accumulate(run, s, source, batches)
            if not math.isfinite(loss):  # before the optimizer applies it: weights stay as they were
                raise NonFiniteLossError(
                    f"the loss became {loss} at step {s.step + 1}; that step was not applied (the checkpoints "
                    "are as they were): check the data, or train a new run with a lower train.lr (a resume "
                    "keeps the run's optimizer settings)"
                )
            grad_norm = optimizer_step(run, s)
            losses.append(loss)
            window = add_stats(window, stats)
            record: dict[str, Any] | None = None
            if s.step % every.log_every == 0 or s.step == run.total_steps:
                record = training_record(run, s, loss, grad_norm, window, time.perf_counter() - t0)
                window = None
            if s.step % every.eval_every == 0 or s.step == run.total_steps:
                last_val = validate(run, source, on_row=progress.evaluating)  # the same on every rank
                progress.evaluated()
                record = (record or {"step": s.step}) | {"val": last_val}
                if best_metric(last_val, run.cfg) > s.best:  # chosen by what serving will measure
                    s.best = best_metric(last_val, run.cfg)
                    save_best(run, s.step, last_val)
            if record is not None:
                s.metrics.log(record)
            stopping = stop_requested(request, run.dist) or (stop_after is not None and s.step >= stop_after)
            if s.step % every.save_every == 0 or s.step == run.total_steps or stopping:
                extra = {
                    BEST_KEY: s.best,
                    "world_size": run.dist.world_size,
                    "global_batch": global_batch(run),
                }
                save_checkpoint(run, s.optimizer, s.scheduler, s.step, s.cursor, s.generator, extra)
            progress.update(s.step, loss, record, s.best)
            if stopping:
                break
    s.metrics.close()
    return TrainResult(
        s.step, time.perf_counter() - t0, s.best, last_val, run.out_dir, losses, stopped_by=request.name
    )


def accumulate(
    run: Run, s: Session, source: FeatureSource, batches: Iterator[MicroBatch]
) -> tuple[float, dict[str, Tensor]]:
    """One optimizer step's gradients: train.grad_accum micro-batches of the stream, forward and backward.
    Returns the step's loss (of the global batch, on every rank) and the acceptance stats of its blocks."""
    d, accum = run.dist, run.cfg.train.grad_accum
    autocast = autocast_context(run.cfg, run.device)
    s.optimizer.zero_grad(set_to_none=True)
    loss, stats = 0.0, None
    for j in range(accum):
        mb = next(batches)  # this rank's share of the next global micro-batch
        rows = run.train_rows.take(mb.rows, run.device)
        feats, argmax = source.batch(mb, rows)
        with distributed.gradient_sync(s.model, d, sync=j == accum - 1):
            out = block_step(
                s.model,
                run.target,
                rows,
                feats,
                argmax,
                run.cfg,
                run.backend,
                s.generator,
                autocast,
                seeds=mb.seeds,
            )
            scaled, share = distributed.global_loss(
                out.loss.weighted_sum, out.loss.weight_sum, out.loss.loss, d
            )
            (scaled / accum).backward()
        loss += share / accum
        stats = add_stats(stats, {k: v.cpu() for k, v in out.stats.items()})
        s.cursor = mb.cursor_after
    (loss,) = distributed.sum_over_ranks([loss], d)
    assert stats is not None
    return loss, stats


def optimizer_step(run: Run, s: Session) -> float:
    """Clip the gradients, step the optimizer and the schedule; returns the gradient norm."""
    norm = distributed.grad_norm_value(torch.nn.utils.clip_grad_norm_(s.params, run.cfg.train.grad_clip))
    s.optimizer.step()
    s.scheduler.step()
    s.step += 1
    return norm


def training_record(
    run: Run, s: Session, loss: float, grad_norm: float, window: dict[str, Tensor], seconds: float
) -> dict[str, Any]:
    """The metrics.jsonl record of a logged step (acceptance over the training blocks since the last)."""
    m = finalize_stats(distributed.reduce_stats(window, run.dist))
    return {
        "step": s.step,
        "loss": loss,
        "lr": s.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "acceptance_length": m.get("acceptance_length"),
        "per_position_accuracy": m.get("per_position_accuracy"),
        "seconds": round(seconds, 2),
    }

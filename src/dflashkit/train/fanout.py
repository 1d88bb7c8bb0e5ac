"""Fan-out training: target workers and several drafter variants trained at the same time, as threads of
one process.

The 8-GPU fan-out topology (the target on some GPUs, drafter variants on the others): the target's forward
is the expensive part, so a sweep of K drafters (block sizes, layer counts, learning rates) should cost
about one target pass per batch, not K; and when one target device cannot keep up, W target workers on W
devices share the passes. Read top to bottom:

- `placement` and `variant_configs`: each variant is the base config plus its dotted overrides (the
  config's ``fanout`` section); its run folder is run.out_dir/<name>, its device one of `placement`'s.
  The target workers' devices are ``fanout.target_device`` (one) or ``fanout.target_devices`` (several).
- `check_run_folders`: the run folder rules of `dflashkit train` for every variant, before the target
  loads; with ``resume``, each variant's checkpoint to continue from.
- `setup_fanout`: the target is loaded once per target device (`load_replicas`) and the rows are packed
  once; each variant gets an ordinary training run (`setup.setup_run`) that shares the copy on its device,
  or else sees the first copy through a `TargetView` (its own copies of the frozen embedding and lm_head
  there), and all of them share one micro-batch stream (`data.stream`).
- `share_validation_features`: one target pass per held-out row, handed to every drafter.
- `warm_up`: before any thread starts, every flex attention shape of every drafter on every device,
  forward and backward, is compiled serially under runtime.compile.COMPILE_LOCK (`trainer.warm_up`);
  then the drafters train inside `frozen_compiles()`: any later compile is an error naming shape and
  device.
- `feed_drafters` (the target workers, one thread each): together they walk the stream the drafters'
  training loops walk; worker i runs the target once for every W-th micro-batch (k = i mod W, counting
  from the first one needed), waits for its turn (`Turns`), and puts the features into the bounded queue
  of every drafter that still needs them (`Feed`): each drafter gets them in stream order, whatever W.
- the drafter threads run the trainer's own `start` and `loop`, their features from the feed
  (`sources.FedFeatures`). A drafter that raises stops alone: its error is recorded (the traceback in
  <name>/error.txt), its checkpoints stay as they were, the target stops feeding it and the others go
  on. A target worker that raises stops the fan-out: every drafter stops with its checkpoints kept, and
  the first worker's error is raised.
- `train_fanout` ends with a table comparing the variants, also written to run.out_dir/fanout.json.

A fan-out runs at the pace of its slowest drafter: the target puts each batch into every queue, and a
queue holds at most ``fanout.queue_depth`` batches; each target worker holds at most one more, computed
and waiting for its turn.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import Tensor
from torch._dynamo.utils import counters

from dflashkit.atomic import write_json
from dflashkit.attention import flex
from dflashkit.config import FanoutSection, RunConfig, apply_overrides, dump_config
from dflashkit.data.rows import Rows, pack_dataset
from dflashkit.data.stream import MicroBatchStream
from dflashkit.errors import ConfigError, DflashkitError
from dflashkit.lock import hold_folder
from dflashkit.model.acceptance import served_tau
from dflashkit.runtime import fingerprint
from dflashkit.runtime.compile import COMPILE_LOCK, check_not_frozen, frozen_compiles
from dflashkit.runtime.compile_cache import portable_cache
from dflashkit.runtime.devices import on_device, parse_device, resolve_device, target_dtype
from dflashkit.target.hf import TargetModel
from dflashkit.train import distributed, trainer
from dflashkit.train.checkpoints import BEST, BEST_METRICS, ResumePoint, check_env_drift, find_resume_point
from dflashkit.train.plan import dry_run
from dflashkit.train.rundir import RUN_FILES, claim_run_folder
from dflashkit.train.setup import Run, setup_run, with_init_shape
from dflashkit.train.sources import (
    CachedFeatures,
    CapturedFeatures,
    FedFeatures,
    KeptFeatures,
    OnlineFeatures,
    feature_columns,
    feature_layers,
    feature_source,
    feature_source_for,
)
from dflashkit.train.stopping import StopRequest, stop_on_signals
from dflashkit.train.trainer import TrainResult

SUMMARY_FILE = "fanout.json"
ERROR_FILE = "error.txt"
SUMMARY_COLUMNS = (
    "variant",
    "device",
    "status",
    "steps",
    "final loss",
    "val tau (served order)",
    "best tau",
    "steps/s",
    "error",
)
POLL_S = 0.05  # how often a waiting queue call looks at the stop flag


class FanoutStopped(DflashkitError):
    """The fan-out stopped (a target worker failed, or it was interrupted) before this drafter finished."""


# --------------------------------------------------------------------------------------------------
# Placement and variants


def _section(cfg: RunConfig) -> FanoutSection:
    if cfg.fanout is None:
        raise ConfigError(
            "this config has no fanout section; add one (see configs/fanout.yaml) or train one drafter "
            "with `dflashkit train`"
        )
    return cfg.fanout


def target_devices(cfg: RunConfig) -> list[torch.device]:
    """One device per target worker: ``fanout.target_devices``, or the one of ``fanout.target_device``
    (auto: run.device when that is set, else cuda:0, or the CPU). The config has checked that no GPU
    repeats (the CPU may: workers there share one copy of the target)."""
    fc = _section(cfg)
    if fc.target_devices is not None:
        return [parse_device(d, f"fanout.target_devices[{i}]") for i, d in enumerate(fc.target_devices)]
    want = fc.target_device if fc.target_device != "auto" else cfg.run.device
    if want == "auto":
        want = "cuda:0" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    return [parse_device(want, "fanout.target_device")]


def placement(cfg: RunConfig) -> tuple[list[torch.device], list[torch.device]]:
    """(the target workers' devices, one device per variant). A variant's ``auto`` device is one of the
    GPUs without a target worker, in turn, or else the last target worker's device."""
    fc = _section(cfg)
    targets = target_devices(cfg)
    gpus = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if targets[0].type == "cuda"
        else []
    )
    pool = [g for g in gpus if g not in targets] or [targets[-1]]
    devices: list[torch.device] = []
    auto = 0
    for v in fc.variants:
        if v.device == "auto":
            devices.append(pool[auto % len(pool)])
            auto += 1
        else:
            devices.append(parse_device(v.device, f"fanout variant {v.name} device"))
    return targets, devices


def variant_configs(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """(name, config) of every variant: the base config (without its fanout section) plus the variant's
    overrides, with run.out_dir = <base run.out_dir>/<name> and run.device = its device; a variant that
    starts from drafter.init takes that drafter's shape where it sets none (`with_init_shape`), so that its
    run folder, a resume and a dry run all see the shape it trains."""
    fc = _section(cfg)
    _, devices = placement(cfg)
    base = cfg.model_copy(update={"fanout": None})
    out = Path(cfg.run.out_dir)
    configs = []
    for v, dev in zip(fc.variants, devices, strict=True):
        where = f"fanout variant {v.name}"
        own = {**v.overrides, "run.out_dir": str(out / v.name), "run.device": str(dev)}
        configs.append((v.name, with_init_shape(apply_overrides(base, own, where))))
    return configs


# --------------------------------------------------------------------------------------------------
# The target as a drafter on another device sees it


class TargetView:
    """The shared target as seen from another device: copies of its frozen embedding and lm_head live
    there (what a training step needs); everything else (config, identity, features) is the target's
    own, computed on its device and moved here."""

    def __init__(self, target: TargetModel, device: torch.device):
        self.target = target
        self.device = torch.device(device)
        pair = (target.model.get_input_embeddings(), target.model.get_output_embeddings())
        embedding, head = copy.deepcopy(pair)  # one deepcopy, so that tied weights stay tied
        self._embedding = embedding.to(self.device)
        self._head = head.to(self.device)
        self._norm = copy.deepcopy(target.decoder.norm).to(self.device)

    def __getattr__(self, name: str) -> Any:  # config, identity(), hidden_size, dtype, ...: the target's
        if name == "target":
            raise AttributeError(name)
        return getattr(self.target, name)

    def embed(self, ids: Tensor) -> Tensor:
        return self._embedding(ids)

    def final_norm(self, h: Tensor) -> Tensor:
        return self._norm(h)

    def embed_weight(self) -> Tensor:
        return self._embedding.weight

    def lm_head(self, h: Tensor) -> Tensor:
        return self._head(h.to(self._head.weight.dtype))

    def lm_head_weight(self) -> Tensor:
        return self._head.weight

    def features(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, layer_ids: Any = None, **kw: Any
    ):
        there = self.target.device
        moved = {k: v.to(there) if isinstance(v, Tensor) else v for k, v in kw.items()}
        mask = attention_mask.to(there) if attention_mask is not None else None
        feats, labels = self.target.features(input_ids.to(there), mask, layer_ids, **moved)
        return feats.to(self.device), labels.to(self.device) if labels is not None else None


# --------------------------------------------------------------------------------------------------
# The micro-batch stream and the feeds


@dataclass
class Batch:
    """Micro-batch n of the stream: the target's features (of the union of the drafters' layers) and argmax
    labels for its rows, on the device of the target worker that computed them."""

    n: int
    features: Tensor
    argmax: Tensor


class Feed:
    """The bounded queue from the target workers to one drafter: micro-batches [start, end) of the stream,
    in stream order.

    The target workers call `wants` and `put` (one at a time, in turn); the drafter's training loop takes
    them through its `sources.FedFeatures` (`next`, `select`), and `close` when it ends."""

    def __init__(
        self, name: str, start: int, end: int, depth: int, columns: Tensor | None, stop: threading.Event
    ):
        self.name = name
        self.start, self.end = start, end
        self.columns = columns
        self.stop = stop
        self.queue: queue.Queue[Batch] = queue.Queue(maxsize=depth)
        self.closed = threading.Event()
        self.taken = 0  # micro-batches the drafter has taken
        self._columns_on: dict[torch.device, Tensor] = {}  # the columns on each target worker's device

    def wants(self, n: int) -> bool:
        return self.start <= n < self.end and not self.closed.is_set()

    def put(self, batch: Batch) -> bool:
        """Wait for room; False when the drafter ended or the fan-out stopped meanwhile."""
        while not (self.closed.is_set() or self.stop.is_set()):
            try:
                self.queue.put(batch, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Batch:
        """The next micro-batch (waits for the target); FanoutStopped when the fan-out stopped."""
        while True:
            if self.stop.is_set():
                raise FanoutStopped(f"drafter {self.name}: the fan-out stopped before it finished")
            try:
                batch = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self.taken += 1
            return batch

    def select(self, features: Tensor) -> Tensor:
        """This drafter's layers of features of the union of layers (on the device they are on)."""
        if self.columns is None:
            return features
        columns = self._columns_on.get(features.device)
        if columns is None:
            columns = self._columns_on[features.device] = self.columns.to(features.device)
        return features.index_select(-1, columns)

    def close(self) -> None:
        """Take no more: the target skips this drafter from now on (queued batches are dropped)."""
        self.closed.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()


# --------------------------------------------------------------------------------------------------
# Setup


@dataclass
class DrafterWorker:
    """One variant: its run, its feed and the features it trains on, and how its thread went."""

    name: str
    run: Run
    feed: Feed
    source: FedFeatures  # training micro-batches from the feed, held-out rows computed once for all
    resume_from: ResumePoint | None  # the checkpoint it continues from
    start_step: int
    status: str = "waiting"  # waiting -> training -> done | failed | stopped
    error: str | None = None
    result: TrainResult | None = None
    seconds: float = 0.0
    thread: threading.Thread | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps done (the step that raised, for a failed drafter, does not count)."""
        if self.result is not None:
            return self.result.steps
        taken = self.feed.taken - (1 if self.status == "failed" and self.feed.taken else 0)
        return self.start_step + taken // self.run.cfg.train.grad_accum


@dataclass
class TargetWorker:
    """One target worker: the target copy on its device and the features it computes there (of the union
    of the drafters' layer ids: online, cached per row with ``train.cache_features``, or read from a
    capture), and what it has computed: training micro-batches and their seconds."""

    index: int
    device: torch.device
    source: OnlineFeatures | CapturedFeatures
    batches: int = 0
    seconds: float = 0.0  # busy: the target passes themselves, not the waits for a turn or a queue
    error: BaseException | None = None  # what stopped it, when it raised


@dataclass
class Fanout:
    cfg: RunConfig  # the base config, with its fanout section
    stream: MicroBatchStream  # the one stream the target workers compute and the drafters train on
    train_rows: Rows
    val_rows: Rows
    layer_ids: list[int]  # the union of the drafters' target layers, what the target workers compute
    targets: list[TargetWorker]  # worker 0 also computes the validation features
    workers: list[DrafterWorker]
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def target_batches(self) -> int:
        """Training micro-batches the target workers have computed, together."""
        return sum(t.batches for t in self.targets)

    @property
    def target_seconds(self) -> float:
        """Their busy seconds, summed over the workers."""
        return sum(t.seconds for t in self.targets)


def load_replicas(cfg: RunConfig, devices: list[torch.device]) -> dict[torch.device, TargetModel]:
    """The target, loaded once per device (workers on one device, the CPU, share its copy)."""
    replicas: dict[torch.device, TargetModel] = {}
    for d in devices:
        if d not in replicas:
            replicas[d] = TargetModel.load(cfg.target.path, dtype=target_dtype(cfg, d), device=d)
    return replicas


def setup_fanout(cfg: RunConfig, resume_from: dict[str, ResumePoint | None] | None = None) -> Fanout:
    """Load the target once per target device, pack the rows once, and set up every variant's run around
    them (on the variant's device: the copy there, or a view of the first copy), all on one stream.
    ``resume_from``: each variant's checkpoint to continue from (`check_run_folders`)."""
    fc = _section(cfg)
    if distributed.launched_by_torchrun():
        raise ConfigError(
            "a fan-out runs in one process (its drafters are threads); start it without torchrun"
        )
    devices, _ = placement(cfg)
    variants = variant_configs(cfg)
    replicas = load_replicas(cfg, devices)
    first = replicas[devices[0]]
    rows = pack_dataset(cfg, first.config)  # the shared data keys give every variant the same rows
    seen: dict[torch.device, Any] = dict(replicas)
    runs: list[Run] = []
    for _, vcfg in variants:
        device = resolve_device(vcfg)
        if device not in seen:
            seen[device] = TargetView(first, device)
        runs.append(setup_run(vcfg, target=seen[device], rows=rows))
    # One stream, of the keys every variant shares (rows, train.batch_size, train.seed): what the target
    # workers compute is what each drafter's loop trains on.
    stream = MicroBatchStream(len(rows[0]), cfg.train.batch_size, cfg.train.seed)
    for run in runs:
        run.stream = stream
    union = sorted(set().union(*(feature_layers(r.cfg, r.drafter.config) for r in runs)))
    store = runs[0].store
    targets = [
        TargetWorker(i, d, feature_source_for(cfg, replicas[d], union, store)) for i, d in enumerate(devices)
    ]
    stop = threading.Event()
    workers = []
    for (name, _), run in zip(variants, runs, strict=True):
        point = (resume_from or {}).get(name)
        step = point.saved.progress["step"] if point is not None else 0
        start = stream.position(point.saved.progress["data_cursor"] if point is not None else None)
        end = start + max(run.total_steps - step, 0) * run.cfg.train.grad_accum
        columns = feature_columns(union, feature_layers(run.cfg, run.drafter.config), first.hidden_size)
        feed = Feed(name, start, end, fc.queue_depth, columns, stop)
        held_out = feature_source(run) if store is not None else KeptFeatures()
        workers.append(DrafterWorker(name, run, feed, FedFeatures(feed, held_out), point, step))
    return Fanout(cfg, stream, *rows, union, targets, workers, stop)


def share_validation_features(fanout: Fanout) -> None:
    """One target pass per held-out row (on target worker 0); every drafter gets its layers of it, on its
    device, so that evaluation never runs the target again. A capture's drafters read it themselves."""
    tw = fanout.targets[0]
    if isinstance(tw.source, CapturedFeatures):
        return
    for i in range(len(fanout.val_rows)):
        rows = fanout.val_rows.take([i], tw.device)
        feats, argmax = tw.source.features("validation", [i], rows)
        for w in fanout.workers:
            assert isinstance(w.source.held_out, KeptFeatures)
            w.source.held_out.keep(
                "validation", i, w.feed.select(feats[0]).to(w.run.device), argmax[0].to(w.run.device)
            )
    if isinstance(tw.source, CachedFeatures):
        tw.source.kept.clear()  # held-out rows: computed once, handed over


def compiled_graph_count() -> int:
    """Dynamo graphs compiled in this process so far (a compile after warm-up shows here)."""
    return int(counters["stats"]["unique_graphs"])


def warm_up(fanout: Fanout, console: Any = None) -> float:
    """Compile every shape of every drafter on its device (flex attention, and the compiled layer and
    loss-chunk regions where train.compile is on; a training micro-batch forward and backward, an
    evaluation row), serially under COMPILE_LOCK, before compiles are frozen. Returns the seconds.
    Must run before any drafter thread starts. A drafter whose warm-up raises (e.g. out of memory on
    its device) is marked failed and will not start; the others are warmed."""
    warmed = [w for w in fanout.workers if w.run.backend == "flex"]
    if not warmed:
        return 0.0
    t0 = time.perf_counter()
    with COMPILE_LOCK:
        check_not_frozen("the fan-out's warm-up")
        # Flex attention outside a region: each drafter adds at most a training and an evaluation graph per
        # layer type (full, sliding). (Inside a region it is part of the region's graph and limit.)
        limit = flex.compiled_graphs() + 4 * len(warmed) + 2
        if limit > flex.recompile_limit():
            flex.set_recompile_limit(limit)
        for w in warmed:
            try:
                with on_device(w.run.device):  # the drafter's own features here: the feed is not running
                    trainer.warm_up(w.run, feature_source(w.run))
            except Exception as e:
                _record_failure(w, e, "during warm-up", console)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# The target workers and the drafter threads


class Turns:
    """Whose turn it is to hand a micro-batch to the feeds: micro-batch n goes in only after n - 1 went
    in (or was skipped), so that every drafter gets the stream in order, whichever worker computed it."""

    def __init__(self, first: int, give_up: Callable[[], bool]):
        self.next = first
        self.give_up = give_up  # the fan-out stopped, or no drafter needs anything more
        self._cond = threading.Condition()

    def wait(self, n: int) -> bool:
        """Wait until n is next; False when giving up meanwhile (checked every POLL_S)."""
        with self._cond:
            while self.next != n:
                if self.give_up():
                    return False
                self._cond.wait(POLL_S)
        return True

    def advance(self, n: int) -> None:
        """n went into the feeds (or nobody wanted it): n + 1 is next."""
        with self._cond:
            self.next = n + 1
            self._cond.notify_all()


def _finished(fanout: Fanout) -> bool:
    return fanout.stop.is_set() or all(w.feed.closed.is_set() for w in fanout.workers)


def compute_batch(fanout: Fanout, tw: TargetWorker, n: int) -> Batch:
    """Micro-batch n of the stream on worker tw: one target pass (counted in tw.batches, tw.seconds)."""
    t0 = time.perf_counter()
    mb = fanout.stream.at(n)
    feats, argmax = tw.source.batch(mb, fanout.train_rows.take(mb.rows, tw.device))
    if tw.device.type == "cuda":
        torch.cuda.synchronize(tw.device)  # the features are whole before a drafter copies them
    tw.seconds += time.perf_counter() - t0
    tw.batches += 1
    return Batch(n, feats, argmax)


def run_target_worker(fanout: Fanout, tw: TargetWorker, share: range, turns: Turns) -> None:
    """A target worker: each micro-batch of its share that some drafter still needs, computed, then in
    its turn put into every feed that still wants it."""
    feeds = [w.feed for w in fanout.workers]
    with on_device(tw.device):
        for n in share:
            if _finished(fanout):
                break
            batch = compute_batch(fanout, tw, n) if any(f.wants(n) for f in feeds) else None
            if not turns.wait(n):
                break
            if batch is not None:
                for f in feeds:
                    if f.wants(n):
                        f.put(batch)
            turns.advance(n)


def feed_drafters(fanout: Fanout, on_batch: Callable[[], None] | None = None) -> dict[str, float]:
    """The target workers, one thread each, over the micro-batches some drafter still needs: worker i of
    W takes every W-th one from the i-th on. This thread waits for them, calling ``on_batch`` now and then
    (the progress display). The first worker that raises stops the fan-out, and its error is raised here
    once every worker has ended (so is an interruption of this thread). Returns the workers' batches and
    busy seconds together, as {"batches", "seconds"} (each worker's are in fanout.targets)."""
    feeds = [w.feed for w in fanout.workers]
    first = min((f.start for f in feeds if f.start < f.end), default=0)
    needed = range(first, max((f.end for f in feeds), default=0))  # numbers of the stream's micro-batches
    turns = Turns(first, lambda: _finished(fanout))
    failed: list[TargetWorker] = []
    lock = threading.Lock()

    def work(tw: TargetWorker) -> None:
        try:
            run_target_worker(fanout, tw, needed[tw.index :: len(fanout.targets)], turns)
        except BaseException as e:  # handed to the calling thread, which raises it
            with lock:
                tw.error = e
                failed.append(tw)
            fanout.stop.set()

    threads = [
        threading.Thread(target=work, args=(tw,), name=f"target-{tw.index}", daemon=True)
        for tw in fanout.targets
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(POLL_S * 5)
                if on_batch is not None:
                    on_batch()
    except BaseException:  # interrupted: every worker stops at its next check
        fanout.stop.set()
        for t in threads:
            t.join()
        raise
    if failed:
        raise failed[0].error  # type: ignore[misc]
    return {"batches": fanout.target_batches, "seconds": fanout.target_seconds}


def _silent_console() -> Any:
    return Console(file=io.StringIO(), quiet=True)  # no live display per thread: the fan-out shows one


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def train_drafter(
    w: DrafterWorker, *, stop_after: int | None, console: Any, stop: StopRequest | None = None
) -> None:
    """A drafter thread: the trainer's `start` and `loop` on the worker's run, features from its feed.
    Never raises: the outcome goes into the worker (status, error, result), the traceback of a failure
    into error.txt. ``stop``: set by a signal to the process (the main thread's handlers): the drafter
    ends its step, checkpoints it and stops."""
    t0 = time.perf_counter()
    w.status = "training"
    try:
        with on_device(w.run.device):
            quiet = _silent_console()
            session = trainer.start(w.run, w.resume_from, quiet)
            w.result = trainer.loop(w.run, session, w.source, console=quiet, stop_after=stop_after, stop=stop)
        stopped_by = w.result.stopped_by
        w.status = "stopped" if stopped_by else "done"
        if stopped_by:
            w.error = f"{stopped_by} after step {w.result.steps}, checkpointed: --resume continues"
    except FanoutStopped as e:
        w.status, w.error = "stopped", str(e)
    except Exception as e:  # recorded, not raised: the other drafters go on
        _record_failure(w, e, f"after {w.steps} steps", console)
    finally:
        w.feed.close()
        w.seconds = time.perf_counter() - t0


def _record_failure(w: DrafterWorker, e: Exception, when: str, console: Any) -> None:
    """Mark a drafter failed (the traceback into <its folder>/error.txt); the target stops feeding it."""
    w.status = "failed"
    w.error = f"{type(e).__name__}: {_first_line(e)}"
    w.run.out_dir.mkdir(parents=True, exist_ok=True)
    (w.run.out_dir / ERROR_FILE).write_text(traceback.format_exc())
    w.feed.close()
    if console is not None:
        console.print(
            f"[red]drafter {w.name} failed[/] {when}: {w.error}; its checkpoints are kept, the others go on"
        )


# --------------------------------------------------------------------------------------------------
# The run and its summary


@dataclass
class DrafterSummary:
    name: str
    device: str
    backend: str
    status: str
    steps: int
    total_steps: int
    micro_batches: int  # taken from the feed in this session
    final_loss: float | None
    val_served_acceptance_length: float | None  # the last evaluation's served-order acceptance length
    best_served_acceptance_length: float | None  # the best of them (what best/ holds)
    steps_per_s: float
    seconds: float
    error: str | None
    out_dir: str


@dataclass
class TargetWorkerSummary:
    device: str
    batches: int  # training micro-batches it computed
    seconds: float  # busy in target passes
    utilisation: float  # busy seconds / training seconds


@dataclass
class FanoutResult:
    out_dir: Path
    target_workers: list[TargetWorkerSummary]
    target_batches: int  # target passes over training micro-batches (once each, whatever K is), all workers
    target_seconds: float  # their busy seconds, summed over the workers
    warmup_seconds: float
    compiles_after_warmup: int
    training_seconds: float  # from the drafter threads' start to the last one's end
    seconds: float  # the whole run, setup included
    drafters: list[DrafterSummary]
    results: dict[str, TrainResult]  # the drafters that finished: per-step losses, final validation

    @property
    def ok(self) -> bool:
        return all(d.status == "done" for d in self.drafters)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize_target_worker(tw: TargetWorker, training_seconds: float) -> TargetWorkerSummary:
    busy = round(tw.seconds / training_seconds, 3) if training_seconds > 0 else 0.0
    return TargetWorkerSummary(str(tw.device), tw.batches, round(tw.seconds, 2), busy)


def summarize_drafter(w: DrafterWorker) -> DrafterSummary:
    """What the summary table shows for one drafter, from its thread and its metrics.jsonl."""
    path = w.run.out_dir / "metrics.jsonl"
    log = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
    losses = [r["loss"] for r in log if r.get("loss") is not None]
    vals = [r["val"] for r in log if "val" in r]
    best_file = w.run.out_dir / BEST / BEST_METRICS
    best = served_tau(json.loads(best_file.read_text())) if best_file.is_file() else None
    if w.result is not None:
        best = w.result.best_served_acceptance_length
    steps = w.steps
    return DrafterSummary(
        name=w.name,
        device=str(w.run.device),
        backend=w.run.backend,
        status=w.status,
        steps=steps,
        total_steps=w.run.total_steps,
        micro_batches=w.feed.taken,
        final_loss=_finite(w.result.losses[-1] if w.result and w.result.losses else (losses or [None])[-1]),
        val_served_acceptance_length=_finite(served_tau(vals[-1])) if vals else None,
        best_served_acceptance_length=_finite(best),
        steps_per_s=round((steps - w.start_step) / w.seconds, 3) if w.seconds > 0 else 0.0,
        seconds=round(w.seconds, 2),
        error=w.error,
        out_dir=str(w.run.out_dir),
    )


def train_fanout(
    cfg: RunConfig,
    *,
    resume: bool = False,
    console: Any = None,
    stop_after: int | None = None,
    move_aside: bool = False,
) -> FanoutResult:
    """Train every variant of the config's fanout section at once from one target (see the module
    docstring). ``stop_after`` ends each drafter after that many steps, leaving checkpoints for ``resume``."""
    t_start = time.perf_counter()
    resume_from = check_run_folders(cfg, resume=resume, move_aside=move_aside, console=console)
    fanout = setup_fanout(cfg, resume_from)
    return train_all(fanout, console=console, stop_after=stop_after, t_start=t_start)


def check_run_folders(
    cfg: RunConfig, *, resume: bool, move_aside: bool, console: Any
) -> dict[str, ResumePoint | None]:
    """The run folder rules of `dflashkit train` for a whole fan-out, before the target loads: without
    ``resume`` an earlier fan-out in run.out_dir is refused (or moved aside, every variant's folder with it);
    with it, each variant continues from its newest intact checkpoint, which must have been trained with
    the variant's settings in this environment. Returns each variant's checkpoint to continue from."""
    console = console if console is not None else Console(quiet=True)
    variants = variant_configs(cfg)
    hold_folder(
        cfg.run.out_dir
    )  # one writer for the whole fan-out, until the command ends (`dflashkit.lock`)
    if not resume:
        names = [*RUN_FILES, *(name for name, _ in variants)]
        claim_run_folder(
            Path(cfg.run.out_dir),
            move_aside=move_aside,
            report=console.print,
            names=names,
            what="a fan-out run",
        )
        return {name: None for name, _ in variants}
    here = distributed.single_process(torch.device("cpu"))  # one process: it may set damaged ones aside
    points = {}
    for name, vcfg in variants:
        points[name] = point = find_resume_point(vcfg, here, _Named(name, console))
        if point is not None:
            check_env_drift(point.checkpoint, vcfg.run.allow_env_drift, console)
    return points


class _Named:
    """A console whose lines name the variant they are about."""

    def __init__(self, name: str, console: Any):
        self.name, self.console = name, console

    def print(self, text: str) -> None:
        self.console.print(f"{self.name}: {text}")


def train_all(
    fanout: Fanout,
    *,
    console: Any = None,
    stop_after: int | None = None,
    t_start: float | None = None,
) -> FanoutResult:
    """Share the validation features, warm up, then train every drafter of a set-up fan-out in its
    thread while the target workers feed them; write and show the summary."""
    console = console or Console()
    t_start = time.perf_counter() if t_start is None else t_start
    cfg = fanout.cfg
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    fingerprint.save(fingerprint.collect(), out / fingerprint.FINGERPRINT_FILE)
    show_plan(fanout, console)
    share_validation_features(fanout)
    with portable_cache(cfg.run.compile_cache, console):
        warm_s = warm_up(fanout, console)
    graphs = compiled_graph_count()
    t_train = time.perf_counter()
    failure: BaseException | None = None
    # from here until every thread has ended nothing compiles, and a first SIGTERM or SIGINT ends each
    # drafter's step under way with a checkpoint (a second one stops everything at once, as an error would)
    with frozen_compiles(), stop_on_signals() as stop:
        for w in fanout.workers:
            if w.status == "failed":  # its warm-up failed
                continue
            w.thread = threading.Thread(
                target=train_drafter,
                args=(w,),
                kwargs={"stop_after": stop_after, "console": console, "stop": stop},
                name=f"drafter-{w.name}",
                daemon=True,
            )
            w.thread.start()
        with _Progress(fanout, console) as progress:
            try:
                feed_drafters(fanout, on_batch=progress.update)
                for w in fanout.workers:
                    while w.thread is not None and w.thread.is_alive():
                        w.thread.join(0.5)
                        progress.update()
            except BaseException as e:  # a target worker failed, or Ctrl-C: every drafter stops
                failure = e
                fanout.stop.set()
                for w in fanout.workers:
                    if w.thread is not None:
                        w.thread.join()
    training_s = time.perf_counter() - t_train
    result = FanoutResult(
        out_dir=out,
        target_workers=[summarize_target_worker(tw, training_s) for tw in fanout.targets],
        target_batches=fanout.target_batches,
        target_seconds=round(fanout.target_seconds, 2),
        warmup_seconds=round(warm_s, 2),
        compiles_after_warmup=compiled_graph_count() - graphs,
        training_seconds=round(training_s, 2),
        seconds=round(time.perf_counter() - t_start, 2),
        drafters=[summarize_drafter(w) for w in fanout.workers],
        results={w.name: w.result for w in fanout.workers if w.result is not None},
    )
    write_summary(result)
    show_summary(result, console)
    if isinstance(failure, Exception) and not isinstance(failure, DflashkitError):
        raise DflashkitError(
            f"{_who_failed(fanout, failure)} failed ({type(failure).__name__}: {_first_line(failure)}); "
            "every drafter stopped with its checkpoints kept: fix the cause and continue with "
            "`dflashkit fanout --resume`"
        ) from failure
    if failure is not None:
        raise failure
    return result


def _who_failed(fanout: Fanout, failure: BaseException) -> str:
    if len(fanout.targets) == 1:
        return "the target worker"
    tw = next((t for t in fanout.targets if t.error is failure), None)
    return f"target worker {tw.index} (on {tw.device})" if tw is not None else "the fan-out"


def write_summary(result: FanoutResult) -> Path:
    data = {k: v for k, v in dataclasses.asdict(result).items() if k != "results"}
    data["out_dir"] = str(result.out_dir)
    path = result.out_dir / SUMMARY_FILE
    return write_json(path, data)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def show_plan(fanout: Fanout, console: Any) -> None:
    name = fanout.workers[0].run.target.name
    names = ", ".join(f"{w.name} on {w.run.device}" for w in fanout.workers)
    where = ", ".join(str(t.device) for t in fanout.targets)
    workers = f"{len(fanout.targets)} workers on " if len(fanout.targets) > 1 else ""
    console.print(
        f"fan-out: target {name} on {workers}{where} (layers {fanout.layer_ids}); "
        f"{len(fanout.workers)} drafters: {names}"
    )


def show_summary(result: FanoutResult, console: Any) -> None:
    table = Table(title=f"fan-out: {len(result.drafters)} drafters from one target ({result.out_dir})")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, overflow="fold")
    for d in result.drafters:
        color = {"done": "green", "failed": "red"}.get(d.status, "yellow")
        table.add_row(
            d.name,
            f"{d.device} ({d.backend})",
            f"[{color}]{d.status}[/]",
            f"{d.steps}/{d.total_steps}",
            _fmt(d.final_loss),
            _fmt(d.val_served_acceptance_length),
            _fmt(d.best_served_acceptance_length),
            _fmt(d.steps_per_s, ".2f"),
            d.error or "",
        )
    console.print(table)
    for t in result.target_workers if len(result.target_workers) > 1 else []:
        console.print(
            f"target worker on {t.device}: {t.batches} micro-batches, busy {t.seconds:.1f} s "
            f"({100 * t.utilisation:.0f}% of the training time)"
        )
    where = ", ".join(t.device for t in result.target_workers)
    busy = f"{result.target_seconds:.1f} s of target time"
    if len(result.target_workers) == 1:
        rate = result.target_batches / result.target_seconds if result.target_seconds > 0 else 0.0
        busy += f" ({rate:.2f}/s, {100 * result.target_workers[0].utilisation:.0f}% busy)"
    console.print(
        f"target on {where}: {result.target_batches} micro-batches of features in {busy}, once each for "
        f"all drafters; warm-up {result.warmup_seconds:.1f} s; compiles after warm-up: "
        f"{result.compiles_after_warmup}; wall {result.seconds:.1f} s"
    )


class _Progress:
    """One live line per drafter (steps done of its total), updated by the target worker's thread."""

    def __init__(self, fanout: Fanout, console: Any):
        self.fanout = fanout
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.tasks = {
            w.name: self.progress.add_task(w.name, total=w.run.total_steps, completed=w.start_step, info="")
            for w in fanout.workers
        }
        self.last_line = time.monotonic()

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.update()
        self.progress.__exit__(*exc)

    def update(self) -> None:
        for w in self.fanout.workers:
            info = "" if w.status in ("waiting", "training") else w.status
            self.progress.update(self.tasks[w.name], completed=w.steps, info=info)
        if not self.console.is_terminal and time.monotonic() - self.last_line > 30:
            self.last_line = time.monotonic()
            parts = [f"{w.name} {w.steps}/{w.run.total_steps} ({w.status})" for w in self.fanout.workers]
            self.console.print("fan-out: " + ", ".join(parts))


# --------------------------------------------------------------------------------------------------
# Dry run


def dry_run_fanout(
    cfg: RunConfig, console: Any, *, resume: bool = False, move_aside: bool = False
) -> dict[str, Any]:
    """Check every variant (config, data, target, drafter, attention memory, its run folder) without loading
    weights; show the placement. The run folders are checked as training would, and nothing is moved."""
    targets, devices = placement(cfg)
    variants = variant_configs(cfg)
    if not resume and not move_aside:  # raises, naming the choices, when an earlier fan-out is there
        names = [*RUN_FILES, *(name for name, _ in variants)]
        claim_run_folder(
            Path(cfg.run.out_dir), move_aside=False, report=console.print, names=names, what="a fan-out run"
        )
    plans = {}
    for (name, vcfg), dev in zip(variants, devices, strict=True):
        console.print(f"[bold]variant {name}[/] on {dev}")
        plans[name] = dry_run(vcfg, console, resume=resume, move_aside=move_aside)
    where = ", ".join(str(d) for d in targets)
    console.print(
        f"fan-out: target on {where} ({len(targets)} worker(s)); {len(plans)} drafters; "
        "every variant checks out"
    )
    return {"target_devices": [str(d) for d in targets], "variants": plans}

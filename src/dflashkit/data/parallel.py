"""Tokenizer work in parallel: rendering prompts with the chat template and encoding conversations cost
about a millisecond each in Python, so a dataset of a hundred thousand records spends minutes on one core.
`TokenizerPool.map` spreads such work over worker processes (each with its own copy of the tokenizer)
when there is enough of it, and runs it in-process otherwise.

Starting the workers: each worker loads its tokenizer, which imports transformers (and, with some
versions, torch: transformers 5.17's tokenizer module imports its GGUF loader, which imports torch), a few
seconds per worker. The tokenizer travels to a worker as pickled bytes and is loaded in the worker's
initializer: a process start writes its arguments through a pipe that the parent waits on, and a
tokenizer object there made the parent wait while each worker in turn imported what the tokenizer needs
(measured on this repository's 2-core CPU with transformers 5.17: 11 workers started one after the other
in 62 s, before the first prompt could be generated). `TokenizerPool.start` also starts every worker in a
background thread, so that their start overlaps the caller's own work (`prepare` loads the target
meanwhile)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MIN_PARALLEL = 2000  # fewer items than this run in-process (a worker pool takes seconds to start)
MAX_WORKERS = 16
START_TIMEOUT_S = 600.0  # a worker started by `start` waits at most this long for the others

_TOKENIZER: Any = None
_GATE: Any = None


def _init(tokenizer_bytes: bytes, gate: Any) -> None:
    """A worker's initializer: load the tokenizer here, in the worker (not while the parent writes the
    process's arguments: see the module's notes)."""
    global _TOKENIZER, _GATE
    _TOKENIZER = pickle.loads(tokenizer_bytes)
    _GATE = gate


def _arrive() -> int:
    """`start`'s task, one per worker: wait until every worker has loaded its tokenizer (so that each of
    these tasks holds its own worker, and each submission starts a new one)."""
    if _GATE is not None:
        try:
            _GATE.wait(START_TIMEOUT_S)
        except threading.BrokenBarrierError:  # closed, or a worker never came: start no more
            pass
    return os.getpid()


class _Apply:
    def __init__(self, fn: Callable[[Any, Any], Any]):
        self.fn = fn

    def __call__(self, item: Any) -> Any:
        return self.fn(_TOKENIZER, item)


class TokenizerPool:
    """`map(fn, items)` = [fn(tokenizer, item) for item in items], in worker processes when there are at
    least `min_items` items and more than one core. `fn` must be a module-level function.

    The workers start at the first such `map`, or earlier with `start()` (in the background).
    `ready_seconds`: from `start()` until every worker had loaded its tokenizer (None: not yet, or not
    started so); `wait_seconds`: how long `map` waited for `start()`'s thread to start the workers."""

    def __init__(self, tokenizer: Any, workers: int | None = None, min_items: int = MIN_PARALLEL):
        self.tokenizer = tokenizer
        self.workers = workers or min(MAX_WORKERS, len(os.sched_getaffinity(0)))
        self.min_items = min_items
        self.ready_seconds: float | None = None
        self.wait_seconds = 0.0
        self._executor: ProcessPoolExecutor | None = None
        self._starter: threading.Thread | None = None
        self._gate: Any = None
        self._closing = threading.Event()

    def _make_executor(self, gate: Any = None) -> ProcessPoolExecutor:
        # spawn: the parent may hold CUDA and tokenizer threads, which a fork must not inherit
        return ProcessPoolExecutor(
            self.workers,
            mp_context=get_context("spawn"),
            initializer=_init,
            initargs=(pickle.dumps(self.tokenizer), gate),
        )

    def start(self) -> None:
        """Start every worker now, from a background thread; the caller goes on at once (`map` waits for
        the workers to be started, when they are not yet; they load the tokenizer on their own). Nothing
        with one worker, or once the workers are up."""
        if self.workers < 2 or self._executor is not None:
            return
        self._closing.clear()
        try:  # every worker waits here in its first task, so that each submission starts a new worker
            self._gate = get_context("spawn").Barrier(self.workers)
        except OSError:  # no shared semaphores: the executor starts workers as it sees fit
            self._gate = None
        executor = self._executor = self._make_executor(self._gate)
        t0 = time.perf_counter()
        lock, arrived = threading.Lock(), [0]

        def on_arrival(f: Future[int]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            with lock:
                arrived[0] += 1
                if arrived[0] == self.workers:
                    self.ready_seconds = round(time.perf_counter() - t0, 3)

        def start_all() -> None:
            try:
                for _ in range(self.workers):
                    if self._closing.is_set():
                        return
                    executor.submit(_arrive).add_done_callback(on_arrival)  # none is idle: a new worker
            except Exception:  # a broken pool, or closed meanwhile: `map` reports what matters
                pass

        self._starter = threading.Thread(target=start_all, name="tokenizer-pool-start", daemon=True)
        self._starter.start()

    def _wait_started(self) -> None:
        if self._starter is not None:
            t0 = time.perf_counter()
            self._starter.join()
            self.wait_seconds += time.perf_counter() - t0
            self._starter = None

    def map(self, fn: Callable[[Any, T], R], items: Sequence[T]) -> list[R]:
        if len(items) < self.min_items or self.workers < 2:
            return [fn(self.tokenizer, x) for x in items]
        self._wait_started()
        if self._executor is None:
            self._executor = self._make_executor()
        chunk = max(16, len(items) // (4 * self.workers))
        return list(self._executor.map(_Apply(fn), items, chunksize=chunk))

    def stats(self) -> dict[str, Any]:
        """For a manifest: worker processes (0: all work ran in-process), `ready_seconds`, `wait_seconds`."""
        return {
            "workers": self.workers if self._executor is not None else 0,
            "ready_seconds": self.ready_seconds,
            "wait_seconds": round(self.wait_seconds, 3),
        }

    def close(self) -> None:
        self._closing.set()
        if self._gate is not None:
            self._gate.abort()  # workers waiting in `start`'s task return
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)
            self._executor = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

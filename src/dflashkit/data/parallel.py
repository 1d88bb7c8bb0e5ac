"""Tokenizer work in parallel: rendering prompts with the chat template and encoding conversations cost
about a millisecond each in Python, so a dataset of a hundred thousand records spends minutes on one core.
`TokenizerPool.map` spreads such work over worker processes (each with its own copy of the tokenizer)
when there is enough of it, and runs it in-process otherwise."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MIN_PARALLEL = 2000  # fewer items than this run in-process (a worker pool takes seconds to start)
MAX_WORKERS = 16

_TOKENIZER: Any = None


def _init(tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


class _Apply:
    def __init__(self, fn: Callable[[Any, Any], Any]):
        self.fn = fn

    def __call__(self, item: Any) -> Any:
        return self.fn(_TOKENIZER, item)


class TokenizerPool:
    """`map(fn, items)` = [fn(tokenizer, item) for item in items], in worker processes when there are at
    least `min_items` items and more than one core. `fn` must be a module-level function."""

    def __init__(self, tokenizer: Any, workers: int | None = None, min_items: int = MIN_PARALLEL):
        self.tokenizer = tokenizer
        self.workers = workers or min(MAX_WORKERS, len(os.sched_getaffinity(0)))
        self.min_items = min_items
        self._executor: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[[Any, T], R], items: Sequence[T]) -> list[R]:
        if len(items) < self.min_items or self.workers < 2:
            return [fn(self.tokenizer, x) for x in items]
        if self._executor is None:
            # spawn: the parent may hold CUDA and tokenizer threads, which a fork must not inherit
            self._executor = ProcessPoolExecutor(
                self.workers, mp_context=get_context("spawn"), initializer=_init, initargs=(self.tokenizer,)
            )
        chunk = max(16, len(items) // (4 * self.workers))
        return list(self._executor.map(_Apply(fn), items, chunksize=chunk))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)
            self._executor = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

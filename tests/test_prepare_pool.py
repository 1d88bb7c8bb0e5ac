"""`prepare`'s tokenizer pool: its workers start without the parent waiting for each worker to load the
tokenizer (which imports transformers, and with transformers 5.17 torch too: ~3 s a worker, one after
the other, was ~60 s of the GPU recipe's `generate` stage before the first prompt was generated)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from dflashkit.data.parallel import TokenizerPool

GATE = "DFLASHKIT_TEST_POOL_GATE"


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


# A worker that loads `_GatedTokenizer` imports this module first: like transformers (and torch), the
# import takes as long as the test wants it to, here until the gate file appears. (The test process
# imported it before a test set the variable; only a worker started meanwhile sees it.)
if os.environ.get(GATE):
    _wait_for(Path(os.environ[GATE]))


class _GatedTokenizer:
    """A stand-in tokenizer whose pickle is as large as a real one's (~1.5 MB: more than a pipe holds, so
    a parent that writes it into a starting process waits until the process has read it)."""

    def __init__(self, name: str, payload: bytes):
        self.name = name
        self.payload = payload


def _describe(tokenizer: Any, item: int) -> tuple[str, int, int]:
    return tokenizer.name, len(tokenizer.payload), item * item


def test_workers_start_while_none_can_load_the_tokenizer_yet(tmp_path: Path, monkeypatch: Any) -> None:
    """Both workers are started (the parent has handed each its arguments) while the gate keeps either
    from loading the tokenizer; the parent goes on meanwhile; once they load it, `map` works in them."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE, str(gate))  # a spawned worker inherits the environment
    tok = _GatedTokenizer("gated", os.urandom(1_500_000))
    pool = TokenizerPool(tok, workers=2, min_items=1)
    try:
        t0 = time.monotonic()
        pool.start()
        assert time.monotonic() - t0 < 5.0  # the caller goes on at once
        deadline = time.monotonic() + 60.0
        while len(multiprocessing.active_children()) < 2:  # a process is listed once its start returned
            assert time.monotonic() < deadline, "the parent waited for a worker to load the tokenizer"
            time.sleep(0.05)
        assert pool.ready_seconds is None  # ...and neither has loaded it
        gate.touch()
        assert pool.map(_describe, [1, 2, 3]) == [("gated", 1_500_000, n * n) for n in (1, 2, 3)]
        deadline = time.monotonic() + 10.0
        while pool.ready_seconds is None:  # set as the workers' first tasks report back
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert pool.stats()["workers"] == 2
    finally:
        gate.touch()  # whatever failed, no worker waits on
        pool.close()
    assert not multiprocessing.active_children()


def test_a_pool_closed_while_its_workers_start_leaves_none_behind() -> None:
    """Closed at once after `start` (the target failed to load, say): `close` releases the workers
    waiting for the others and returns with none left."""
    pool = TokenizerPool(_GatedTokenizer("gated", b"x"), workers=2, min_items=1)
    pool.start()
    pool.close()
    assert not multiprocessing.active_children()


def test_one_worker_or_little_work_stays_in_process() -> None:
    tok = _GatedTokenizer("here", b"")
    with TokenizerPool(tok, workers=1, min_items=1) as pool:
        pool.start()  # nothing to start with one worker
        assert pool.map(_describe, [3]) == [("here", 0, 9)]
        assert pool.stats() == {"workers": 0, "ready_seconds": None, "wait_seconds": 0.0}

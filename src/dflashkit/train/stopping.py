"""Stopping a run on a signal without losing work: SIGTERM (a scheduler's time limit, `timeout`, a
preempted node) or SIGINT (Ctrl-C) during the training loop ends the step under way, writes a checkpoint
and returns, so `dflashkit train --resume` continues from that very step. A second signal stops at once
(KeyboardInterrupt: the newest checkpoint stays as it was: they are written atomically).

Processes of a data-parallel run agree on the step to stop after (`stop_requested` takes the maximum over
ranks each step), so a signal that reaches one rank first cannot leave the others waiting in a collective.
Signal handlers belong to the main thread: elsewhere (a fan-out's drafter threads) nothing is installed and
no stop is ever requested by a signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from dflashkit.train.distributed import Dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class StopRequest:
    """The signal that asked this process to stop (None: none yet)."""

    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, the first SIGTERM or SIGINT is recorded in the request it yields; a second one
    raises KeyboardInterrupt. The handlers that were there before come back afterwards."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if request.signum is not None:
            raise KeyboardInterrupt
        request.signum = signum

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_requested(request: StopRequest, d: Dist) -> bool:
    """Whether any process of the run was asked to stop (one small all-reduce a step when data-parallel);
    a rank that learns of the stop this way takes the signal's name for its own."""
    if not d.parallel:
        return request.signum is not None
    flag = torch.tensor([request.signum or 0], dtype=torch.int32, device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if request.signum is None and int(flag.item()) != 0:
        request.signum = int(flag.item())
    return request.signum is not None

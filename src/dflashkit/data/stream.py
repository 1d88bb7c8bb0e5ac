"""The one order in which training reads its rows: the micro-batch stream.

Each epoch is a seeded permutation of the packed training rows (`epoch_order`); the stream cuts it into
full global micro-batches of ``world_size x batch_size`` consecutive rows (full batches only: one shape),
epoch after epoch. Rank r reads rows [r*b, (r+1)*b) of each global micro-batch. Every row's anchors are
drawn from a generator seeded by (seed, epoch, the row's place in the epoch order) (`anchor_seed`), so
they depend neither on the batch size nor on which rank reads the row.

Where training stands is a data cursor {"epoch", "index"}: the epoch, and the place in its order of the
next global micro-batch (counted in global rows, so it is the same on every rank and world size). A
checkpoint stores it; `MicroBatchStream.from_cursor` continues from it. A fan-out's target workers read
the same stream by number (`MicroBatchStream.at`), and `position` turns a drafter's cursor into the
number of its next micro-batch: trainer and fan-out walk one stream, never two copies of its arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a seeded permutation, so a cursor (epoch, index) resumes exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=g).tolist()


def anchor_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the anchor draw for the row at `position` of epoch `epoch`'s order (a splitmix64 mix).

    It depends on the row's place in the data alone, not on the batch size or on how rows are dealt to
    ranks: W ranks x b rows draw the same anchors as 1 process x W*b rows, and a resume on another
    world size continues the same draws."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: a valid torch seed


@dataclass(frozen=True)
class MicroBatch:
    """One global micro-batch of the stream, as this rank reads it."""

    n: int  # its number in the stream (epoch * micro-batches per epoch + its place in the epoch)
    epoch: int
    start: int  # the place in the epoch order of the global micro-batch's first row
    rows: list[int]  # this rank's rows (indices into the packed training rows)
    seeds: list[int]  # the anchor seed of each of them
    end: int  # the place after the global micro-batch's last row

    @property
    def cursor_after(self) -> dict[str, int]:
        """The data cursor once this micro-batch is trained (what a checkpoint after it stores)."""
        return {"epoch": self.epoch, "index": self.end}


class MicroBatchStream:
    """Full global micro-batches of ``world_size x batch_size`` rows of each epoch's seeded order."""

    def __init__(self, num_rows: int, batch_size: int, seed: int, *, world_size: int = 1, rank: int = 0):
        if not 0 < batch_size * world_size <= num_rows:
            raise ValueError(f"{num_rows} rows cannot fill one micro-batch of {world_size} x {batch_size}")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.world_size, self.rank = world_size, rank
        self.size = world_size * batch_size  # rows of one global micro-batch
        self.per_epoch = num_rows // self.size
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()  # a fan-out's target workers read it from several threads

    def order(self, epoch: int) -> list[int]:
        """`epoch_order` of an epoch (the last few are kept)."""
        with self._lock:
            if epoch not in self._orders:
                if len(self._orders) >= 4:
                    self._orders.pop(min(self._orders))
                self._orders[epoch] = epoch_order(self.num_rows, self.seed, epoch)
            return self._orders[epoch]

    def _micro_batch(self, epoch: int, start: int) -> MicroBatch:
        first = start + self.rank * self.batch_size  # this rank's share of the global micro-batch
        positions = range(first, first + self.batch_size)
        order = self.order(epoch)
        return MicroBatch(
            n=epoch * self.per_epoch + start // self.size,
            epoch=epoch,
            start=start,
            rows=[order[p] for p in positions],
            seeds=[anchor_seed(self.seed, epoch, p) for p in positions],
            end=start + self.size,
        )

    def from_cursor(self, cursor: Mapping[str, int] | None = None) -> Iterator[MicroBatch]:
        """The micro-batches from a data cursor on (None: from the start), without end. A cursor at an
        epoch's end, or short of a full micro-batch there, continues with the next epoch."""
        epoch, index = (cursor["epoch"], cursor["index"]) if cursor is not None else (0, 0)
        while True:
            if index + self.size > self.num_rows:  # full batches only: one shape
                epoch, index = epoch + 1, 0
            yield self._micro_batch(epoch, index)
            index += self.size

    def at(self, n: int) -> MicroBatch:
        """Micro-batch number n."""
        epoch, j = divmod(n, self.per_epoch)
        return self._micro_batch(epoch, j * self.size)

    def position(self, cursor: Mapping[str, int] | None) -> int:
        """The number of the micro-batch a data cursor continues with (0 for None)."""
        if cursor is None:
            return 0
        return cursor["epoch"] * self.per_epoch + cursor["index"] // self.size

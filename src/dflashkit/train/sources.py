"""Where a training run's target features come from: a `FeatureSource`.

A source gives the context features [b, T, n*H] and the target's argmax labels [b, T] of some rows of a
split, on the device of the rows it is handed. Four kinds:

- `OnlineFeatures`: the target runs over the rows, every time (`target.packed.target_pass`);
- `CachedFeatures`: the same, but each row's pass runs once and is kept (``train.cache_features``: small
  datasets, the CPU);
- `CapturedFeatures`: read from a `dflashkit capture` folder (``data.features_dir``);
- `FedFeatures`: a fan-out's drafter: training micro-batches come from the target workers' feed, in
  stream order, and held-out rows from features computed once for every drafter.

`feature_source` picks the first three from the config; the fan-out builds the fed ones.

The layers a source reads are `feature_layers`: the drafter's own, and the target's last when the run
needs the target's whole distribution (a kl, tv or lk train.loss, or train.serve_temperature > 0: the
target's distribution is its last layer through its final norm and head).
`split_features` takes the drafter's context features and that last layer apart again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from dflashkit.config import RunConfig
from dflashkit.data.features import FeatureStore
from dflashkit.data.rows import Rows
from dflashkit.data.stream import MicroBatch
from dflashkit.errors import DflashkitError
from dflashkit.model.config import DrafterConfig
from dflashkit.target import packed

Features = tuple[Tensor, Tensor]  # context features [b, T, n*H], argmax labels [b, T]


def feature_layers(cfg: RunConfig, config: DrafterConfig) -> list[int]:
    """The target layers a run reads at each step, in order: the drafter's (its context features) and, when
    it needs the target's distribution (`TrainSection.reads_target_distribution`), the target's last one."""
    layers = set(config.target_layer_ids)
    if cfg.train.reads_target_distribution():
        layers.add(config.num_target_layers - 1)
    return sorted(layers)


def feature_columns(union: list[int], layer_ids: list[int], hidden: int) -> Tensor | None:
    """Columns of ``layer_ids`` in features of the ``union`` of layers (outputs concatenated in layer order,
    ``hidden`` wide each), on the CPU; None when they are all of them."""
    mine = sorted(layer_ids)
    if mine == union:
        return None
    cols = [torch.arange(union.index(i) * hidden, (union.index(i) + 1) * hidden) for i in mine]
    return torch.cat(cols)


def split_features(features: Tensor, cfg: RunConfig, config: DrafterConfig) -> tuple[Tensor, Tensor | None]:
    """Features of `feature_layers` [b, T, n*H] -> the drafter's context features and the target's last-layer
    output [b, T, H] (None when the run does not read the target's distribution). The last layer comes last in layer order: the
    drafter's are the columns before it, or all of them when it reads the last layer itself (views both)."""
    if not cfg.train.reads_target_distribution():
        return features, None
    H = config.hidden_size
    last = features[..., -H:]
    if config.num_target_layers - 1 in config.target_layer_ids:
        return features, last
    return features[..., :-H], last


class FeedError(DflashkitError):
    """A fed source was asked for features it was not handed (a fan-out's, not a user's mistake)."""


class FeatureSource(Protocol):
    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        """Features and labels of rows ``idx`` of ``split`` ("train" or "validation"); ``rows`` are those
        rows, on the device the features are wanted on."""
        ...

    def batch(self, mb: MicroBatch, rows: Rows) -> Features:
        """Features and labels of a training micro-batch of the stream (``rows``: its rows, on the device)."""
        ...


class OnlineFeatures:
    """The target runs over the rows every time they are asked for."""

    def __init__(self, target: Any, layer_ids: Sequence[int]):
        self.target = target
        self.layer_ids = list(layer_ids)

    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        return packed.target_pass(self.target, rows, self.layer_ids)

    def batch(self, mb: MicroBatch, rows: Rows) -> Features:
        return self.features("train", mb.rows, rows)


class CachedFeatures(OnlineFeatures):
    """The target runs once per row; its features and labels are kept (on the device they were made on)."""

    def __init__(self, target: Any, layer_ids: Sequence[int]):
        super().__init__(target, layer_ids)
        self.kept: dict[tuple[str, int], Features] = {}

    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        missing = [j for j, i in enumerate(idx) if (split, i) not in self.kept]
        if missing:
            sub = Rows(
                *(t[missing] for t in (rows.input_ids, rows.loss_mask, rows.doc_ids, rows.position_ids))
            )
            feats, argmax = packed.target_pass(self.target, sub, self.layer_ids)
            for k, j in enumerate(missing):
                self.kept[(split, idx[j])] = (feats[k], argmax[k])
        feats = torch.stack([self.kept[(split, i)][0] for i in idx])
        argmax = torch.stack([self.kept[(split, i)][1] for i in idx])
        return feats, argmax


class CapturedFeatures:
    """Features and labels read from a capture (`dflashkit capture`), in the target's dtype; with
    ``last_hidden``, the target's last hidden state stored beside them comes after them."""

    def __init__(self, store: FeatureStore, dtype: torch.dtype, last_hidden: bool = False):
        self.store = store
        self.dtype = dtype
        self.last_hidden = last_hidden

    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        return self.store.read(split, idx, rows.input_ids.device, self.dtype, self.last_hidden)

    def batch(self, mb: MicroBatch, rows: Rows) -> Features:
        return self.features("train", mb.rows, rows)


def feature_source_for(
    cfg: RunConfig, target: Any, layer_ids: Sequence[int], store: FeatureStore | None
) -> OnlineFeatures | CapturedFeatures:
    """The source a config asks for: a capture's ``store`` (data.features_dir), cached target passes
    (train.cache_features) or the target every time, for ``layer_ids`` of ``target`` (`feature_layers`)."""
    if store is not None:  # the last layer, when asked for and not among the drafter's, is stored apart
        last = target.num_layers - 1
        apart = last in layer_ids and last not in store.manifest["target_layer_ids"]
        return CapturedFeatures(store, target.dtype, last_hidden=apart)
    kind = CachedFeatures if cfg.train.cache_features else OnlineFeatures
    return kind(target, layer_ids)


def feature_source(run: Any) -> OnlineFeatures | CapturedFeatures:
    """A training run's own source (`setup.Run`): its target, its `feature_layers`, its capture if any."""
    return feature_source_for(run.cfg, run.target, feature_layers(run.cfg, run.drafter.config), run.store)


class KeptFeatures:
    """Features and labels handed over row by row (`keep`), e.g. a fan-out's held-out rows."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int], Features] = {}

    def keep(self, split: str, i: int, features: Tensor, labels: Tensor) -> None:
        self.kept[(split, i)] = (features, labels)

    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        missing = [i for i in idx if (split, i) not in self.kept]
        if missing:
            raise FeedError(f"{split} rows {missing[:4]} were never handed over")
        feats = torch.stack([self.kept[(split, i)][0] for i in idx])
        return feats, torch.stack([self.kept[(split, i)][1] for i in idx])

    def batch(self, mb: MicroBatch, rows: Rows) -> Features:
        return self.features("train", mb.rows, rows)


class Feed(Protocol):
    """What a fed source takes its micro-batches from (a fan-out's bounded queue)."""

    name: str

    def next(self) -> Any:  # a batch with .n, .features (the target's union of layers), .argmax
        ...

    def select(self, features: Tensor) -> Tensor:  # this drafter's layers of the union
        ...


class FedFeatures:
    """A fan-out drafter's features: training micro-batches from the target workers' feed, in stream order;
    held-out rows from ``held_out`` (computed once for every drafter, or the drafter's capture)."""

    def __init__(self, feed: Feed, held_out: KeptFeatures | CapturedFeatures):
        self.feed = feed
        self.held_out = held_out

    def features(self, split: str, idx: list[int], rows: Rows) -> Features:
        if split != "validation":
            raise FeedError(f"drafter {self.feed.name} is fed its training rows by micro-batch, in order")
        return self.held_out.features(split, idx, rows)

    def batch(self, mb: MicroBatch, rows: Rows) -> Features:
        fed = self.feed.next()
        if fed.n != mb.n:  # one stream on both sides: this would be a bug of the fan-out's, not the user's
            raise FeedError(
                f"drafter {self.feed.name} expected micro-batch {mb.n} of the stream but the target fed "
                f"micro-batch {fed.n}; resume the fan-out as a whole (dflashkit fanout --resume)"
            )
        device = rows.input_ids.device
        return self.feed.select(fed.features).to(device), fed.argmax.to(device)

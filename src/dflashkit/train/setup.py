"""Everything a training run needs before its first step (`setup_run`): the device and attention backend,
the target, the drafter, the packed rows and their micro-batch stream, a capture's feature store, and the
number of optimizer steps. Each check fails with one clear line before anything slow runs where it can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.config import RunConfig
from dflashkit.data.dataset import read_manifest
from dflashkit.data.features import FeatureStore, check_capture_matches
from dflashkit.data.rows import Rows, pack_dataset
from dflashkit.data.rows import check_data_matches_target as check_data_matches
from dflashkit.data.stream import MicroBatchStream
from dflashkit.errors import ConfigError, DataError
from dflashkit.model.checkpoint import check_checkpoint_folder, load_drafter
from dflashkit.model.config import DrafterConfig, config_for_target, target_layer_ids_of
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.runtime.devices import resolve_backend, resolve_device, target_dtype, use_compiled_regions
from dflashkit.target.hf import TargetModel, default_mask_token_id
from dflashkit.train.distributed import Dist, single_process


@dataclass
class Run:
    """One drafter's training run on this process's device."""

    cfg: RunConfig
    out_dir: Path
    dist: Dist  # this process's place in a data-parallel run (rank 0 of 1 alone)
    backend: str  # the attention backend: flex, sdpa or eager
    target: TargetModel  # (a fan-out's drafter on another device sees the target through a view)
    drafter: DFlashDrafter
    train_rows: Rows
    val_rows: Rows
    stream: MicroBatchStream  # the order this process reads the training rows in
    manifest: dict[str, Any]  # the dataset's
    total_steps: int
    store: FeatureStore | None = None  # a capture's features (data.features_dir), else None

    @property
    def device(self) -> torch.device:
        return self.dist.device


def drafter_config(
    cfg: RunConfig, target_config: Any, identity: dict[str, Any] | None = None
) -> DrafterConfig:
    """The drafter's shape from the run config and the target's HF config (no weights needed)."""
    d = cfg.drafter
    vocab = int(target_config.vocab_size)
    mask_id = (
        d.mask_token_id if d.mask_token_id is not None else default_mask_token_id(cfg.target.path, vocab)
    )
    config = config_for_target(
        target_config,
        num_layers=d.layers,
        block_size=d.block_size,
        mask_token_id=mask_id,
        target_layer_ids=target_layer_ids_of(d, int(target_config.num_hidden_layers)),
        target=identity,
    )
    if d.sliding_window is not None:
        config = config.updated(
            sliding_window=d.sliding_window, layer_types=["sliding_attention"] * config.num_hidden_layers
        )
    return config


def check_data_matches_target(
    manifest: dict[str, Any], ident: dict[str, Any], config: DrafterConfig, where: str
) -> None:
    """The data, the drafter and the target must belong together: one clear error if they do not."""
    check_data_matches(manifest, ident, where)
    if not 0 <= config.mask_token_id < ident["vocab_size"]:
        raise ConfigError(
            f"mask_token_id {config.mask_token_id} is outside the target's vocabulary ({ident['vocab_size']})"
        )


def check_rows(cfg: RunConfig, train_rows: Rows, world_size: int = 1) -> None:
    """Enough training rows for one global micro-batch (world_size x train.batch_size rows)."""
    micro = world_size * cfg.train.batch_size
    if len(train_rows) < micro:
        ranks = f"{world_size} ranks x " if world_size > 1 else ""
        raise DataError(
            f"{cfg.data.dir} packs into {len(train_rows)} training rows of {cfg.train.max_len} tokens, fewer "
            f"than {ranks}train.batch_size={cfg.train.batch_size}; prepare more data or lower the batch size"
        )


def total_steps(cfg: RunConfig, num_train_rows: int, world_size: int = 1) -> int:
    """Optimizer steps of the run: train.max_steps, else train.epochs over the training rows."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    per_step = world_size * cfg.train.batch_size * cfg.train.grad_accum
    return max(1, math.ceil(cfg.train.epochs * num_train_rows / per_step))


def setup_run(
    cfg: RunConfig,
    *,
    dist: Dist | None = None,
    target: Any = None,
    rows: tuple[Rows, Rows] | None = None,
) -> Run:
    """Everything a run needs, on this process's device (``dist`` under torchrun: see train.distributed).
    ``target``: the target when the caller has it loaded already, and ``rows``: the packed (training,
    validation) rows when it has packed them (a fan-out's drafters share both)."""
    dist = dist if dist is not None else single_process(resolve_device(cfg))
    device = dist.device
    backend = resolve_backend(cfg, device)
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    if cfg.drafter.init:
        check_checkpoint_folder(cfg.drafter.init)  # before the target loads
    if target is None:
        target = TargetModel.load(cfg.target.path, dtype=target_dtype(cfg, device), device=device)
    config = drafter_config(cfg, target.config, target.identity())
    check_data_matches_target(manifest, target.identity(), config, str(data_dir))
    if cfg.drafter.init:
        drafter = load_drafter(cfg.drafter.init, target, dtype=torch.float32, device=device)
    else:
        torch.manual_seed(cfg.train.seed)
        drafter = DFlashDrafter(config).to(device)
    drafter.compiled_regions = use_compiled_regions(
        cfg, backend, dist.strategy if dist.parallel else "single"
    )
    train_rows, val_rows = rows if rows is not None else pack_dataset(cfg, target.config)
    store = None
    if cfg.data.features_dir:  # offline: features and labels from `dflashkit capture`
        store = FeatureStore(cfg.data.features_dir)
        check_capture_matches(
            store.manifest,
            where=cfg.data.features_dir,
            ident=target.identity(),
            layer_ids=config.target_layer_ids,
            max_len=cfg.train.max_len,
            data_manifest=manifest,
            rows={"train": train_rows, "validation": val_rows},
        )
    check_rows(cfg, train_rows, dist.world_size)
    stream = MicroBatchStream(
        len(train_rows), cfg.train.batch_size, cfg.train.seed, world_size=dist.world_size, rank=dist.rank
    )
    return Run(
        cfg=cfg,
        out_dir=Path(cfg.run.out_dir),
        dist=dist,
        backend=backend,
        target=target,
        drafter=drafter,
        train_rows=train_rows,
        val_rows=val_rows,
        stream=stream,
        manifest=manifest,
        total_steps=total_steps(cfg, len(train_rows), dist.world_size),
        store=store,
    )

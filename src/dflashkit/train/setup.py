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
from dflashkit.data.features import FeatureStore, check_capture_has_distribution, check_capture_matches
from dflashkit.data.rows import Rows, pack_dataset
from dflashkit.data.rows import check_data_matches_target as check_data_matches
from dflashkit.data.stream import MicroBatchStream
from dflashkit.errors import ConfigError, DataError
from dflashkit.model.checkpoint import load_drafter, read_checkpoint_config
from dflashkit.model.config import DrafterConfig, config_for_target, target_layer_ids_of
from dflashkit.model.drafter import DFlashDrafter, grown
from dflashkit.runtime.devices import resolve_backend, resolve_device, target_dtype, use_compiled_regions
from dflashkit.target.hf import TargetModel, default_mask_token_id, mask_token_text
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
        mask_token=mask_token_text(cfg.target.path, mask_id),
        target_layer_ids=target_layer_ids_of(d, int(target_config.num_hidden_layers)),
        target=identity,
    )
    if d.sliding_window is not None:
        config = config.updated(
            sliding_window=d.sliding_window, layer_types=["sliding_attention"] * config.num_hidden_layers
        )
    return config


def with_init_shape(cfg: RunConfig) -> RunConfig:
    """The config of a run that starts from ``drafter.init``: the drafter's shape is the checkpoint's where
    the config leaves it unset. The config may ask for more layers than the checkpoint has (appended as
    identities: `grown`) and for another block size (no weight depends on it); the target layers, the mask
    token and the sliding window it sets must be the checkpoint's (one `ConfigError` naming each). Without
    ``drafter.init``, or applied twice, the config comes back as it was."""
    d = cfg.drafter
    if not d.init:
        return cfg
    init, _ = read_checkpoint_config(d.init, verify=False)
    given = d.model_fields_set
    where = f"drafter.init={d.init}"
    problems = []
    if "layers" in given and d.layers < init.num_hidden_layers:
        problems.append(
            f"drafter.layers={d.layers}, but {where} has {init.num_hidden_layers} layers (a drafter can be "
            "given more layers, not fewer)"
        )
    ids = list(init.target_layer_ids)
    if "target_layer_ids" in given and d.target_layer_ids is not None and list(d.target_layer_ids) != ids:
        problems.append(
            f"drafter.target_layer_ids={d.target_layer_ids}, but {where} reads target layers {ids}"
        )
    elif "num_target_layers" in given and d.num_target_layers != len(ids):
        problems.append(
            f"drafter.num_target_layers={d.num_target_layers}, but {where} reads {len(ids)}: {ids}"
        )
    if "mask_token_id" in given and d.mask_token_id is not None and d.mask_token_id != init.mask_token_id:
        problems.append(f"drafter.mask_token_id={d.mask_token_id}, but {where} uses {init.mask_token_id}")
    if "sliding_window" in given and d.sliding_window != init.sliding_window:
        problems.append(f"drafter.sliding_window={d.sliding_window}, but {where} has {init.sliding_window}")
    if problems:
        raise ConfigError(
            "; ".join(problems)
            + ". Leave these keys out to take the checkpoint's, or leave drafter.init out "
            "to train a new drafter"
        )
    shape = {
        "layers": d.layers if "layers" in given else init.num_hidden_layers,
        "block_size": d.block_size if "block_size" in given else init.block_size,
        "num_target_layers": len(ids),
        "target_layer_ids": ids,
        "mask_token_id": init.mask_token_id,
        "sliding_window": init.sliding_window,
    }
    return cfg.model_copy(update={"drafter": d.model_copy(update=shape)})


def start_note(cfg: RunConfig) -> str:
    """What a run starts from, in one line: a new drafter, drafter.init's, or drafter.init's grown (``cfg``
    through `with_init_shape`)."""
    d = cfg.drafter
    if not d.init:
        return f"a new drafter (train.seed {cfg.train.seed})"
    init, _ = read_checkpoint_config(d.init, verify=False)
    changes = []
    if d.layers != init.num_hidden_layers:
        changes.append(f"{init.num_hidden_layers} -> {d.layers} layers (the new ones start as identities)")
    if d.block_size != init.block_size:
        changes.append(f"block {init.block_size} -> {d.block_size}")
    return f"{d.init}" + (f", grown: {', '.join(changes)}" if changes else " as it is")


def initial_drafter(cfg: RunConfig, target: TargetModel, device: torch.device) -> DFlashDrafter:
    """The drafter a run starts from: ``drafter.init``'s (float32), given the layers and block size the
    config asks (`grown`; ``cfg`` through `with_init_shape` first), or a new one drawn under train.seed."""
    torch.manual_seed(cfg.train.seed)  # a new drafter's weights, or the new layers of a grown one
    if not cfg.drafter.init:
        return DFlashDrafter(drafter_config(cfg, target.config, target.identity())).to(device)
    old = load_drafter(cfg.drafter.init, target, dtype=torch.float32, device=device)
    extra = cfg.drafter.layers - old.config.num_hidden_layers
    types = list(old.config.layer_types or []) + [(old.config.layer_types or ["full_attention"])[-1]] * extra
    config = old.config.updated(
        num_hidden_layers=cfg.drafter.layers, block_size=cfg.drafter.block_size, layer_types=types
    )
    return grown(old, config)


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
    cfg = with_init_shape(cfg)  # reads drafter.init's config: a bad folder fails before the target loads
    dist = dist if dist is not None else single_process(resolve_device(cfg))
    device = dist.device
    backend = resolve_backend(cfg, device)
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    if target is None:
        target = TargetModel.load(cfg.target.path, dtype=target_dtype(cfg, device), device=device)
    config = drafter_config(cfg, target.config, target.identity())
    check_data_matches_target(manifest, target.identity(), config, str(data_dir))
    drafter = initial_drafter(cfg, target, device)
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
        check_capture_has_distribution(store.manifest, cfg, cfg.data.features_dir)
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

"""Training a DFlash drafter on one process (CPU or one GPU), features from the in-process target.

Read top to bottom: `train()` sets a run up (`setup_run`), then loops over optimizer steps; each step
packs rows, runs the frozen target for context features and labels (`target_pass`), draws anchors,
runs the drafter over every block (`block_step`), and takes the chunked, position-weighted loss.
Metrics are the exact block acceptance length and per-position accuracy, on training batches and on
held-out data; the best checkpoint is the one with the highest validation acceptance length.

A run folder holds:
    config.yaml  fingerprint.json  metrics.jsonl
    checkpoints/step-000100/  (z-lab drafter + training state + run config + fingerprint; atomic)
    checkpoints/latest        (name of the newest complete checkpoint)
    best/                     (z-lab drafter with the best validation acceptance length)
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.atomic import atomic_dir
from dflashkit.attention.masks import BlockLayout
from dflashkit.config import RunConfig, dump_config
from dflashkit.errors import CheckpointError, ConfigError, DataError, DeviceError, EnvironmentDriftError
from dflashkit.model.checkpoint import check_checkpoint_folder, load_drafter, write_checkpoint
from dflashkit.model.config import DrafterConfig, config_for_target
from dflashkit.model.drafter import DFlashDrafter, build_block_masks
from dflashkit.runtime import fingerprint as fpmod
from dflashkit.runtime.compile import COMPILE_LOCK, check_not_frozen, frozen_compiles
from dflashkit.runtime.compile_cache import portable_cache
from dflashkit.target.hf import TargetModel, default_mask_token_id
from dflashkit.train import distributed as dd
from dflashkit.train import state as st
from dflashkit.train.anchors import (
    block_inputs,
    block_labels,
    block_positions,
    covering_layouts,
    pack_sequences,
    sample_anchors,
)
from dflashkit.train.loss import LossOutput, dflash_loss
from dflashkit.train.metrics import (
    acceptance_stats,
    add_stats,
    block_lengths,
    finalize_stats,
    served_order_walk,
    served_tau,
)
from dflashkit.train.rundir import RUN_CONFIG_FILE, check_resume_config, claim_run_folder

CHECKPOINTS = "checkpoints"
BEST = "best"


# --------------------------------------------------------------------------------------------------
# Resolving "auto" settings


def resolve_device(cfg: RunConfig) -> torch.device:
    want = cfg.run.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(want)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"run.device={want} but this machine has no CUDA GPU; use run.device=cpu or auto")
    return dev


def resolve_backend(cfg: RunConfig, device: torch.device) -> str:
    backend = cfg.attention.backend
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "attention.backend=flex cannot train on the CPU (flex has no CPU backward); use sdpa"
        )
    return backend


def use_compiled_regions(cfg: RunConfig, backend: str, strategy: str = "single") -> bool:
    """Whether the drafter's layers and the loss chunks run as compiled regions (train.compile)."""
    want = cfg.train.compile
    if want == "off":
        return False
    if backend != "flex" or strategy == "fsdp":
        if want == "on":
            why = "FSDP shards the layers' weights" if strategy == "fsdp" else f"the backend is {backend}"
            raise ConfigError(
                f"train.compile=on needs the flex attention backend without FSDP ({why}); use train.compile=auto"
            )
        return False
    return True


def target_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    if cfg.target.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.target.dtype)


def autocast_context(cfg: RunConfig, device: torch.device):
    use = cfg.train.autocast == "bf16" or (cfg.train.autocast == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else nullcontext()


# --------------------------------------------------------------------------------------------------
# Data: packed rows


@dataclass
class Rows:
    """Packed training rows: input_ids, loss_mask, doc_ids, position_ids, each [rows, max_len]."""

    input_ids: Tensor
    loss_mask: Tensor
    doc_ids: Tensor
    position_ids: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, idx: list[int], device: torch.device) -> Rows:
        return Rows(
            *(t[idx].to(device) for t in (self.input_ids, self.loss_mask, self.doc_ids, self.position_ids))
        )


def pack_rows(records: list[Any], max_len: int, pad_token_id: int, where: str = "the dataset split") -> Rows:
    """Pack tokenized records (with .input_ids and .loss_mask) into rows of max_len tokens."""
    if not records:
        raise DataError(
            f"{where} holds no records; prepare more prompts (data.max_prompts), or see why `dflashkit "
            "prepare` kept none (prompts longer than data.max_prompt_tokens are left out)"
        )
    plain = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask} for r in records]
    return Rows(*pack_sequences(plain, max_len, pad_token_id))


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a seeded permutation, so a cursor (epoch, index) resumes exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=g).tolist()


_MASK64 = (1 << 64) - 1


def anchor_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the anchor draw for the row at `position` of epoch `epoch`'s order (a splitmix64 mix).

    It depends on the row's place in the data alone, not on the batch size or on how rows are dealt to
    ranks: W ranks x b rows draw the same anchors as 1 process x W*b rows, and a resume on another
    world size continues the same draws."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: a valid torch seed


def draw_anchors(
    rows: Rows,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator,
    seeds: Sequence[int] | None = None,
) -> BlockLayout:
    """Anchors for a micro-batch: from `generator` as it stands, or, with `seeds` (one per row), row i's
    from `generator` re-seeded with seeds[i], so that a row's draw does not depend on its neighbours."""
    if seeds is None:
        return sample_anchors(rows.loss_mask, rows.doc_ids, num_anchors, block_size, generator)
    if len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} anchor seeds for {len(rows)} rows")
    parts = [
        sample_anchors(
            rows.loss_mask[i : i + 1],
            rows.doc_ids[i : i + 1],
            num_anchors,
            block_size,
            generator.manual_seed(s),
        )
        for i, s in enumerate(seeds)
    ]
    return BlockLayout(
        anchors=torch.cat([p.anchors for p in parts]),
        block_valid=torch.cat([p.block_valid for p in parts]),
        doc_ids=rows.doc_ids,
        block_size=block_size,
    )


# --------------------------------------------------------------------------------------------------
# One step


@dataclass
class StepOutput:
    loss: LossOutput
    stats: dict[str, Tensor]
    layout: BlockLayout
    lengths: Tensor  # [b, N]: each block's exact acceptance length (padding blocks included)


def target_pass(target: TargetModel, rows: Rows, layer_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Context features [b, T, n*H] and the target's argmax labels [b, T] for packed rows.

    Documents packed in one row must not see each other: the target runs with per-document
    positions and a block-diagonal causal mask.
    """
    T = rows.input_ids.shape[1]
    dev = rows.input_ids.device
    same_doc = rows.doc_ids[:, :, None] == rows.doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    # Padding rows see themselves only (keeps softmax finite; they are never supervised).
    allowed = (same_doc & causal)[:, None] | torch.eye(T, dtype=torch.bool, device=dev)
    return target.features(
        rows.input_ids, allowed, layer_ids, position_ids=rows.position_ids, labels="argmax"
    )


def block_step(
    drafter: DFlashDrafter,
    target: TargetModel,
    rows: Rows,
    features: Tensor,
    argmax: Tensor,
    cfg: RunConfig,
    backend: str,
    generator: torch.Generator,
    autocast: Any,
    *,
    seeds: Sequence[int] | None = None,
    layout: BlockLayout | None = None,
) -> StepOutput:
    """Anchors -> blocks -> drafter -> chunked weighted loss, for one micro-batch. ``drafter`` may be a
    DDP wrapper; ``seeds`` (one per row) make each row's anchors its own draw (`draw_anchors`); ``layout``
    gives the anchors instead (evaluation's `covering_layouts`)."""
    dc = dd.unwrap(drafter).config
    B = dc.block_size
    if layout is None:
        layout = draw_anchors(rows, cfg.train.num_anchors, B, generator, seeds)
    ids = block_inputs(rows.input_ids, layout, dc.mask_token_id)
    positions = block_positions(rows.position_ids, layout)
    labels, label_mask = block_labels(
        layout, argmax, rows.input_ids, rows.loss_mask, use_dataset_tokens=cfg.train.labels == "dataset"
    )
    masks = build_block_masks(dc, layout, backend)
    with autocast:
        hidden = drafter(features, target.embed(ids), rows.position_ids, positions, masks, backend)
        out = dflash_loss(
            hidden,
            target.lm_head_weight(),
            labels,
            label_mask,
            B,
            gamma=cfg.decay_gamma(),
            weighting=cfg.train.loss_weighting,
            dpace_alpha=cfg.train.dpace_alpha,
            chunk_blocks=cfg.train.chunk_blocks,
            compiled=dd.unwrap(drafter).compiled_regions,
        )
    lengths = block_lengths(out.predictions, labels, label_mask, B)
    stats = acceptance_stats(out.predictions, labels, label_mask, layout.block_valid, B, lengths)
    return StepOutput(out, stats, layout, lengths)


# --------------------------------------------------------------------------------------------------
# Schedule


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


# --------------------------------------------------------------------------------------------------
# Run setup


@dataclass
class Run:
    cfg: RunConfig
    out_dir: Path
    device: torch.device
    backend: str
    target: TargetModel
    drafter: DFlashDrafter
    train_rows: Rows
    val_rows: Rows
    manifest: dict[str, Any]
    total_steps: int
    cached: dict[tuple[str, int], tuple[Tensor, Tensor]] = field(default_factory=dict)
    features: Any = None  # a data.features.FeatureStore when data.features_dir names a capture
    dist: dd.Dist | None = None  # this process's place in a data-parallel run (setup_run sets it)
    # The target layers features_for reads (None: the drafter's). A fan-out's target side reads the union
    # of its drafters' layers.
    feature_layer_ids: list[int] | None = None


def drafter_config(
    cfg: RunConfig, target_config: Any, identity: dict[str, Any] | None = None
) -> DrafterConfig:
    """The drafter's shape from the run config and the target's HF config (no weights needed)."""
    from dflashkit.model.config import default_target_layer_ids

    d = cfg.drafter
    L, vocab = int(target_config.num_hidden_layers), int(target_config.vocab_size)
    mask_id = (
        d.mask_token_id if d.mask_token_id is not None else default_mask_token_id(cfg.target.path, vocab)
    )
    dc = config_for_target(
        target_config,
        num_layers=d.layers,
        block_size=d.block_size,
        mask_token_id=mask_id,
        target_layer_ids=d.target_layer_ids or default_target_layer_ids(L, d.num_target_layers),
        target=identity,
    )
    if d.sliding_window is not None:
        dc = dc.updated(
            sliding_window=d.sliding_window, layer_types=["sliding_attention"] * dc.num_hidden_layers
        )
    return dc


def check_data_matches_target(
    manifest: dict[str, Any], ident: dict[str, Any], dc: DrafterConfig, where: str
) -> None:
    """The data, the drafter and the target must belong together: one clear error if they do not."""
    data_target = manifest.get("target", {})
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if key in data_target and data_target[key] != ident.get(key):
            raise ConfigError(
                f"{where} was prepared with a target of {key}={data_target[key]}, but this target has "
                f"{key}={ident.get(key)}; prepare the data again with this target"
            )
    if data_target.get("hash") and ident.get("hash") and data_target["hash"] != ident["hash"]:
        raise ConfigError(
            f"{where} was prepared with another target ({data_target.get('name')}, hash "
            f"{str(data_target['hash'])[:12]}) than {ident['name']} (hash {str(ident['hash'])[:12]}); "
            "prepare the data again with this target"
        )
    if not 0 <= dc.mask_token_id < ident["vocab_size"]:
        raise ConfigError(
            f"mask_token_id {dc.mask_token_id} is outside the target's vocabulary ({ident['vocab_size']})"
        )


def load_rows(cfg: RunConfig, target: TargetModel) -> tuple[Rows, Rows]:
    """The packed training and validation rows of data.dir, as training sees them."""
    return pack_dataset(cfg, target.config)


def pack_dataset(cfg: RunConfig, target_config: Any) -> tuple[Rows, Rows]:
    """The packed training and validation rows of data.dir (``target_config``: the target's HF config,
    for its padding token; no weights needed)."""
    from dflashkit.data.dataset import load_dataset

    pad = int(getattr(target_config, "pad_token_id", None) or 0)
    data_dir = Path(cfg.data.dir)
    train, val = (
        pack_rows(load_dataset(data_dir, split), cfg.train.max_len, pad, f"the {split} split of {data_dir}")
        for split in ("train", "validation")
    )
    return train, val


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


def setup_run(cfg: RunConfig, *, dist: dd.Dist | None = None, target: Any = None) -> Run:
    """Everything a run needs, on this process's device (``dist`` under torchrun: see train.distributed).
    ``target``: the target when the caller has it loaded already (a fan-out's drafters share one)."""
    from dflashkit.data.dataset import read_manifest

    dist = dist if dist is not None else dd.single_process(resolve_device(cfg))
    device = dist.device
    backend = resolve_backend(cfg, device)
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    if cfg.drafter.init:
        check_checkpoint_folder(cfg.drafter.init)  # before the target loads
    if target is None:
        target = TargetModel.load(cfg.target.path, dtype=target_dtype(cfg, device), device=device)
    dc = drafter_config(cfg, target.config, target.identity())
    check_data_matches_target(manifest, target.identity(), dc, str(data_dir))
    if cfg.drafter.init:
        drafter = load_drafter(cfg.drafter.init, target, dtype=torch.float32, device=device)
    else:
        torch.manual_seed(cfg.train.seed)
        drafter = DFlashDrafter(dc).to(device)
    drafter.compiled_regions = use_compiled_regions(
        cfg, backend, dist.strategy if dist.parallel else "single"
    )
    train_rows, val_rows = load_rows(cfg, target)
    features = None
    if cfg.data.features_dir:  # offline: features and labels from `dflashkit capture`
        from dflashkit.data.features import FeatureStore, check_capture_matches

        features = FeatureStore(cfg.data.features_dir)
        check_capture_matches(
            features.manifest,
            where=cfg.data.features_dir,
            ident=target.identity(),
            layer_ids=dc.target_layer_ids,
            max_len=cfg.train.max_len,
            data_manifest=manifest,
            rows={"train": train_rows, "validation": val_rows},
        )
    check_rows(cfg, train_rows, dist.world_size)
    total = total_steps(cfg, len(train_rows), dist.world_size)
    return Run(
        cfg,
        Path(cfg.run.out_dir),
        device,
        backend,
        target,
        drafter,
        train_rows,
        val_rows,
        manifest,
        total,
        features=features,
        dist=dist,
    )


# --------------------------------------------------------------------------------------------------
# Features: online (the target runs every step), cached once per row, or offline (a capture)


def features_for(run: Run, split: str, idx: list[int], rows: Rows) -> tuple[Tensor, Tensor]:
    """Target features and argmax labels of rows ``idx`` of a split (``rows`` = those rows, on the device).

    With ``data.features_dir`` they are read from a `dflashkit capture` folder; with
    ``train.cache_features`` each row's target pass runs once and is kept (small datasets). Rows already
    in ``run.cached`` are used either way (a fan-out hands its drafters their validation features)."""
    if run.features is not None:
        return run.features.read(split, idx, rows.input_ids.device, run.target.dtype)
    layer_ids = run.feature_layer_ids or run.drafter.config.target_layer_ids
    if not run.cfg.train.cache_features and not all((split, i) in run.cached for i in idx):
        return target_pass(run.target, rows, layer_ids)
    missing = [j for j, i in enumerate(idx) if (split, i) not in run.cached]
    if missing:
        sub = Rows(*(t[missing] for t in (rows.input_ids, rows.loss_mask, rows.doc_ids, rows.position_ids)))
        feats, argmax = target_pass(run.target, sub, layer_ids)
        for k, j in enumerate(missing):
            run.cached[(split, idx[j])] = (feats[k], argmax[k])
    feats = torch.stack([run.cached[(split, i)][0] for i in idx])
    argmax = torch.stack([run.cached[(split, i)][1] for i in idx])
    return feats, argmax


def warm_up(run: Run, autocast: Any, model: torch.nn.Module | None = None) -> None:
    """Compile the flex attention of every shape this run uses (a training micro-batch forward and
    backward, an evaluation row) serially, before the loop freezes compiles (`frozen_compiles`): any later
    compile is an error, never a race or a silent dense path. Rows are padded to max_len and anchors are
    a fixed count, so these are all. ``model`` is what training steps (a DDP wrapper under torchrun; every
    rank warms up together)."""
    if run.backend != "flex" or len(run.train_rows) == 0:
        return
    g = torch.Generator().manual_seed(0)  # its own stream: warm-up must not move the training RNG
    idx = list(range(min(run.cfg.train.batch_size, len(run.train_rows))))
    rows = run.train_rows.take(idx, run.device)
    feats, argmax = features_for(run, "train", idx, rows)
    with COMPILE_LOCK:
        check_not_frozen("the training warm-up")
        out = block_step(
            model or run.drafter, run.target, rows, feats, argmax, run.cfg, run.backend, g, autocast
        )
        out.loss.loss.backward()
        run.drafter.zero_grad(set_to_none=True)
        evaluate(run, max_rows=1)


# --------------------------------------------------------------------------------------------------
# Evaluation on held-out rows


@torch.no_grad()
def blocks_at_every_anchor(
    run: Run, rows: Rows, feats: Tensor, argmax: Tensor, *, skip_empty: bool = True
) -> list[StepOutput]:
    """A block at each valid anchor of `rows` (`covering_layouts`, in passes of the warmed shape [b, N]).
    ``skip_empty=False`` runs every pass, also those without a valid anchor (ranks that must stay in step)."""
    cfg = run.cfg
    B = dd.unwrap(run.drafter).config.block_size
    g = torch.Generator(device="cpu")  # unused: the layouts give the anchors
    return [
        block_step(
            run.drafter,
            run.target,
            rows,
            feats,
            argmax,
            cfg,
            run.backend,
            g,
            autocast_context(cfg, run.device),
            layout=layout,
        )
        for layout in covering_layouts(rows.loss_mask, rows.doc_ids, cfg.train.num_anchors, B)
        if not skip_empty or bool(layout.block_valid.any())
    ]


def served_rounds(outs: list[StepOutput], row: int = 0) -> list[int]:
    """The rounds serving would make on row ``row`` of `blocks_at_every_anchor`'s blocks (`served_order_walk`)."""
    if not outs:  # no valid anchor in the row
        return []
    anchors, lengths, valid = (
        torch.cat([o.layout.anchors[row] for o in outs]).cpu(),
        torch.cat([o.lengths[row] for o in outs]).cpu(),
        torch.cat([o.layout.block_valid[row] for o in outs]).cpu(),
    )
    return served_order_walk(anchors, lengths, valid)


def evaluate(
    run: Run, max_rows: int | None = None, on_row: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Acceptance on validation rows, measured at every anchor: the mean over all blocks (`acceptance_length`)
    and the served-order acceptance length (`served_acceptance_length`, `metrics.served_order_walk`: what
    serving these rows would measure). Under torchrun the rows are dealt over the ranks and the sums reduced:
    every rank gets the result. ``on_row(done, total)`` follows the rows this process measures."""
    d = _dist(run)
    drafter = run.drafter
    was_training = drafter.training
    drafter.eval()
    n = len(run.val_rows) if max_rows is None else min(max_rows, len(run.val_rows))
    total: dict[str, Tensor] | None = None
    sums = [0.0, 0.0, 0.0, 0.0]  # loss, loss weight, served tokens, served rounds
    rows_here = list(dd.lockstep_rows(n, d))  # one row at a time: the one warmed evaluation shape
    for done, (i, counted) in enumerate(rows_here):
        if on_row is not None:
            on_row(done, len(rows_here))
        idx = [i]
        rows = run.val_rows.take(idx, run.device)
        feats, argmax = features_for(run, "validation", idx, rows)
        keep = 1 if counted else 0  # a rank short of rows ran a repeat to keep in step: count nothing
        outs = blocks_at_every_anchor(run, rows, feats, argmax, skip_empty=not d.parallel)
        for out in outs:
            total = add_stats(total, {k: v.cpu() * keep for k, v in out.stats.items()})
            sums[0] += float(out.loss.weighted_sum) * keep
            sums[1] += float(out.loss.weight_sum) * keep
        rounds = served_rounds(outs)
        sums[2] += sum(rounds) * keep
        sums[3] += len(rounds) * keep
    if on_row is not None:
        on_row(len(rows_here), len(rows_here))
    drafter.train(was_training)
    if total is not None:
        total = dd.reduce_stats(total, d)
    loss_sum, weight_sum, tokens_sum, rounds_sum = dd.sum_over_ranks(sums, d)
    result: dict[str, Any] = finalize_stats(total) if total is not None else {}
    result["served_acceptance_length"] = tokens_sum / rounds_sum if rounds_sum else float("nan")
    result["loss"] = loss_sum / weight_sum if weight_sum else float("nan")
    result["blocks"] = int(total["blocks"]) if total is not None else 0
    return result


# --------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(
    run: Run, optimizer, scheduler, step: int, cursor: dict[str, int], generator, extra
) -> Path:
    """Atomically write drafter + training state + run config + fingerprint as checkpoints/step-N.

    Under torchrun every rank calls this (FSDP gathers the full weights and optimizer state); rank 0
    writes the one checkpoint, and the ranks meet at a barrier once it is published."""
    d = _dist(run)
    root = run.out_dir / CHECKPOINTS
    name = st.step_dir_name(step)
    weights = dd.full_state_dict(run.drafter, d)
    opt = dd.checkpoint_optimizer(run.drafter, optimizer, d, gather=True)
    if d.is_main:
        with atomic_dir(root / name, checksums=True) as tmp:
            _write_weights(run, weights, tmp, torch.float32)
            st.save_training_state(
                tmp, opt, scheduler, step, cursor, st.capture_rng({"anchors": generator}), extra
            )
            (tmp / RUN_CONFIG_FILE).write_text(dump_config(run.cfg))
            fpmod.save(fpmod.collect(), tmp / fpmod.FINGERPRINT_FILE)
        st.write_latest(root, name)
        st.rotate_checkpoints(root, run.cfg.train.keep_last)
    dd.barrier(d)
    return root / name


def save_best(run: Run, step: int, metrics: dict[str, Any]) -> None:
    """Atomically write best/ (every rank calls this under torchrun; rank 0 writes)."""
    d = _dist(run)
    weights = dd.full_state_dict(run.drafter, d)
    if not d.is_main:
        return
    with atomic_dir(run.out_dir / BEST, checksums=True) as tmp:
        _write_weights(run, weights, tmp, torch.bfloat16)  # bf16 z-lab layout: what serving loads
        # data_dir: whose held-out split these numbers were measured on (eval compares like with like)
        record = {"step": step, "data_dir": str(Path(run.cfg.data.dir).resolve()), **metrics}
        (tmp / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
        fpmod.save(fpmod.collect(), tmp / fpmod.FINGERPRINT_FILE)


def _write_weights(run: Run, weights: dict[str, Tensor], folder: Path, dtype: torch.dtype) -> None:
    write_checkpoint(folder, run.drafter.config, {k: v.to(dtype) for k, v in weights.items()})


def _dist(run: Run) -> dd.Dist:
    return run.dist if run.dist is not None else dd.single_process(run.device)


def check_env_drift(ckpt: Path, allow: bool, console: Any) -> None:
    """Resuming in a changed environment shows the diff, and refuses a critical change unless allowed."""
    saved = fpmod.load(ckpt)
    changes = fpmod.diff(saved, fpmod.collect())
    if not changes:
        return
    from dflashkit.runtime.doctor import show_diff_changes

    show_diff_changes(changes, str(ckpt), "this environment", console)
    if fpmod.has_critical(changes) and not allow:
        keys = ", ".join(c.key for c in changes if c.critical)
        raise EnvironmentDriftError(
            f"the checkpoint {ckpt} was written in another environment (critical: {keys}); resume there, or "
            "pass --allow-env-drift (run.allow_env_drift=true) to continue anyway"
        )


def load_weights(drafter: DFlashDrafter, weights: dict[str, Tensor], where: Path) -> None:
    """Put a checkpoint's weights into the run's drafter; a mismatch is one clear error, never a traceback."""
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as e:
        detail = (str(e).strip().splitlines() or [""])[-1].strip()[:200]
        raise CheckpointError(
            f"{where} holds a drafter of another shape than this config makes ({detail}); resume with the "
            "run's own drafter settings, or start a new run"
        ) from None


# --------------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    steps: int
    seconds: float
    best_acceptance_length: float
    final_val: dict[str, Any]
    out_dir: Path
    losses: list[float]


def _log(path: Path, record: dict[str, Any], tensorboard: Any = None) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if tensorboard is not None:
        step = record["step"]
        for key in ("loss", "lr", "grad_norm", "acceptance_length"):
            if record.get(key) is not None:
                tensorboard.add_scalar(f"train/{key}", record[key], step)
        for key, value in record.get("val", {}).items():
            if isinstance(value, (int, float)):
                tensorboard.add_scalar(f"val/{key}", value, step)


def open_tensorboard(cfg: RunConfig, out: Path) -> Any:
    if not cfg.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.tensorboard=true needs the tensorboard package: pip install tensorboard"
        ) from None
    return SummaryWriter(str(out / "tensorboard"))


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    console: Any = None,
    stop_after: int | None = None,
    run: Run | None = None,
    features: Any = None,
    move_aside: bool = False,
) -> TrainResult:
    """Train a drafter as the config says. ``stop_after`` ends the loop early after that many steps
    (as an interruption would), leaving the checkpoints for ``resume``. Started by torchrun, each
    process trains its share of every global batch (data-parallel: see dflashkit.train.distributed).

    Without ``resume`` a run folder that holds an earlier run is refused, or, with ``move_aside``, its
    files are moved to ``<out>.old-<time>`` first (`rundir.claim_run_folder`). With ``resume`` the newest
    intact checkpoint continues, if the config keeps what it was trained with (`rundir.check_resume_config`).

    A fan-out (dflashkit.train.fanout) drives this loop in its drafter threads: ``run`` is set up, and its
    attention warmed, by the caller; ``features`` (called as ``features_for`` is) feeds each training
    micro-batch the target's features computed once for every drafter."""
    d = dd.init_distributed(cfg)
    try:
        return _train(
            cfg,
            d,
            resume=resume,
            console=console,
            stop_after=stop_after,
            run=run,
            features=features,
            move_aside=move_aside,
        )
    finally:
        dd.shutdown(d)


def find_resume_point(cfg: RunConfig, d: dd.Dist, console: Any) -> tuple[Path, st.SavedState] | None:
    """The checkpoint a resume continues from (the newest intact one, `state.pick_resume_checkpoint`) and
    its training state, checked against the config before anything slow loads. None: no checkpoint."""
    root = Path(cfg.run.out_dir) / CHECKPOINTS
    while True:
        ckpt = st.pick_resume_checkpoint(
            root, lambda m: console.print(f"[yellow]{m}[/]"), set_aside=d.is_main
        )
        if ckpt is None:
            return None
        check_resume_config(ckpt, cfg)
        try:
            return ckpt, st.read_training_state(ckpt)
        except CheckpointError as e:  # unreadable in a way its checksums could not tell: try an older one
            console.print(f"[yellow]checkpoint {ckpt.name} is damaged: {e}[/]")
            if not d.is_main:
                raise
            st.set_aside_damaged(ckpt, lambda m: console.print(f"[yellow]{m}[/]"))


def trim_metrics(path: Path, step: int) -> int:
    """Drop the records after ``step`` from metrics.jsonl (steps a resume will train again, so that they
    are not logged twice); returns how many were dropped. The file is replaced atomically."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a torn last line of a crash: dropped
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


def _train(
    cfg: RunConfig,
    d: dd.Dist,
    *,
    resume: bool,
    console: Any,
    stop_after: int | None,
    run: Run | None = None,
    features: Any = None,
    move_aside: bool = False,
) -> TrainResult:
    from rich.console import Console

    from dflashkit.train.progress import TrainProgress

    console = (console or Console()) if d.is_main else Console(quiet=True)  # rank 0 speaks
    out = Path(cfg.run.out_dir)
    # The run folder's rules first, before anything slow loads (every rank reads the same files).
    resume_point = find_resume_point(cfg, d, console) if resume else None
    if resume and resume_point is None:
        console.print(f"[yellow]no checkpoint in {out / CHECKPOINTS}: starting from scratch[/]")
    if not resume and (d.is_main or not move_aside):  # every rank refuses alike; rank 0 alone moves
        claim_run_folder(out, move_aside=move_aside, report=console.print)
    dd.barrier(d)
    latest, saved_state = resume_point if resume_point is not None else (None, None)
    if latest is not None:
        check_env_drift(latest, cfg.run.allow_env_drift, console)
    warm = run is None  # a caller that brings its run has warmed it up
    run = setup_run(cfg, dist=d) if run is None else run
    features = features or features_for
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
    tc = cfg.train
    if latest is not None:  # the full weights go in before DDP / FSDP takes the drafter
        resumed = load_drafter(latest, run.target, dtype=torch.float32, device=run.device, verify=False)
        load_weights(run.drafter, resumed.state_dict(), latest)
    model = dd.wrap_drafter(run.drafter, cfg, d).train()  # the drafter itself in one process
    params = [p for p in run.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(run.total_steps, tc.warmup_ratio, tc.min_lr_ratio)
    )
    generator = torch.Generator(device="cpu").manual_seed(tc.seed)
    step = 0
    cursor = {"epoch": 0, "index": 0}  # in global rows: the same on every rank and world size
    best = float("-inf")
    metrics_path = out / "metrics.jsonl"
    micro = d.world_size * tc.batch_size  # rows of one global micro-batch
    layout = {"world_size": d.world_size, "global_batch": micro * tc.grad_accum}

    if latest is not None and saved_state is not None:
        optimizer_io = dd.checkpoint_optimizer(run.drafter, optimizer, d, gather=False)
        state = st.apply_training_state(saved_state, optimizer_io, scheduler)
        st.restore_rng(state.rng, {"anchors": generator})
        step, cursor = state.step, dict(state.data_cursor)
        best = float(state.extra.get("best_acceptance_length", best))
        console.print(f"resumed from {latest} at step {step}")
        if d.is_main:
            trim_metrics(metrics_path, step)
        note = dd.resume_note(state.extra, d, layout["global_batch"])
        if note:
            console.print(f"[yellow]{note}[/]")
    elif d.is_main:
        (out / "config.yaml").write_text(dump_config(cfg))
        fpmod.save(fpmod.collect(), out / fpmod.FINGERPRINT_FILE)
        if metrics_path.exists():
            metrics_path.unlink()
    if d.parallel:
        console.print(
            f"data-parallel ({d.strategy}): {d.world_size} ranks x batch {tc.batch_size} x accum "
            f"{tc.grad_accum} = {layout['global_batch']} rows per step"
        )

    autocast = autocast_context(cfg, run.device)
    tensorboard = open_tensorboard(cfg, out) if d.is_main else None
    if warm:
        with portable_cache(cfg.run.compile_cache, console, save=d.is_main):
            warm_up(run, autocast, model)
    order = epoch_order(len(run.train_rows), tc.seed, cursor["epoch"])
    losses: list[float] = []
    window: dict[str, Tensor] | None = None
    t0 = time.perf_counter()
    last_val: dict[str, Any] = {}
    with frozen_compiles(), TrainProgress(run.total_steps, step, console) as progress:
        while step < run.total_steps:
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for j in range(tc.grad_accum):
                if cursor["index"] + micro > len(order):  # full batches only: one shape
                    cursor = {"epoch": cursor["epoch"] + 1, "index": 0}
                    order = epoch_order(len(run.train_rows), tc.seed, cursor["epoch"])
                positions = dd.rank_positions(cursor["index"], tc.batch_size, d)  # this rank's share
                idx = [order[p] for p in positions]
                seeds = [anchor_seed(tc.seed, cursor["epoch"], p) for p in positions]
                cursor["index"] += micro
                rows = run.train_rows.take(idx, run.device)
                feats, argmax = features(run, "train", idx, rows)
                with dd.gradient_sync(model, d, sync=j == tc.grad_accum - 1):
                    out_step = block_step(
                        model,
                        run.target,
                        rows,
                        feats,
                        argmax,
                        cfg,
                        run.backend,
                        generator,
                        autocast,
                        seeds=seeds,
                    )
                    lo = out_step.loss
                    loss, share = dd.global_loss(lo.weighted_sum, lo.weight_sum, lo.loss, d)
                    (loss / tc.grad_accum).backward()
                step_loss += share / tc.grad_accum
                window = add_stats(window, {k: v.cpu() for k, v in out_step.stats.items()})
            (step_loss,) = dd.sum_over_ranks([step_loss], d)
            grad_norm = dd.grad_norm_value(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(step_loss)
            if not math.isfinite(step_loss):
                raise ConfigError(
                    f"the loss became {step_loss} at step {step}; lower train.lr or check the data"
                )

            record: dict[str, Any] | None = None
            if step % tc.log_every == 0 or step == run.total_steps:
                m = finalize_stats(dd.reduce_stats(window, d)) if window is not None else {}
                record = {
                    "step": step,
                    "loss": step_loss,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "acceptance_length": m.get("acceptance_length"),
                    "per_position_accuracy": m.get("per_position_accuracy"),
                    "seconds": round(time.perf_counter() - t0, 2),
                }
                window = None
            if step % tc.eval_every == 0 or step == run.total_steps:
                last_val = evaluate(run, on_row=progress.evaluating)  # the same numbers on every rank
                progress.evaluated()
                record = (record or {"step": step}) | {"val": last_val}
                if served_tau(last_val) > best:  # chosen by what serving will measure
                    best = served_tau(last_val)
                    save_best(run, step, last_val)
            if record is not None and d.is_main:
                _log(metrics_path, record, tensorboard)
            if (
                step % tc.save_every == 0
                or step == run.total_steps
                or (stop_after is not None and step >= stop_after)
            ):
                save_checkpoint(
                    run,
                    optimizer,
                    scheduler,
                    step,
                    cursor,
                    generator,
                    {"best_acceptance_length": best, **layout},
                )
            progress.update(step, step_loss, record, best)
            if stop_after is not None and step >= stop_after:
                break
    if tensorboard is not None:
        tensorboard.close()
    if d.is_main:
        plot_training(metrics_path, out / "training.png")
    return TrainResult(step, time.perf_counter() - t0, best, last_val, out, losses)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in step order, one per step: where a step was logged twice (a run
    resumed by an older dflashkit trained it again) the later record wins; a torn line is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def plot_training(metrics_path: Path, png: Path) -> Path | None:
    """Loss and acceptance length (training batches and held-out) over steps, as one PNG."""
    if not metrics_path.is_file():
        return None
    from matplotlib.figure import Figure  # not pyplot: its global state is not for threads (fan-out)

    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("loss") is not None]
    val = [r for r in records if "val" in r]
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], color="#3b7dd8")
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted block cross-entropy")
    ax2.plot(
        [r["step"] for r in train],
        [r["acceptance_length"] for r in train],
        label="training batches",
        color="#3b7dd8",
    )
    ax2.plot(
        [r["step"] for r in val],
        [r["val"]["acceptance_length"] for r in val],
        "o-",
        label="held-out, mean over anchors",
        color="#d8663b",
    )
    ax2.plot(
        [r["step"] for r in val],
        [served_tau(r["val"]) for r in val],
        "s--",
        label="held-out, served order (what serving measures)",
        color="#2a9d5c",
    )
    ax2.set_xlabel("step")
    ax2.set_ylabel("exact block acceptance length")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png

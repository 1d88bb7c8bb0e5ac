"""One training step on one micro-batch: anchors -> blocks -> drafter -> chunked, position-weighted loss,
and the exact acceptance length of every block.

`block_step` is the step every placement runs (one process, torchrun ranks, a fan-out's drafter
threads) and the held-out evaluation runs it too, at anchors it gives (`covering_layouts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflashkit.attention.masks import BlockLayout
from dflashkit.config import RunConfig
from dflashkit.data.rows import Rows
from dflashkit.model.acceptance import acceptance_stats, block_lengths
from dflashkit.model.drafter import DFlashDrafter, build_block_masks
from dflashkit.target.hf import TargetModel
from dflashkit.train.anchors import block_inputs, block_labels, block_positions, label_states, sample_anchors
from dflashkit.train.distributed import unwrap
from dflashkit.train.loss import LossMix, LossOutput, dflash_loss, serving_acceptance
from dflashkit.train.sources import split_features


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


@dataclass
class StepOutput:
    loss: LossOutput
    stats: dict[str, Tensor]
    layout: BlockLayout
    lengths: Tensor  # [b, N]: each block's exact acceptance length (padding blocks included)
    mask: Tensor  # [b, N*B]: the trained slots (`block_labels`)
    # With ``serving=True`` and train.serve_temperature > 0: each slot's acceptance probability at that
    # temperature under train.serve_draft_sampling, and the target's top probability, [b, N*B] each.
    accept: Tensor | None = None
    top_probability: Tensor | None = None


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
    serving: bool = False,
) -> StepOutput:
    """Anchors -> blocks -> drafter -> chunked weighted loss, for one micro-batch. ``drafter`` may be a
    DDP wrapper; ``seeds`` (one per row) make each row's anchors its own draw (`draw_anchors`); ``layout``
    gives the anchors instead (evaluation's `covering_layouts`); ``serving`` (evaluation) adds each slot's
    acceptance probability at train.serve_temperature when that is above 0. ``features`` are those of the run's
    `feature_layers`: with a distribution loss, the target's last layer beside the drafter's, whose output through
    the target's final norm gives the loss the target's whole distribution at each slot."""
    config = unwrap(drafter).config
    B = config.block_size
    if layout is None:
        layout = draw_anchors(rows, cfg.train.num_anchors, B, generator, seeds)
    ids = block_inputs(rows.input_ids, layout, config.mask_token_id)
    positions = block_positions(rows.position_ids, layout)
    labels, label_mask = block_labels(
        layout, argmax, rows.input_ids, rows.loss_mask, use_dataset_tokens=cfg.train.labels == "dataset"
    )
    masks = build_block_masks(config, layout, backend)
    context, last = split_features(features, cfg, config)
    with autocast:
        target_hidden = None if last is None else target.final_norm(label_states(layout, last))
        hidden = drafter(context, target.embed(ids), rows.position_ids, positions, masks, backend)
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
            compiled=unwrap(drafter).compiled_regions,
            target_hidden=target_hidden,
            mix=LossMix.of(cfg.train.loss_weights(), cfg.train.loss_temperature),
        )
        accept = top = None
        t = cfg.train
        if serving and t.serve_temperature > 0 and target_hidden is not None:
            accept, top = serving_acceptance(
                hidden,
                target_hidden,
                target.lm_head_weight(),
                B,
                t.chunk_blocks,
                t.serve_temperature,
                t.serve_draft_sampling,
            )
    lengths = block_lengths(out.predictions, labels, label_mask, B)
    stats = acceptance_stats(out.predictions, labels, label_mask, layout.block_valid, B, lengths)
    return StepOutput(out, stats, layout, lengths, label_mask, accept, top)

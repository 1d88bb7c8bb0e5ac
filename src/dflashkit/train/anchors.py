"""Anchors and blocks: where the drafter's blocks sit in a training row, and what each slot sees and learns.

A training row is T context positions (one or more packed documents). Each step we draw N anchors per row;
block j is B query slots [token@anchor_j, MASK x (B-1)] at positions anchor_j + 0..B-1, and slot k >= 1 learns
the token at position anchor_j + k (slot 0 holds the anchor's own token and is never trained).

The anchor rule (`valid_anchor_positions`): position a may be an anchor iff
  - a + 1 < T,
  - loss_mask[a] and loss_mask[a + 1] are both True (the anchor is a response token, as at serving, and
    slot 1 has a label), and
  - doc_ids[a] == doc_ids[a + 1] >= 0 (both in the same real document).
A block may run past the end of its document (or row): the slots beyond are simply not trained
(see `block_labels`). We do not require the whole block a..a+B-1 to fit in the document: that rule
would never let slots 1..B-2 learn the last tokens of a response (end-of-turn included), which is exactly
where serving drafts them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflashkit.attention.masks import BlockLayout


def valid_anchor_positions(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """Positions that may be anchors (the rule in the module docstring). [b, T] bool -> [b, T] bool."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    here, nxt = loss_mask[:, :-1].bool(), loss_mask[:, 1:].bool()
    same_doc = (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    valid[:, :-1] = here & nxt & same_doc
    return valid


def sample_anchors(
    loss_mask: Tensor,
    doc_ids: Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> BlockLayout:
    """Draw `num_anchors` anchors per row, uniformly without replacement among valid positions, sorted.

    loss_mask: [b, T] bool, True on supervised (response) tokens.
    doc_ids:   [b, T] long, document id per position; -1 marks padding.
    Returns a BlockLayout with anchors [b, N] (non-decreasing per row) and block_valid [b, N].
    A row with fewer than N valid positions takes all of them; its remaining blocks are padding blocks
    (block_valid False) placed last, with anchor T - 1 so that every index stays in range and the row stays
    sorted. Draws are fresh on every call and depend only on `generator` (same generator state, same anchors).
    """
    if num_anchors < 1 or block_size < 2:
        raise ValueError(f"need num_anchors >= 1 and block_size >= 2 (got {num_anchors}, {block_size})")
    b, T = loss_mask.shape
    valid = valid_anchor_positions(loss_mask, doc_ids)
    gen_device = generator.device if generator is not None else loss_mask.device
    scores = torch.rand(b, T, generator=generator, device=gen_device).to(loss_mask.device)
    # The k smallest of i.i.d. uniform scores form a uniformly random k-subset; invalid positions score 2.
    scores = scores.masked_fill(~valid, 2.0)
    take = min(num_anchors, T)
    picked = scores.topk(take, dim=1, largest=False).indices  # [b, take]
    picked_valid = torch.gather(valid, 1, picked)
    # Sort valid picks ascending; invalid picks get the key T so they land last.
    keys = torch.where(picked_valid, picked, torch.full_like(picked, T)).sort(dim=1).values
    if take < num_anchors:
        keys = torch.cat([keys, keys.new_full((b, num_anchors - take), T)], dim=1)
    block_valid = keys < T
    anchors = keys.clamp(max=T - 1)
    return BlockLayout(anchors=anchors, block_valid=block_valid, doc_ids=doc_ids, block_size=block_size)


def covering_layouts(
    loss_mask: Tensor, doc_ids: Tensor, num_anchors: int, block_size: int
) -> list[BlockLayout]:
    """Every valid anchor of every row, in order, dealt into layouts of `num_anchors` anchors per row.

    Evaluation uses this to measure a block at each position a drafter could be asked to draft from, which the
    served-order acceptance length needs (`metrics.served_order_walk`). Always ceil(T / num_anchors) layouts for
    rows of length T, whatever the rows hold, so that ranks evaluating different rows stay in step and every
    layout has the warmed shape [b, num_anchors]; unused blocks are padding blocks, as in `sample_anchors`."""
    if num_anchors < 1 or block_size < 2:
        raise ValueError(f"need num_anchors >= 1 and block_size >= 2 (got {num_anchors}, {block_size})")
    b, T = loss_mask.shape
    valid = valid_anchor_positions(loss_mask, doc_ids)
    passes = -(-T // num_anchors)
    # positions in order, invalid ones keyed T so that a stable sort puts them last
    pos = torch.arange(T, device=loss_mask.device).expand(b, T)
    keys = torch.where(valid, pos, torch.full_like(pos, T)).sort(dim=1, stable=True).values
    keys = torch.cat([keys, keys.new_full((b, passes * num_anchors - T), T)], dim=1)
    layouts = []
    for k in range(passes):
        part = keys[:, k * num_anchors : (k + 1) * num_anchors]
        layouts.append(
            BlockLayout(
                anchors=part.clamp(max=T - 1), block_valid=part < T, doc_ids=doc_ids, block_size=block_size
            )
        )
    return layouts


def block_indices(layout: BlockLayout) -> Tensor:
    """Context position of every block slot, anchor + k: [b, N*B] long (may exceed T - 1 near the end)."""
    k = torch.arange(layout.block_size, device=layout.anchors.device)
    return (layout.anchors[:, :, None] + k).reshape(layout.batch, layout.q_len)


def block_inputs(input_ids: Tensor, layout: BlockLayout, mask_token_id: int) -> Tensor:
    """Block token ids [b, N*B]: [token@anchor, MASK x (B-1)] per block; all MASK for padding blocks.

    input_ids: [b, T] long.
    """
    ids = torch.full(
        (layout.batch, layout.num_blocks, layout.block_size),
        mask_token_id,
        dtype=input_ids.dtype,
        device=input_ids.device,
    )
    anchor_tok = torch.gather(input_ids, 1, layout.anchors)
    ids[:, :, 0] = torch.where(layout.block_valid, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    return ids.reshape(layout.batch, layout.q_len)


def block_positions(position_ids: Tensor, layout: BlockLayout) -> Tensor:
    """RoPE positions of the block slots [b, N*B]: position_ids[anchor] + k.

    position_ids: [b, T] long, the target's positions (per document when rows are packed).
    """
    k = torch.arange(layout.block_size, device=position_ids.device)
    anchor_pos = torch.gather(position_ids, 1, layout.anchors)
    return (anchor_pos[:, :, None] + k).reshape(layout.batch, layout.q_len)


def block_labels(
    layout: BlockLayout,
    target_argmax: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    use_dataset_tokens: bool = False,
) -> tuple[Tensor, Tensor]:
    """What each block slot learns, and which slots are trained.

    target_argmax: [b, T] long, argmax of the target's logits at each position, i.e. its prediction for the
                   token at position p + 1.
    input_ids:     [b, T] long; loss_mask: [b, T] bool.
    Slot k of the block at anchor a learns the token at position a + k: the target's own prediction for it,
    target_argmax[a + k - 1], or the dataset token input_ids[a + k] when `use_dataset_tokens`.
    Returns labels [b, N*B] long (0 where not trained) and mask [b, N*B] bool, True iff the block is valid,
    k >= 1, a + k < T, loss_mask[a + k], and a + k lies in the anchor's document.
    """
    T = input_ids.shape[1]
    B = layout.block_size
    pos = block_indices(layout)  # [b, N*B], position a + k
    inside = pos < T
    pos_c = pos.clamp(max=T - 1)
    slot = torch.arange(B, device=pos.device).repeat(layout.num_blocks)  # [N*B], k per slot
    anchor_doc = torch.gather(layout.doc_ids, 1, layout.anchors).repeat_interleave(B, dim=1)
    same_doc = torch.gather(layout.doc_ids, 1, pos_c) == anchor_doc
    mask = (
        layout.block_valid.repeat_interleave(B, dim=1)
        & (slot >= 1)
        & inside
        & torch.gather(loss_mask.bool(), 1, pos_c)
        & same_doc
    )
    if use_dataset_tokens:
        labels = torch.gather(input_ids, 1, pos_c)
    else:
        labels = torch.gather(target_argmax, 1, (pos - 1).clamp(0, T - 1))
    return torch.where(mask, labels, torch.zeros_like(labels)), mask


def label_states(layout: BlockLayout, states: Tensor) -> Tensor:
    """The target's state that predicts each block slot's token: states[a + k - 1] for slot k of the block at
    anchor a (where `block_labels` reads the target's argmax), clamped to the row. states: [b, T, H] ->
    [b, N*B, H]."""
    T = states.shape[1]
    pos = (block_indices(layout) - 1).clamp(0, T - 1)
    return torch.gather(states, 1, pos[:, :, None].expand(-1, -1, states.shape[-1]))

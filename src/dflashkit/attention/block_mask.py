"""The flex BlockMask of the DFlash training mask, built from the anchors at tile level.

flex_attention skips whole tiles of T x T (query rows x keys, T = 128). A BlockMask lists, for each query
tile, the key tiles that are *full* (every pair visible: no mask_mod call) and *partial* (some pairs
visible: mask_mod decides). `torch.nn.attention.flex_attention.create_block_mask` finds them by evaluating
the mask on every (query, key) pair, a [batch, H, Q, KV] tensor: 8.6 G pairs at S=16384, N=1024, B=16.

Here the tiles come straight from the anchors. Every query row r = (block j, slot k) sees two intervals
of keys:

- context [lo, anchor_j): `lo` is where the anchor's document starts, raised by the sliding window;
- its own block [S + j*B, S + j*B + B) (or up to slot k when the block is in-block causal), from slot
  k - window + 1 on for a sliding layer.

A row *touches* the tiles its intervals overlap and *covers* the tiles they contain. Summed over the
rows of a query tile with difference arrays (a +1 where a run of tiles starts, a -1 past its end, then a
cumulative sum), a key tile is full when all T rows cover it and partial when some row touches it and
it is not full. Memory is O(batch * (Q + Q/T * KV/T)), never O(Q * KV).

Documents need not be contiguous: a row's context interval for *touching* starts at the first position
of the anchor's document (a superset, refined by the mask_mod), while *covering* uses the contiguous run
that holds the anchor (every key in it is in the document). For packed rows, where each document is one
run, both are the same and the result equals create_block_mask's tile for tile.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from dflashkit.attention.masks import BlockLayout, dflash_mask_mod

TILE = 128  # flex_attention's default sparse block size (query rows and keys per tile)


def document_starts(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each context position: the start of its contiguous run of equal doc ids, and the first
    position anywhere in the row with the same doc id. Both [batch, S] long."""
    batch, S = doc_ids.shape
    pos = torch.arange(S, device=doc_ids.device).expand(batch, S)
    new_run = torch.ones_like(doc_ids, dtype=torch.bool)
    new_run[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.where(new_run, pos, 0).cummax(dim=1).values

    # First occurrence: sort positions by doc id (stable, so each group starts at its smallest position).
    order = torch.argsort(doc_ids, dim=1, stable=True)
    sorted_docs = doc_ids.gather(1, order)
    new_group = torch.ones_like(sorted_docs, dtype=torch.bool)
    new_group[:, 1:] = sorted_docs[:, 1:] != sorted_docs[:, :-1]
    group_start = torch.where(new_group, pos, 0).cummax(dim=1).values
    first = torch.empty_like(order).scatter_(1, order, order.gather(1, group_start))
    return run_start, first


def _row_intervals(
    layout: BlockLayout, window: int | None, causal_in_block: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per query row [batch, Q]: context start for touching, for covering, context end, block start, end."""
    Bs, S, N = layout.block_size, layout.context_len, layout.num_blocks
    dev = layout.anchors.device
    run_start, first = document_starts(layout.doc_ids)
    a = layout.anchors.clamp(0, S - 1)
    anchor_doc = layout.doc_ids.gather(1, a)
    sees_ctx = layout.block_valid & (anchor_doc >= 0)  # [batch, N]

    k = torch.arange(Bs, device=dev)
    a_rows = a[:, :, None].expand(-1, -1, Bs)  # [batch, N, B]
    lo_touch = first.gather(1, a)[:, :, None].expand(-1, -1, Bs)
    lo_cover = run_start.gather(1, a)[:, :, None].expand(-1, -1, Bs)
    if window is not None:
        lo_window = a_rows + k - window + 1
        lo_touch = torch.maximum(lo_touch, lo_window)
        lo_cover = torch.maximum(lo_cover, lo_window)
    ctx_end = torch.where(sees_ctx[:, :, None], a_rows, 0)

    blk_first = S + torch.arange(N, device=dev)[:, None] * Bs  # [N, 1]
    blk_end = blk_first + (k + 1 if causal_in_block else torch.full_like(k, Bs))  # [N, B]
    blk_start = blk_first + ((k - window + 1).clamp(min=0) if window is not None else torch.zeros_like(k))
    blk_end = torch.where(layout.block_valid[:, :, None], blk_end, blk_start)
    blk_start = blk_start.expand_as(blk_end)

    def rows(x: Tensor) -> Tensor:
        return x.reshape(layout.batch, N * Bs)

    return rows(lo_touch), rows(lo_cover), rows(ctx_end), rows(blk_start), rows(blk_end)


def _tile_counts(
    q_tile: Tensor, starts: list[Tensor], ends: list[Tensor], n_q_tiles: int, n_kv_tiles: int
) -> Tensor:
    """Count, per (query tile, key tile), the rows whose tile range [start, end) includes the key tile.
    Empty ranges (end <= start) add nothing. Returns [batch, n_q_tiles, n_kv_tiles] int32."""
    batch = q_tile.shape[0]
    width = n_kv_tiles + 1
    diff = torch.zeros(batch, n_q_tiles * width, dtype=torch.int32, device=q_tile.device)
    for start, end in zip(starts, ends, strict=True):
        keep = (end > start).to(torch.int32)
        diff.scatter_add_(1, q_tile * width + start.clamp(max=n_kv_tiles), keep)
        diff.scatter_add_(1, q_tile * width + end.clamp(max=n_kv_tiles), -keep)
    return diff.view(batch, n_q_tiles, width).cumsum(dim=-1, dtype=torch.int32)[..., :n_kv_tiles]


def tile_masks(
    layout: BlockLayout, window: int | None = None, causal_in_block: bool = False, tile: int = TILE
) -> tuple[Tensor, Tensor]:
    """(partial, full): [batch, Q/T, KV/T] bool tile maps of the DFlash mask (T = tile, rounded up)."""
    Q, KV = layout.q_len, layout.kv_len
    n_q, n_kv = -(-Q // tile), -(-KV // tile)
    lo_touch, lo_cover, ctx_end, blk_start, blk_end = _row_intervals(layout, window, causal_in_block)
    q_tile = (torch.arange(Q, device=ctx_end.device) // tile).expand_as(ctx_end)

    # Touched tiles: [first tile, last tile] of each interval. A context run and the block can share
    # one tile (when S is not a multiple of T); start the block's run after it so a row counts once.
    ctx_nonempty = ctx_end > lo_touch
    ctx_first = lo_touch.clamp(min=0) // tile
    ctx_stop = torch.where(ctx_nonempty, (ctx_end - 1) // tile + 1, ctx_first)
    blk_first = torch.where(ctx_nonempty, torch.maximum(blk_start // tile, ctx_stop), blk_start // tile)
    blk_stop = torch.where(blk_end > blk_start, (blk_end - 1) // tile + 1, blk_first)
    touched = _tile_counts(q_tile, [ctx_first, blk_first], [ctx_stop, blk_stop], n_q, n_kv)

    # Covered tiles: those lying wholly inside an interval, [ceil(start / T), floor(end / T)).
    def covered(start: Tensor, end: Tensor) -> tuple[Tensor, Tensor]:
        return -(-start.clamp(min=0) // tile), end // tile

    c0, c1 = covered(lo_cover, ctx_end)
    b0, b1 = covered(blk_start, blk_end)
    cover = _tile_counts(q_tile, [c0, b0], [c1, b1], n_q, n_kv)

    full = cover == tile  # all T rows cover it; edge tiles (fewer than T rows or keys) never qualify
    partial = (touched > 0) & ~full
    return partial, full


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[batch, Qt, KVt] bool -> (num_blocks [batch, 1, Qt], indices [batch, 1, Qt, KVt]) int32, the
    listed tiles first in increasing order (the order create_block_mask uses)."""
    t = tiles[:, None].to(torch.int32)
    num = t.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def flex_block_mask(
    layout: BlockLayout, window: int | None = None, causal_in_block: bool = False, tile: int = TILE
) -> BlockMask:
    """The flex BlockMask of the DFlash mask (`dflash_mask_mod` decides inside partial tiles). One
    BlockMask serves every head (H = 1)."""
    partial, full = tile_masks(layout, window, causal_in_block, tile)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tile,
        mask_mod=dflash_mask_mod(layout, window=window, causal_in_block=causal_in_block),
        seq_lengths=(layout.q_len, layout.kv_len),
    )

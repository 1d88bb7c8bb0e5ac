"""The DFlash training mask.

Queries are N blocks of B slots (block j starts at anchor_j); keys are [S context tokens | N*B block
tokens], context first. A query of block j sees

- context position s iff s < anchor_j (strictly: the anchor's own feature is not visible; its token
  is slot 0 of the block), s is in the anchor's document, and s is not padding (doc id -1);
- every slot of its own block (bidirectional), and no slot of any other block.

Invalid (padding) blocks see nothing. A sliding layer (``window`` W) also requires every key, context
or block, to be within W positions of the query: with the query at position q = anchor_j + k (slot k)
and the key at p (slot k' of the block is at anchor_j + k'), q - p < W. ``causal_in_block=True`` keeps
k' <= k inside the block.

Sliding layers are trained with ``causal_in_block=True``: together with the window that is causal
sliding-window attention over positions (q - W < p <= q), the rule vLLM and z-lab's reference apply to a
DFlash drafter's sliding layers when its config sets no ``causal`` override (SGLang's draft model has no
sliding window; docs/serving.md, "Attention semantics"). Full layers see the whole block, as every engine
serves them.

`dflash_mask_mod` is the flex_attention form (a function of scalar indices, vmapped by flex);
`dense_mask` is the boolean reference with the same semantics, built with broadcasting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of one training batch sit.

    anchors:     [batch, N] long, the context position of each block's anchor (sorted per row).
    block_valid: [batch, N] bool, False for padding blocks (they see nothing and are not trained).
    doc_ids:     [batch, S] long, document id of each context position; -1 marks padding.
    block_size:  B, the slots per block.
    """

    anchors: Tensor
    block_valid: Tensor
    doc_ids: Tensor
    block_size: int

    @property
    def batch(self) -> int:
        return self.anchors.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def context_len(self) -> int:
        return self.doc_ids.shape[1]

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len


def dflash_mask_mod(layout: BlockLayout, window: int | None = None, causal_in_block: bool = False):
    """flex_attention mask_mod for the DFlash training mask (same semantics as `dense_mask`)."""
    B = layout.block_size
    S = layout.context_len
    anchors, valid, docs = layout.anchors, layout.block_valid, layout.doc_ids
    # Index tensors for the anchor's document; clamp keeps padding anchors in range (they are invalid).
    anchor_doc = torch.gather(docs, 1, anchors.clamp(0, S - 1))

    N = layout.num_blocks

    def mask_mod(b, h, q_idx, kv_idx):
        # Kernels may evaluate padded rows and keys of edge tiles: clamp every index used to gather.
        j = torch.clamp(q_idx // B, max=N - 1)
        k = q_idx % B
        a = anchors[b, j]
        ctx_doc = docs[b, torch.clamp(kv_idx, max=S - 1)]
        sees_ctx = (kv_idx < S) & (kv_idx < a) & (ctx_doc == anchor_doc[b, j]) & (ctx_doc >= 0)
        if window is not None:
            sees_ctx = sees_ctx & (a + k - kv_idx < window)
        # Block j's keys are S + j*B ... S + j*B + B - 1, and slot k's own key is S + q_idx. (Plain
        # comparisons on kv_idx: a clamp or division of kv_idx breaks compiled create_block_mask.)
        block_start = S + q_idx - k
        block_end = S + q_idx + 1 if causal_in_block else block_start + B
        sees_block = (kv_idx >= block_start) & (kv_idx < block_end)
        if window is not None:  # slot k' of the block is at position a + k': (a + k) - (a + k') < window
            sees_block = sees_block & (S + q_idx - kv_idx < window)
        return valid[b, j] & (sees_ctx | sees_block)

    # Names the mask family for the compile runtime's shape keys (window and in-block causality are
    # constants of the compiled graph).
    mask_mod.kind = f"dflash(window={window}, causal_in_block={causal_in_block})"  # type: ignore[attr-defined]
    return mask_mod


def dense_mask(layout: BlockLayout, window: int | None = None, causal_in_block: bool = False) -> Tensor:
    """Boolean reference mask [batch, 1, N*B, S + N*B] (True = may attend). O(Q*KV) memory: small shapes only."""
    Bs = layout.block_size
    S = layout.context_len
    N = layout.num_blocks
    dev = layout.anchors.device
    a = layout.anchors  # [b, N]
    docs = layout.doc_ids  # [b, S]
    anchor_doc = torch.gather(docs, 1, a.clamp(0, S - 1))  # [b, N]
    k = torch.arange(Bs, device=dev)
    s = torch.arange(S, device=dev)

    # context part [b, N, B, S]
    ctx = (
        (s[None, None, :] < a[:, :, None])
        & (docs[:, None, :] == anchor_doc[:, :, None])
        & (docs[:, None, :] >= 0)
    )
    ctx = ctx[:, :, None, :].expand(-1, -1, Bs, -1)
    if window is not None:
        qpos = a[:, :, None] + k[None, None, :]  # [b, N, B]
        ctx = ctx & (qpos[..., None] - s[None, None, None, :] < window)

    # block part [b, N, B, N, B]: own block only
    same = torch.eye(N, dtype=torch.bool, device=dev)[None, :, None, :, None]
    inblock = (
        (k[None, :] <= k[:, None]) if causal_in_block else torch.ones(Bs, Bs, dtype=torch.bool, device=dev)
    )
    if window is not None:
        inblock = inblock & (k[:, None] - k[None, :] < window)
    blk = same & inblock[None, None, :, None, :]
    blk = blk.expand(layout.batch, -1, -1, -1, -1)

    m = torch.cat([ctx.reshape(layout.batch, N * Bs, S), blk.reshape(layout.batch, N * Bs, N * Bs)], dim=-1)
    m = m & layout.block_valid.repeat_interleave(Bs, dim=1)[:, :, None]
    return m[:, None]

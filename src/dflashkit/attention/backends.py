"""Three attention backends behind one function, with GQA.

- ``eager``: explicit softmax, the reference (fp32 math).
- ``sdpa``: ``scaled_dot_product_attention`` with the dense boolean mask (the CPU default for small shapes).
- ``flex``: compiled flex_attention with a BlockMask (the GPU default), only ever through
  ``dflashkit.attention.flex`` (one compiled entry, never a silent dense path). The BlockMask is built
  from the anchors at tile level (``dflashkit.attention.block_mask``), never from a dense mask.

Shapes: q [batch, Hq, Q, D]; k, v [batch, Hkv, KV, D] with Hq a multiple of Hkv.
A mask of None means "every query sees every key" (the inference path: one block over its context);
flex and sdpa then both run sdpa without a mask (a fused kernel, no score matrix).
Rows that see nothing (padding blocks) return zeros, with zero gradient, in every backend.
Dense paths (eager always, sdpa with a mask) pass ``preflight_dense`` first: no silent 50 GiB matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.dense_budget import preflight_dense
from dflashkit.attention.flex import flex_attention_entry
from dflashkit.attention.masks import BlockLayout, dense_mask

Backend = Literal["flex", "sdpa", "eager"]
BACKENDS: tuple[str, ...] = ("flex", "sdpa", "eager")


@dataclass(frozen=True)
class AttentionMask:
    """A mask built once per step and shared by every layer. ``dense`` for sdpa/eager, ``block`` for flex."""

    backend: str
    dense: Tensor | None = None  # [batch, 1, Q, KV] bool
    block: Any = None  # flex BlockMask
    rows_visible: Tensor | None = None  # [batch, 1, Q, 1] bool: rows that see at least one key


def build_mask(
    layout: BlockLayout, backend: str, *, window: int | None = None, causal_in_block: bool = False
) -> AttentionMask:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "flex":
        return AttentionMask(
            "flex", block=flex_block_mask(layout, window=window, causal_in_block=causal_in_block)
        )
    preflight_dense(
        layout.batch,
        1,
        layout.q_len,
        layout.kv_len,
        what=f"{backend} attention mask",
        device=layout.anchors.device,
    )
    m = dense_mask(layout, window=window, causal_in_block=causal_in_block)
    return AttentionMask(backend, dense=m, rows_visible=m.any(-1, keepdim=True))


def _expand_kv(x: Tensor, hq: int) -> Tensor:
    rep = hq // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, scale: float) -> Tensor:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        # Rows that see nothing get a harmless all-visible mask, then a zero output (and zero gradient).
        allowed = mask.dense | ~mask.rows_visible
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()
    if mask is not None:
        out = out * mask.rows_visible
    return out.to(q.dtype)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, scale: float) -> Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv)
    allowed = mask.dense | ~mask.rows_visible
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=hq != hkv)
    return out * mask.rows_visible


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, *, backend: str, scale: float | None = None
) -> Tensor:
    """Attention of q over (k, v) under ``mask`` with the chosen backend. Output [batch, Hq, Q, D]."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if mask is not None and mask.backend != backend:
        raise ValueError(f"mask was built for backend {mask.backend!r} but attention runs {backend!r}")
    if backend == "flex":
        if mask is None:
            return sdpa_attention(q, k, v, None, scale)
        return flex_attention_entry(q, k, v, mask.block, scale=scale)
    if backend == "eager" or mask is not None:
        batch, heads, q_len = q.shape[:3]
        preflight_dense(batch, heads, q_len, k.shape[2], what=f"{backend} attention", device=q.device)
    if backend == "eager":
        return eager_attention(q, k, v, mask, scale)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, mask, scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")

"""The drafter's step through the decoder kernels, for the graphs engine's Triton layers.

A DFlash drafter's layer is a Qwen3 decoder layer whose block of B slots attends to the context rows before
its anchor and to every slot of the block, both ways. That is the target's decoder layer over B new tokens
under a mask among them that marks them all (``kernels.decoder``' tree mask, all ones), so the target's six
kernels a layer run it: the drafter's layers fused and reordered as the target's are
(``slot_decoder.fused_layer``), its keys and values in a cache of the kernels' layout (its own: the keys'
head dims in the kernels' rotary order, which only these kernels read). A draft step is then

1. the context rows: the fused features through ``fc`` (one matmul), then each layer's keys and values of
   ``hidden_norm`` of them written at their positions (one qkv launch for every layer's key and value
   columns);
2. the block: the target's embedding of [anchor, mask x (B-1)], each layer in six kernels, the drafter's final
   norm and the target's head over the drafted slots,

about 6 x layers + 8 launches (26 for the served 3-layer drafter, measured; the compiled draft step: ~46
kernels for 2 layers). Not for drafters with sliding-window layers (``unsupported_drafter``; the engine keeps
the compiled draft step for those).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.infer.kernels.decoder import (
    KeyValueWeights,
    Tiles,
    decode_by_kernels,
    key_value_weights,
    unsupported,
    write_keys_values,
)
from dflashkit.model.drafter import DFlashDrafter, rope_inverse_frequencies
from dflashkit.target.slot_decoder import (
    DecoderWeights,
    SlotCache,
    apply_rotary,
    fused_layer,
    linear,
    rms_norm,
    rotary_table,
)


@dataclass
class DraftKernels:
    """A drafter as the decoder kernels run it: its layers as a ``DecoderWeights`` (the target's embedding and
    head, the drafter's final norm and rotary table), ``fc``, ``hidden_norm`` and every layer's key and value
    rows stacked (``kv``) for the context rows, its keys and values (``cache``: one slot of the engine's
    capacity), the block's mask (all ones) and the kernels' tiles (the target's block step's;
    ``benchmarks/draft_tiles.py`` measures others on the draft step)."""

    weights: DecoderWeights
    fc: Tensor  # [hidden, n * hidden]
    hidden_norm: Tensor  # [hidden]
    kv: KeyValueWeights
    cache: SlotCache
    seen: Tensor  # [B, B] int8, all ones: every slot reads every slot
    tiles: Tiles = field(default_factory=Tiles)


def unsupported_drafter(drafter: DFlashDrafter) -> str | None:
    """Why the kernels cannot run this drafter's step (None: they can)."""
    if any(layer.layer_type != "full_attention" for layer in drafter.layers):
        return "sliding-window layers"
    return None


def draft_kernels(drafter: DFlashDrafter, target: DecoderWeights, capacity: int) -> DraftKernels:
    """The drafter's weights for the kernels (copies of its projections, fused and reordered) and an empty
    cache of ``capacity`` positions. Raises ValueError for a drafter or shape the kernels cannot run."""
    why = unsupported_drafter(drafter)
    if why:
        raise ValueError(f"the decoder kernels cannot run this drafter ({why})")
    cfg = drafter.config
    dtype = target.dtype  # the engine's: a drafter loaded in another is cast, as its compiled step casts
    layers = []
    with torch.no_grad():
        for layer in drafter.layers:
            at, mlp = layer.self_attn, layer.mlp
            parts: dict[str, Tensor | None] = {
                "input_norm": layer.input_layernorm.weight,
                "q": at.q_proj.weight,
                "k": at.k_proj.weight,
                "v": at.v_proj.weight,
                "q_bias": None,
                "k_bias": None,
                "v_bias": None,
                "q_norm": at.q_norm.weight,
                "k_norm": at.k_norm.weight,
                "o": at.o_proj.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "gate": mlp.gate_proj.weight,
                "up": mlp.up_proj.weight,
                "down": mlp.down_proj.weight,
            }
            parts = {k: None if v is None else v.detach().to(dtype) for k, v in parts.items()}
            layers.append(fused_layer(parts, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim))
        inv_freq, scaling = rope_inverse_frequencies(cfg)
        rotary = rotary_table(inv_freq.to(target.device), scaling, capacity)
    weights = DecoderWeights(
        embed=target.embed,
        layers=layers,
        norm=drafter.norm.weight.detach().to(dtype),
        lm_head=target.lm_head,
        rotary=rotary,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        eps=float(cfg.rms_norm_eps),
    )
    why = unsupported(weights)
    if why:
        raise ValueError(f"the decoder kernels cannot run this drafter ({why})")
    B = cfg.block_size
    seen = torch.ones(B, B, dtype=torch.int8, device=target.device)
    cache = SlotCache(weights, slots=1, capacity=capacity)
    fc, hidden_norm = (p.detach().to(dtype) for p in (drafter.fc.weight, drafter.hidden_norm.weight))
    return DraftKernels(weights, fc, hidden_norm, key_value_weights(weights), cache, seen)


def write_context(dk: DraftKernels, features: Tensor, start: Tensor) -> None:
    """The context rows of features [1, s, n * hidden] at positions ``start`` [1] + 0 .. s-1: fused by ``fc``,
    and each layer's keys and values of them (after ``hidden_norm``) written into the drafter's cache."""
    x = linear(features[0].to(dk.fc.dtype), dk.fc)
    write_keys_values(dk.weights, dk.kv, dk.cache, x, dk.hidden_norm, start, dk.tiles)


def write_prompt_context(dk: DraftKernels, features: Tensor) -> None:
    """A prompt's context rows (features [1, P, n * hidden]) at positions 0 .. P-1: what ``write_context``
    writes, through plain torch ops, as the target's prompt goes through the plain forward. A prompt comes in
    any length, and the qkv kernel's programs for many rows are the largest the kernels have: compiled for
    sm_90 with the drafter's head norms in float32 (the lossless check's dtype), 18 s at 32 rows, 44 s at 64
    and 210 s at 128 on this project's CPU, paid mid-generation by the first prompt of each row tile (on an
    H100 the bench's float32 check stalled in that compile for minutes: benchmarks/RESULTS.md,
    2026-12-06). Rounded where the kernel rounds (the plain forward's places), so the two differ only in the
    order of sums."""
    w = dk.weights
    nq, nk, d = w.heads, w.kv_heads, w.head_dim
    x = linear(features[0].to(dk.fc.dtype), dk.fc)
    h = rms_norm(x, dk.hidden_norm, w.eps)
    P = x.shape[0]
    rotary = w.rotary[:P]  # positions 0 .. P-1
    for i, layer in enumerate(w.layers):
        bias = None if layer.qkv_bias is None else layer.qkv_bias[nq * d :]
        kv = linear(h, layer.qkv[nq * d :], bias).view(P, 2 * nk, d)
        k, v = kv[:, :nk], kv[:, nk:]
        if layer.k_norm is not None:
            k = rms_norm(k, layer.k_norm, w.eps)
        dk.cache.k[i][0, :P] = apply_rotary(k, rotary)
        dk.cache.v[i][0, :P] = v


def kernel_draft_step(
    dk: DraftKernels,
    rows: Tensor,
    row_start: Tensor,
    block: Tensor,
    block_start: Tensor,
    out_logits: Tensor,
) -> None:
    """``graph_engine.draft_step`` through the kernels: the context rows (features [1, B, n * hidden] from
    position ``row_start``) written into the drafter's cache, the block [1, B] anchored at ``block_start``
    (its slots at ``block_start`` + 0 .. B-1, a chain's positions, reading each other both ways) drafted over
    it, the drafted slots' float32 logits into ``out_logits`` [B-1, V]."""
    write_context(dk, rows, row_start)
    decode_by_kernels(
        dk.weights, dk.cache, block, block_start, out_logits, tiles=dk.tiles, seen=dk.seen, head_from=1
    )

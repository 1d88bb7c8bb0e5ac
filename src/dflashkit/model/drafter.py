"""The DFlash drafter: a few Qwen3-style decoder layers that fill a block of masked slots in one pass,
conditioned on hidden states of the target.

Read top to bottom:

- context features (target layer outputs, concatenated) are fused once: ``ctx = hidden_norm(fc(features))``;
- every layer attends with queries from the block tokens only, over keys/values
  ``[proj(ctx); proj(block)]`` (context first). The context gets its own K/V projection in each
  layer but no layernorm and no MLP;
- RoPE: a context row at position p is rotated by p; block slot k by ``anchor_position + k``;
- the output is ``norm(h)``; logits are the target's frozen ``lm_head`` applied by the caller.

One module serves both uses:

- training, ``forward``: many blocks per sequence at once, kept apart by the block mask of
  ``dflashkit.attention`` (built once per step, e.g. with ``build_block_masks``);
- inference, ``draft``: one block at a time over a ``DraftCache`` of context K/V that grows with the
  verified tokens and is cropped after each step. The block's own K/V are never cached.
- inference with fixed shapes (the graphs decode engine): ``write_context`` puts context rows into a
  preallocated ``StaticDraftCache`` (row r = position r), and ``draft_block`` writes the block's K/V into
  the rows of its own positions and runs it over the rows before its anchor and its own; both run as fixed-shape
  steps, captured once per shape (``dflashkit.infer.graph_engine``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.attention.backends import AttentionMask, attention, build_mask
from dflashkit.attention.masks import BlockLayout
from dflashkit.model.config import DrafterConfig
from dflashkit.runtime.compiled_region import CompiledRegion

# One mask for every layer, or one per layer type ("full_attention", "sliding_attention").
Masks = AttentionMask | Mapping[str, AttentionMask] | None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back (as in Qwen3/Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# --- rotary position embedding -------------------------------------------------------------------


def rope_inverse_frequencies(config: DrafterConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling). Plain RoPE here; scaled variants are computed by
    transformers' own functions so that they match the target's exactly."""
    with torch.device("cpu"):  # tables are computed on the CPU even while a model is built on "meta"
        return _inverse_frequencies(config)


def _inverse_frequencies(config: DrafterConfig) -> tuple[Tensor, float]:
    d = config.head_dim
    if config.rope_type == "default":
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        return inv_freq, 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=d,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_theta": config.rope_theta, **(config.rope_scaling or {})},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class Rotary(nn.Module):
    """cos/sin tables for given positions: [batch, T, head_dim] each."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        inv_freq, self.scaling = rope_inverse_frequencies(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x [batch, heads, T, head_dim] (the half-split convention of HF Llama/Qwen)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# --- the decoder layer ---------------------------------------------------------------------------


class Attention(nn.Module):
    """GQA attention of block queries over [context; block] keys, per-head q/k RMSNorm, no bias."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            D,
        )
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and values [batch, kv_heads, T, head_dim] of rows x [batch, T, H]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask | None,
        backend: str,
        rows: Tensor | None = None,
    ) -> Tensor:
        """x: normed block rows [batch, Q, H]; ctx_k/ctx_v: this layer's context keys/values, which the
        block's own follow. With ``rows`` [Q] (the block's positions), ctx_k/ctx_v are a ``StaticDraftCache``
        layer [1, kv_heads, capacity, head_dim]: the block's keys and values are written into those rows
        (rows at or past its anchor hold no context yet) and the queries read the cache in place under
        ``mask`` (``StaticDraftCache.block_mask``): the same keys, without copying the whole cache into a
        concatenation in every layer of every step."""
        b, q_len, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        if rows is None:
            k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
            v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        else:
            ctx_k.index_copy_(2, rows, k.to(ctx_k.dtype))
            ctx_v.index_copy_(2, rows, v.to(ctx_v.dtype))
            k, v = ctx_k, ctx_v
        out = attention(q, k, v, mask, backend=backend, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size  # noqa: E741
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm: h += attn(input_layernorm(h), ctx); h += mlp(post_attention_layernorm(h))."""

    def __init__(self, config: DrafterConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask | None,
        backend: str,
        rows: Tensor | None = None,
    ) -> Tensor:
        """``rows``: the block's positions, ctx_k/ctx_v a static cache layer (``Attention.forward``)."""
        h = h + self.self_attn(self.input_layernorm(h), ctx_k, ctx_v, cos, sin, mask, backend, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


def layer_step(
    layer: DecoderLayer,
    h: Tensor,
    ctx: Tensor,
    ctx_cos: Tensor,
    ctx_sin: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: AttentionMask | None,
    backend: str,
) -> Tensor:
    """One layer of the training forward: this layer's context K/V, then the layer over the block rows."""
    ctx_k, ctx_v = layer.self_attn.key_value(ctx, ctx_cos, ctx_sin)
    return layer(h, ctx_k, ctx_v, cos, sin, mask, backend)


# ``layer_step`` as one compiled region, shared by every layer and drafter of the process (one graph per
# shape, not per layer: the layer's weights are inputs of the graph). Creating it compiles nothing.
LAYER_REGION = CompiledRegion(layer_step, "the drafter's compiled decoder layer")


# --- the inference cache -------------------------------------------------------------------------


class DraftCache:
    """Context K/V per drafter layer, [batch, kv_heads, rows, head_dim], and the rows' positions [batch, rows].

    Holds context rows only: ``draft`` appends the new context rows and never stores the block.
    ``crop(n)`` keeps the first n rows (e.g. after a verify step that rejected some drafted tokens).
    """

    def __init__(self, num_layers: int):
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        self.positions: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add rows to one layer's K/V and return all of that layer's rows."""
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self.keys[layer], self.values[layer]  # type: ignore[return-value]

    def append_positions(self, positions: Tensor) -> Tensor:
        self.positions = (
            positions if self.positions is None else torch.cat([self.positions, positions], dim=1)
        )
        return self.positions

    def crop(self, n: int) -> None:
        """Keep the first n context rows."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot crop a draft cache of {len(self)} rows to {n}")
        self.keys = [None if k is None else k[:, :, :n] for k in self.keys]
        self.values = [None if v is None else v[:, :, :n] for v in self.values]
        if self.positions is not None:
            self.positions = self.positions[:, :n]


class StaticDraftCache:
    """Context K/V per drafter layer in buffers allocated once, [1, kv_heads, capacity, head_dim]: the
    graphs engine's DraftCache. Context rows are the committed positions 0, 1, 2, ... in order, so
    row r holds position r, and a write needs no length: rows go where their positions say.

    A block anchored at position a writes its own keys and values into rows a..a+B-1 and reads rows
    0..a+B-1 (``block_mask``): the context before its anchor and itself. Rows at a or beyond hold no context
    (features of rejected drafts, the last block's own keys, or nothing yet) until committing those
    positions writes them again; rows past the block are never read. Nothing is cropped, and no buffer
    moves (compiled steps and CUDA graphs keep their addresses).
    """

    def __init__(self, config: DrafterConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.capacity = capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        self.rows = torch.arange(capacity, device=device)  # the position each row holds
        for t in (*self.keys, *self.values, self.rows):
            torch._dynamo.mark_static_address(t)

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Rows k, v [1, kv_heads, s, head_dim] of positions [s] into one layer's buffers, in place."""
        self.keys[layer].index_copy_(2, positions, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, positions, v.to(self.values[layer].dtype))

    def block_mask(self, block_positions: Tensor, window: int | None, backend: str) -> AttentionMask:
        """The cache's rows a block at ``block_positions`` [1, B] (its keys written into the rows of its own
        positions: ``Attention.forward`` with ``rows``) sees: the rows before its anchor and the block's own rows,
        all of them; a sliding layer only the rows p with q - window < p <= q of a slot at q. One row of the
        cache per key, so no key is there twice and nothing past the block is read."""
        q = block_positions[:, :, None]  # [1, B, 1]
        if window is None:  # a full layer: everything up to the block's last slot
            sees = (self.rows[None, None, :] <= block_positions[:, -1:, None]).expand(-1, q.shape[1], -1)
        else:  # a sliding layer: causal sliding-window attention over positions (`attention.masks`)
            sees = (self.rows[None, None, :] <= q) & (q - self.rows[None, None, :] < window)
        dense = sees[:, None]
        return AttentionMask(backend, dense=dense, rows_visible=torch.ones_like(dense[..., :1]))


# --- the drafter ---------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """N decoder layers over fused target features; parameter names are the z-lab checkpoint's."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_context_features, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.layer_type(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary = Rotary(config)
        # Training: run each layer (and, in the loss, each frozen-head chunk) as one compiled region
        # (dflashkit.runtime.compiled_region) that fuses the norms, RoPE and SwiGLU around the matmuls. The trainer
        # turns it on for flex on a GPU (train.compile).
        self.compiled_regions = False
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Linear weights ~ N(0, std), norm weights 1 (an untrained drafter)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std, generator=gen)
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)

    def context(self, context_features: Tensor) -> Tensor:
        """Fuse concatenated target features [batch, S, n*H] into context rows [batch, S, H].

        Flattened to [batch*S, n*H] for the matmul: the decode loop passes slices of a verified block
        ([1, kept, n*H] inside [1, B, n*H]), which ``torch.matmul`` would otherwise run as a batched
        matmul over a copy of the fc weight, on every call."""
        x = context_features.to(self.fc.weight.dtype)
        fused = self.fc(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.fc.out_features)
        return self.hidden_norm(fused)

    def forward(
        self,
        context_features: Tensor,
        block_embeds: Tensor,
        context_positions: Tensor,
        block_positions: Tensor,
        mask: Masks = None,
        backend: str = "sdpa",
    ) -> Tensor:
        """Training forward over N blocks of B slots: returns hidden [batch, N*B, H] after the final norm.

        context_features [b, S, n*H], block_embeds [b, N*B, H] (target embedding of
        [anchor token, MASK x (B-1)] per block), context_positions [b, S], block_positions [b, N*B]
        (anchor position + slot). ``mask`` is the block mask over keys [S context | N*B block] (one
        for all layers, or one per layer type); None lets every query see every key.
        """
        dtype = self.fc.weight.dtype
        ctx = self.context(context_features)
        ctx_cos, ctx_sin = self.rotary(context_positions, dtype)
        cos, sin = self.rotary(block_positions, dtype)
        h = block_embeds.to(dtype)
        run = LAYER_REGION if self.compiled_regions else layer_step
        for layer in self.layers:
            h = run(layer, h, ctx, ctx_cos, ctx_sin, cos, sin, _layer_mask(mask, layer.layer_type), backend)
        return self.norm(h)

    def draft(
        self,
        new_context_features: Tensor,
        new_context_positions: Tensor,
        block_embeds: Tensor,
        block_positions: Tensor,
        cache: DraftCache,
        backend: str = "sdpa",
    ) -> Tensor:
        """Inference: one block over all cached context. Returns hidden [batch, B, H] after the final norm.

        The new context rows (features [b, s, n*H] at positions [b, s]; s may be 0) are appended to
        ``cache`` first; the block (embeds [b, B, H], positions [b, B]) then sees every cached row and
        itself, bidirectionally; a sliding layer sees only the keys within its window, causally
        (`_window_mask`). The block's K/V
        are not kept, so after the call the cache holds context rows only.
        """
        dtype = self.fc.weight.dtype
        ctx = self.context(new_context_features)
        ctx_cos, ctx_sin = self.rotary(new_context_positions, dtype)
        cos, sin = self.rotary(block_positions, dtype)
        cached_positions = cache.append_positions(new_context_positions)
        h = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = cache.append(i, *layer.self_attn.key_value(ctx, ctx_cos, ctx_sin))
            mask = None
            if layer.layer_type == "sliding_attention":
                mask = _window_mask(cached_positions, block_positions, self.config.sliding_window, backend)
            h = layer(h, ctx_k, ctx_v, cos, sin, mask, backend)
        return self.norm(h)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    # --- fixed shapes (the graphs engine) -------------------------------------------------------

    def new_static_cache(self, capacity: int) -> StaticDraftCache:
        return StaticDraftCache(self.config, capacity, self.fc.weight.dtype, self.fc.weight.device)

    def write_context(self, features: Tensor, positions: Tensor, cache: StaticDraftCache) -> None:
        """Fuse context features [1, s, n*H] at positions [1, s] and write their K/V, per layer, into
        the rows of those positions."""
        dtype = self.fc.weight.dtype
        ctx = self.context(features)
        cos, sin = self.rotary(positions, dtype)
        for i, layer in enumerate(self.layers):
            cache.write(i, positions[0], *layer.self_attn.key_value(ctx, cos, sin))

    def draft_block(
        self, block_embeds: Tensor, block_positions: Tensor, cache: StaticDraftCache, backend: str = "sdpa"
    ) -> Tensor:
        """One block (embeds [1, B, H] at positions [1, B]) over the cached rows before its anchor, as
        ``draft`` does over a DraftCache; its own keys and values go into the cache rows of its positions
        (``StaticDraftCache``). Returns hidden [1, B, H] after the final norm."""
        if backend == "flex":
            raise ValueError("the graphs engine drafts on the sdpa or eager backend, not flex")
        cos, sin = self.rotary(block_positions, self.fc.weight.dtype)
        masks = self._static_masks(block_positions, cache, backend)
        h = block_embeds.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            mask = masks[layer.layer_type]
            h = layer(h, cache.keys[i], cache.values[i], cos, sin, mask, backend, block_positions[0])
        return self.norm(h)

    def _static_masks(
        self, block_positions: Tensor, cache: StaticDraftCache, backend: str
    ) -> dict[str, AttentionMask]:
        """A block's mask over the cache's rows (the block's among them) for each layer type the drafter has."""
        return {
            kind: cache.block_mask(block_positions, self.config.sliding_window if sliding else None, backend)
            for kind, sliding in (("full_attention", False), ("sliding_attention", True))
            if any(layer.layer_type == kind for layer in self.layers)
        }


def grown(old: DFlashDrafter, config: DrafterConfig) -> DFlashDrafter:
    """``old`` reshaped to ``config``, computing exactly what it computed: the same weights, the block size
    of ``config`` (no weight depends on it), and after its own layers the new ones ``config`` asks for, each
    an identity at first: its attention output and MLP down projections are zero, so the residual stream
    passes through unchanged until training moves them (their other weights start as `reset_parameters`
    draws them, under the caller's seed). ``config`` must keep everything else of ``old.config``."""
    if config == old.config:
        return old
    kept = len(old.layers)
    same = config.updated(
        num_hidden_layers=kept,
        block_size=old.config.block_size,
        layer_types=config.layer_types[:kept] if config.layer_types else None,
    )
    if same != old.config or len(config.layer_types or []) < kept:
        raise ValueError("grown: only the number of layers (more) and the block size may change")
    new = DFlashDrafter(config).to(device=old.fc.weight.device, dtype=old.fc.weight.dtype)
    missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("layers.") for key in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in new.layers[kept:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    new.compiled_regions = old.compiled_regions
    return new


def build_block_masks(config: DrafterConfig, layout: BlockLayout, backend: str) -> dict[str, AttentionMask]:
    """The training masks for every layer type the drafter uses, built once per step."""
    masks = {}
    for layer_type in sorted(set(config.layer_type(i) for i in range(config.num_hidden_layers))):
        window = config.sliding_window if layer_type == "sliding_attention" else None
        # Sliding layers: causal inside the block, as serving engines run them (`attention.masks`).
        masks[layer_type] = build_mask(layout, backend, window=window, causal_in_block=window is not None)
    return masks


def _layer_mask(mask: Masks, layer_type: str) -> AttentionMask | None:
    if mask is None or isinstance(mask, AttentionMask):
        if layer_type == "sliding_attention" and mask is not None:
            raise ValueError(
                "this drafter has sliding-window layers: pass one mask per layer type (build_block_masks)"
            )
        return mask
    if layer_type not in mask:
        raise ValueError(f"no attention mask for {layer_type!r} layers (have {sorted(mask)})")
    return mask[layer_type]


def _window_mask(
    ctx_positions: Tensor, block_positions: Tensor, window: int | None, backend: str
) -> AttentionMask:
    """Inference mask of a sliding layer: a slot at position q sees the context rows and the slots of its
    block at p with q - window < p <= q (causal sliding-window attention over positions, `attention.masks`)."""
    if backend == "flex":
        raise ValueError("drafting with sliding-window layers runs on the sdpa or eager backend, not flex")
    assert window is not None
    q = block_positions[:, :, None]
    sees_ctx = (q - ctx_positions[:, None, :]) < window  # [b, B, S]
    p = block_positions[:, None, :]
    sees_block = (p <= q) & (q - p < window)  # [b, B, B]
    dense = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]
    return AttentionMask(backend, dense=dense, rows_visible=dense.any(-1, keepdim=True))

"""The target's decoder as plain tensors and functions, for batched generation over a cache of fixed slots.

`dflashkit prepare` asks the target for hundreds of thousands of replies; transformers' ``generate`` spends
most of its time launching kernels and padding batches. This module is the whole forward pass of a
Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) written out as a dozen tensor operations per layer, over
a K/V cache allocated once:

- ``DecoderWeights.from_hf(model)``: the weights, with the query, key and value projections fused into one
  matrix and the gate and up projections into another (one matmul each instead of three and two). The
  query and key rows of every head are reordered so that the rotary pairs (i, i + d/2) sit side by side:
  rotary embedding then is one complex multiplication (`apply_rotary`). Queries and keys are permuted the
  same way, so their dot products, and everything the model computes, are unchanged.
  ``DecoderWeights.from_state(tensors, config)`` builds the same from a folder's weights file and
  config.json, without transformers' model (a served target: ``TargetModel.load(lazy=True)``).
- ``SlotCache``: keys and values of ``slots`` sequences of up to ``capacity`` positions each, laid out
  [slot, position, kv head, head dim], plus one scratch slot (index ``slots``) that padding rows write to.
- ``forward(...)``: rows of new tokens, each row written into its slot at its own start position; every
  query attends to its slot's positions up to its own (causal). Returns the logits of one chosen position
  per row. A decode step is R = all slots, C = 1; a prefill chunk is a few rows of C prompt tokens.

Attention has two implementations of one function: ``"sdpa"`` (any device and dtype; the keys of each row's
slot up to ``kv_len``, masked per query position; the reference) and ``"flash"`` (CUDA, bf16/fp16:
FlashAttention's variable-length kernel reads each slot's used positions straight from the cache, so a
step costs what the sequences hold, not what the longest one holds). A token tree (``decode(..., positions=,
mask=)``) attends under its explicit ancestor mask through SDPA on either (FlashAttention's varlen kernel
takes no arbitrary mask).

Everything here is shape-static for given (rows, chunk, kv_len): a step can be captured as a CUDA graph
(``dflashkit.data.generator``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.errors import ConfigError, DflashkitError
from dflashkit.rope import rope_from_hf_config

Attention = Literal["sdpa", "flash"]


def flash_varlen(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention's variable-length forward (CUDA, bf16/fp16), as torch ships it."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LayerWeights:
    input_norm: Tensor  # [hidden]
    qkv: Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]; q and k rows in side-by-side rotary order
    qkv_bias: Tensor | None  # Qwen2
    q_norm: Tensor | None  # [head_dim], Qwen3 (reordered like the q rows)
    k_norm: Tensor | None
    o: Tensor  # [hidden, heads * head_dim]
    post_norm: Tensor
    gate_up: Tensor  # [2 * intermediate, hidden]
    down: Tensor  # [hidden, intermediate]
    # oneDNN's packed copies of qkv, o, gate_up and down (``DecoderWeights.pack_for_cpu``; else empty)
    packed: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class DecoderWeights:
    embed: Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: Tensor
    lm_head: Tensor  # [vocab, hidden] (the embedding itself when tied)
    rotary: Tensor  # [max_positions, head_dim / 2] complex64: attention_scaling * e^(i * pos * inv_freq)
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    # the rotary table as real (cos, sin) pairs [max_positions, head_dim / 2, 2]: what the Triton kernels read
    # (``dflashkit.infer.kernels.decoder``)
    rotary_pairs: Tensor = field(init=False, repr=False)
    lm_head_packed: Tensor | None = field(default=None, repr=False)  # ``pack_for_cpu``

    def __post_init__(self) -> None:
        self.rotary_pairs = torch.view_as_real(self.rotary).clone()

    def pack_for_cpu(self) -> bool:
        """Pack every matmul's weight once for oneDNN where that pays: bf16 on a CPU with bf16 matmul
        instructions. ``F.linear`` re-lays a bf16 weight out on every call there; with the weights packed the
        graphs engine decoded MT-Bench 28-31% faster, autoregressively and speculatively (benchmarks/RESULTS.md,
        2026-12-03), with the very numbers of the unpacked step (the same kernels, the weights laid out
        ahead; the residual adds as the matmuls' post-op, as ``addmm_`` adds them). The packed copies
        double the weights' memory; eager steps only (a compiled step reads plain tensors). Returns whether
        it packed."""
        if not cpu_packing_pays(self.device, self.dtype):
            return False
        for layer in self.layers:
            layer.packed = {
                name: pack_weight(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")
            }
        self.lm_head_packed = pack_weight(self.lm_head)
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def max_positions(self) -> int:
        return int(self.rotary.shape[0])

    @classmethod
    def from_hf(cls, model: Any, max_positions: int | None = None) -> DecoderWeights:
        """The weights of a transformers causal LM (same device and dtype), fused and reordered.
        Raises DflashkitError for an architecture this forward does not reproduce exactly."""
        check_supported(model.config)
        cfg = model.config
        inner = model.get_decoder()
        heads, kv_heads, head_dim = attention_shape(cfg)
        layers = []
        with torch.no_grad():
            for layer in inner.layers:
                at, mlp = layer.self_attn, layer.mlp
                layers.append(
                    fused_layer(
                        {
                            "input_norm": layer.input_layernorm.weight,
                            "q": at.q_proj.weight,
                            "k": at.k_proj.weight,
                            "v": at.v_proj.weight,
                            "q_bias": at.q_proj.bias,
                            "k_bias": at.k_proj.bias,
                            "v_bias": at.v_proj.bias,
                            "q_norm": None if getattr(at, "q_norm", None) is None else at.q_norm.weight,
                            "k_norm": None if getattr(at, "k_norm", None) is None else at.k_norm.weight,
                            "o": at.o_proj.weight,
                            "post_norm": layer.post_attention_layernorm.weight,
                            "gate": mlp.gate_proj.weight,
                            "up": mlp.up_proj.weight,
                            "down": mlp.down_proj.weight,
                        },
                        heads,
                        kv_heads,
                        head_dim,
                    )
                )
            rot = inner.rotary_emb
            n = max_positions or int(cfg.max_position_embeddings)
            rotary = rotary_table(rot.inv_freq, float(rot.attention_scaling), n)
        return cls(
            embed=inner.embed_tokens.weight.detach(),
            layers=layers,
            norm=inner.norm.weight.detach(),
            lm_head=model.get_output_embeddings().weight.detach(),
            rotary=rotary,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            eps=float(cfg.rms_norm_eps),
        )

    @classmethod
    def from_state(
        cls, state: dict[str, Tensor], config: Any, max_positions: int | None = None
    ) -> DecoderWeights:
        """The same weights from a checkpoint's tensors by name (``model.safetensors`` of a transformers
        folder, already in the wanted dtype and device) and its config.json's fields, without building the
        transformers model (whose imports are most of a target's load: `TargetModel.load(lazy=True)`). Only
        for the plain default rotary embedding (``state_unsupported`` says why not); the tensors are those
        ``from_hf`` reads, fused the same way."""
        reason = state_unsupported(config)
        if reason:
            raise DflashkitError(f"the target's weights cannot be read without transformers: {reason}")
        check_supported(config)
        check_tensors(state, config, "the target's weights")
        heads, kv_heads, head_dim = attention_shape(config)
        names = {
            "input_norm": "input_layernorm.weight",
            "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight",
            "q_bias": "self_attn.q_proj.bias",
            "k_bias": "self_attn.k_proj.bias",
            "v_bias": "self_attn.v_proj.bias",
            "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight",
            "o": "self_attn.o_proj.weight",
            "post_norm": "post_attention_layernorm.weight",
            "gate": "mlp.gate_proj.weight",
            "up": "mlp.up_proj.weight",
            "down": "mlp.down_proj.weight",
        }
        embed = state["model.embed_tokens.weight"]
        layers = []
        with torch.no_grad():
            for i in range(int(config.num_hidden_layers)):
                parts = {k: state.get(f"model.layers.{i}.{name}") for k, name in names.items()}
                layers.append(fused_layer(parts, heads, kv_heads, head_dim))
            theta, _ = rope_from_hf_config(config)
            exponents = (
                torch.arange(0, head_dim, 2, dtype=torch.int64, device=embed.device).float() / head_dim
            )
            inv_freq = 1.0 / (theta**exponents)  # transformers' default rotary initialisation
            n = max_positions or int(config.max_position_embeddings)
            rotary = rotary_table(inv_freq, 1.0, n)
        return cls(
            embed=embed,
            layers=layers,
            norm=state["model.norm.weight"],
            # tied: a view of the embedding, not the same tensor object, as ``from_hf`` gives it (a compiled
            # step guards on its inputs being one object: the same object would compile a second graph)
            lm_head=embed.detach() if tied(config) else state["lm_head.weight"],
            rotary=rotary,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            eps=float(config.rms_norm_eps),
        )


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a transformers config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


# the tensors every layer of a supported decoder has, by their checkpoint names (biases and head norms are
# optional: Qwen2 has the one, Qwen3 the other)
LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def check_tensors(state: dict[str, Tensor], config: Any, where: str) -> None:
    """Refuse, naming them, a ``state`` that lacks tensors ``DecoderWeights.from_state`` needs for ``config``."""
    wanted = ["model.embed_tokens.weight", "model.norm.weight"]
    wanted += [f"model.layers.{i}.{n}" for i in range(int(config.num_hidden_layers)) for n in LAYER_TENSORS]
    if not tied(config):
        wanted.append("lm_head.weight")
    missing = [n for n in wanted if n not in state]
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        raise DflashkitError(
            f"{where} lack {len(missing)} tensors the config needs ({', '.join(missing[:3])}{more}): "
            "not a whole checkpoint of this model; replace the weights file"
        )


def tied(config: Any) -> bool:
    """Whether the output head is the input embedding (transformers' default for a config that says nothing)."""
    return bool(getattr(config, "tie_word_embeddings", True))


def state_unsupported(config: Any) -> str | None:
    """Why ``DecoderWeights.from_state`` cannot build this config's weights exactly (None: it can)."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    try:
        _, scaling = rope_from_hf_config(config)
    except ConfigError as e:
        return str(e)
    if scaling:
        return f"rotary scaling {scaling.get('rope_type')!r}"
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "a partial rotary embedding"
    if getattr(config, "quantization_config", None):
        return "quantised weights"
    return None


def fused_layer(parts: dict[str, Tensor | None], heads: int, kv_heads: int, head_dim: int) -> LayerWeights:
    """One decoder layer's weights fused and reordered (see the module docstring) from its projections by
    role: q, k, v (and their biases, None without), q_norm and k_norm (None without), o, gate, up, down and
    the two norms."""
    order = rotary_order(head_dim, heads + kv_heads, device=parts["q"].device)  # type: ignore[union-attr]
    per_head = rotary_order(head_dim, 1, device=parts["q"].device)  # type: ignore[union-attr]
    qk = torch.cat([parts["q"], parts["k"]])[order]  # type: ignore[list-item]
    qkv = torch.cat([qk, parts["v"]]).contiguous()  # type: ignore[list-item]
    bias = None
    if parts["q_bias"] is not None:
        qk_b = torch.cat([parts["q_bias"], parts["k_bias"]])[order]  # type: ignore[list-item]
        bias = torch.cat([qk_b, parts["v_bias"]]).contiguous()  # type: ignore[list-item]
    q_norm, k_norm = parts["q_norm"], parts["k_norm"]
    return LayerWeights(
        input_norm=parts["input_norm"].detach(),  # type: ignore[union-attr]
        qkv=qkv,
        qkv_bias=bias,
        q_norm=None if q_norm is None else q_norm.detach()[per_head].contiguous(),
        k_norm=None if k_norm is None else k_norm.detach()[per_head].contiguous(),
        o=parts["o"].detach(),  # type: ignore[union-attr]
        post_norm=parts["post_norm"].detach(),  # type: ignore[union-attr]
        gate_up=torch.cat([parts["gate"], parts["up"]]).contiguous(),  # type: ignore[list-item]
        down=parts["down"].detach(),  # type: ignore[union-attr]
    )


def rotary_table(inv_freq: Tensor, scaling: float, max_positions: int) -> Tensor:
    """The rotary table [max_positions, head_dim / 2] complex64: scaling * e^(i * pos * inv_freq)."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    angles = pos[:, None] * inv_freq.float()[None, :]
    return torch.polar(torch.full_like(angles, scaling), angles)


def check_supported(config: Any) -> None:
    """This forward reproduces plain pre-norm decoders with SwiGLU MLPs and rotary attention; anything
    else must generate through transformers (``prepare --backend hf``)."""
    kind = getattr(config, "model_type", None)
    problems = []
    if kind not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model type {kind!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", kind == "mistral"):
        problems.append(f"sliding window {window}")
    if getattr(config, "rope_scaling", None) and (config.rope_scaling or {}).get("rope_type") == "dynamic":
        problems.append("dynamic rotary scaling")
    if problems:
        raise DflashkitError(
            f"the slot generator does not support this target ({', '.join(problems)}; it runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} decoders); use --backend hf"
        )


def rotary_order(head_dim: int, heads: int, device: torch.device | str = "cpu") -> Tensor:
    """Row order that puts each head's rotary pairs (i, i + d/2) side by side: (0, d/2, 1, d/2+1, ...)."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return (torch.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1).to(device)


def apply_rotary(x: Tensor, rotary: Tensor) -> Tensor:
    """x [..., heads, head_dim] in side-by-side order, rotary [..., head_dim/2] complex (broadcast over
    heads): each pair turned by its angle, in fp32, back in x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotary.unsqueeze(-2)).flatten(-2).to(x.dtype)


# the counters a SlotCache holds for the decoder kernels: the embedded target's block step uses 48, an 8B
# target's ~400 (its gate/up columns over 32-column tiles)
KERNEL_COUNTS = 1024


class SlotCache:
    """Keys and values of `slots` sequences (+1 scratch slot at index `slots`), one tensor pair per layer,
    [slot, position, kv head, head dim], allocated once. A slot holds one sequence at a time; positions
    beyond a sequence's length hold stale values that no query reads (causal) and later writes replace.

    Every layer's keys are views of one tensor ``keys`` [layer, slot, position, kv head, head dim] (values:
    ``values``), so a move of rows in every layer (a decode engine's tree keep) is one gather and one copy
    per tensor, not one per layer."""

    def __init__(self, weights: DecoderWeights, slots: int, capacity: int):
        if capacity > weights.max_positions:
            raise DflashkitError(
                f"a slot of {capacity} positions is longer than the target's {weights.max_positions}; "
                "lower max_prompt_tokens or max_new_tokens"
            )
        self.slots = slots
        self.capacity = capacity
        shape = (slots + 1, capacity, weights.kv_heads, weights.head_dim)
        make = dict(dtype=weights.dtype, device=weights.device)
        layers = len(weights.layers)
        self.keys = torch.zeros(layers, *shape, **make)  # type: ignore[arg-type]
        self.values = torch.zeros(layers, *shape, **make)  # type: ignore[arg-type]
        self.k = list(self.keys.unbind(0))
        self.v = list(self.values.unbind(0))
        # the decoder kernels' per-tile counters (split-K shares, attention splits done) for the steps that
        # write this cache: zero, and every launch leaves them zero, so a captured step replays no fill
        self.counts = torch.zeros(KERNEL_COUNTS, dtype=torch.int32, device=weights.device)

    @property
    def scratch(self) -> int:
        return self.slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def write_rows(cache: Tensor, rows_at: tuple[Tensor, Tensor], rows: Tensor) -> None:
    """New keys or values ``rows`` [n, kv heads, head dim] into one layer's ``cache`` [slot, position, kv head,
    head dim] at ``rows_at`` (each row's slot and position, built once a step by ``_step_plan``), in place.
    An ``index_put_`` on the cache itself, not an ``index_copy_`` on a flat view of it: compiled, a mutation
    through a view made inside the graph can be functionalised into a copy of the whole cache, written, and
    copied back (torch 2.13 does so for a small function on the CPU; on the GPU's torch 2.11 the compiled
    layer ran two copy kernels per layer beside its writes: with this write they went, the one-token step
    1.041 -> 0.785 ms on an H200, benchmarks/RESULTS.md, 2026-12-04). Eager it is also the faster write
    (3.1 against 6.1 us for 8 bf16 rows on this CPU)."""
    cache.index_put_(rows_at, rows)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def cpu_packing_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX): there a weight packed
    once (``pack_weight``) beats ``F.linear``, which packs it again on every call."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_weight(weight: Tensor) -> Tensor:
    """A [out, in] weight laid out for oneDNN's matmul (an opaque tensor only ``linear`` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias), through the packed copy of the weight where there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def forward(
    w: DecoderWeights,
    cache: SlotCache,
    tokens: Tensor,
    slots: Tensor,
    starts: Tensor,
    last: Tensor,
    *,
    kv_len: int,
    attention: Attention = "sdpa",
) -> Tensor:
    """Write rows of new tokens into their slots and return the logits at one position per row.

    tokens [R, C] (int64), slots [R] (the slot each row writes; padding rows use ``cache.scratch``),
    starts [R] (the position of each row's first token), last [R] (the index within the row whose logits
    are returned). Row r's token c sits at position starts[r] + c and attends to its slot's positions
    0 .. starts[r] + c. ``kv_len`` bounds the positions read (>= the largest starts + C; the sdpa path's
    width). Returns float32 logits [R, vocab]."""
    x, _ = decode(w, cache, tokens, slots, starts, kv_len=kv_len, attention=attention)
    picked = x[torch.arange(x.shape[0], device=x.device), last]  # [R, hidden]
    return logits(w, picked)


@dataclass(frozen=True)
class Packing:
    """Prompts packed end to end in one row of tokens, no padding: segment j is the tokens
    ``offsets[j]:offsets[j + 1]``, written into slot ``segment_slots[j]`` at consecutive positions from
    ``starts[j]``. Built by `pack` (host lists in, device tensors out)."""

    slots: Tensor  # [T] each token's slot
    positions: Tensor  # [T] each token's position
    offsets: Tensor  # [S + 1] int32: where each segment begins, then T
    segment_slots: Tensor  # [S]
    used: Tensor  # [S] int32: each segment's last position + 1 (the keys its last token reads)
    ends: Tensor  # [S] the index of each segment's last token
    longest: int  # the longest segment
    kv_len: int  # the most positions any segment reads


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without waiting for the device's queued work: to a GPU through pinned
    memory, whose buffer the caching host allocator keeps until the copy has run (a copy from pageable
    memory may wait for the stream)."""
    if device.type != "cuda":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def values_on(
    values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.long
) -> Tensor:
    """Host values as a tensor on `device`, through `to_device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def pack(
    slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device: torch.device
) -> Packing:
    """The `Packing` of segments of ``lengths`` tokens written into ``slots`` from positions ``starts``."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    token_slots = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
    positions = [p for a, n in zip(starts, lengths, strict=True) for p in range(a, a + n)]
    used = [a + n for a, n in zip(starts, lengths, strict=True)]
    return Packing(
        slots=values_on(token_slots, device),
        positions=values_on(positions, device),
        offsets=values_on(offsets, device, torch.int32),
        segment_slots=values_on(list(slots), device),
        used=values_on(used, device, torch.int32),
        ends=values_on([o - 1 for o in offsets[1:]], device),
        longest=max(lengths),
        kv_len=max(used),
    )


def forward_packed(
    w: DecoderWeights, cache: SlotCache, tokens: Tensor, packing: Packing, *, attention: Attention = "sdpa"
) -> Tensor:
    """``forward`` over prompts packed end to end (``tokens`` [T], laid out as ``packing`` says): each
    token is written into its segment's slot and attends to that slot's positions up to its own. A pass
    costs the tokens it holds, with no padded rows or chunks; its shape changes from pass to pass (run it
    eagerly). Returns float32 logits [S, vocab] at each segment's last token."""
    x, _ = decode(
        w,
        cache,
        tokens[None],
        packing.slots[None],
        packing.positions[None],
        kv_len=packing.kv_len,
        attention=attention,
        packing=packing,
    )
    return logits(w, x[0, packing.ends])


def logits(w: DecoderWeights, x: Tensor) -> Tensor:
    """The final norm and the vocabulary head over hidden states [..., hidden]: float32 logits."""
    return linear(rms_norm(x, w.norm, w.eps), w.lm_head, packed=w.lm_head_packed).float()


def decode(
    w: DecoderWeights,
    cache: SlotCache,
    tokens: Tensor,
    slots: Tensor,
    starts: Tensor,
    *,
    kv_len: int,
    attention: Attention = "sdpa",
    keep: tuple[int, ...] = (),
    positions: Tensor | None = None,
    mask: Tensor | None = None,
    packing: Packing | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """The decoder layers over rows of new tokens (as ``forward``), writing their keys and values into the
    cache. Returns the last layer's hidden states [R, C, hidden] (before the final norm) and the outputs
    of the layers listed in ``keep`` (in layer order; the drafter's context features).

    A token tree (``dflashkit.infer.tree``): ``positions`` [R, C] are the rotary positions (a node's: the
    root's + its depth; default: where each token is written) and ``mask`` [R, C, kv_len] (bool, True: the
    query reads that cache position) replaces the causal rule, through ``_masked_plan``. The keys and values
    are still written at starts[r] + c.

    Packed prompts (``forward_packed``): one row of tokens, ``packing`` says each token's slot and
    position (``slots`` and ``starts``, then [1, T], are those per token)."""
    rows, chunk = tokens.shape
    x, rotary, attend, rows_at = _step_plan(
        w,
        cache,
        tokens,
        slots,
        starts,
        kv_len=kv_len,
        attention=attention,
        positions=positions,
        mask=mask,
        packing=packing,
    )
    nq, nk, d = w.heads, w.kv_heads, w.head_dim
    kept = []
    for i, layer in enumerate(w.layers):
        h = rms_norm(x, layer.input_norm, w.eps)
        qkv = linear(h, layer.qkv, layer.qkv_bias, layer.packed.get("qkv"))
        qkv = qkv.view(rows, chunk, nq + 2 * nk, d)
        qk, v = qkv[:, :, : nq + nk], qkv[:, :, nq + nk :]
        if layer.q_norm is not None:  # Qwen3: each head normalised before the rotation
            qk = torch.cat(
                [rms_norm(qk[:, :, :nq], layer.q_norm, w.eps), rms_norm(qk[:, :, nq:], layer.k_norm, w.eps)],
                dim=2,
            )
        qk = apply_rotary(qk, rotary)  # queries and keys turned in one pass
        write_rows(cache.k[i], rows_at, qk[:, :, nq:].reshape(-1, nk, d))
        write_rows(cache.v[i], rows_at, v.reshape(-1, nk, d))
        out = attend(qk[:, :, :nq], cache.k[i], cache.v[i])  # [R, C, nq * d]
        _add_linear_(x, out, layer.o, layer.packed.get("o"))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = linear(h, layer.gate_up, packed=layer.packed.get("gate_up")).chunk(2, dim=-1)
        _add_linear_(x, F.silu(gate) * up, layer.down, layer.packed.get("down"))
        if i in keep:
            kept.append(x.clone())  # x keeps changing in place
    return x, kept


def head_into(w: DecoderWeights, h: Tensor, out: Tensor) -> None:
    """The vocabulary head over final-normed hidden states ``h``, written into the float32 logits ``out``: the
    copy casts (for bf16 weights, one kernel a step fewer than a cast and then a copy)."""
    out.copy_(linear(h, w.lm_head, packed=w.lm_head_packed))


def _step_plan(
    w: DecoderWeights,
    cache: SlotCache,
    tokens: Tensor,
    slots: Tensor,
    starts: Tensor,
    *,
    kv_len: int,
    attention: Attention,
    positions: Tensor | None,
    mask: Tensor | None,
    packing: Packing | None,
) -> tuple[Tensor, Tensor, Attend, tuple[Tensor, Tensor]]:
    """What every layer of a step shares, built once: the embedded tokens [R, C, hidden], their rotary
    angles, the attention plan and each new
    token's cache row as its slot and position (``decode`` says what the arguments mean)."""
    rows, chunk = tokens.shape
    if packing is not None:
        written = packing.positions[None]
    else:
        written = (starts[:, None] + torch.arange(chunk, device=tokens.device)[None, :]).clamp(
            max=cache.capacity - 1
        )
    rotary = w.rotary[written if positions is None else positions]  # [R, C, head_dim/2]
    x = w.embed[tokens]  # [R, C, hidden]
    nq, nk = w.heads, w.kv_heads
    if mask is not None:
        if rows == cache.slots == 1:  # a decode engine's tree step: its one slot, read as a view
            attend = _tree_plan(mask[:, :, :kv_len], nq, nk, w.dtype)
        else:
            attend = _masked_plan(slots, mask[:, :, :kv_len], nq, nk)  # once for all layers
    elif packing is not None:
        if attention == "flash":
            attend = _packed_flash_plan(packing, nq, nk, cache.capacity, cache.slots + 1)
        else:
            attend = _packed_sdpa_plan(packing, nq, nk)
    else:
        # once for all layers
        if attention == "flash":
            attend = _flash_plan(slots, written, kv_len, nq, nk, cache.capacity, cache.slots + 1)
        else:
            one_slot = rows == cache.slots == 1  # a decode engine's one slot
            attend = _sdpa_plan(slots, written, kv_len, nq, nk, cache.capacity, cache.slots + 1, one_slot)
    token_slots = packing.slots[None] if packing is not None else slots[:, None]
    # each new token's cache row: its slot and position (what ``write_rows`` indexes the cache with)
    rows_at = (token_slots.expand_as(written).reshape(-1), written.reshape(-1))
    return x, rotary, attend, rows_at


def _add_linear_(x: Tensor, a: Tensor, weight: Tensor, packed: Tensor | None = None) -> None:
    """x += a @ weight.T in place, as one matmul that accumulates onto x (the residual add rides in the
    GEMM). In place, not ``torch.addmm(x, ...)``: an out-of-place addmm first copies x into its result,
    one device copy per call, 60 a step for a 30-layer target. With a packed weight (the CPU in bf16):
    oneDNN's matmul with the add as its post-op, the very numbers of ``addmm_``."""
    rows, a2 = x.view(-1, x.shape[-1]), a.reshape(-1, a.shape[-1])
    if packed is not None:
        rows.copy_(torch.ops.mkldnn._linear_pointwise.binary(a2, rows, packed, None, "add"))
        return
    rows.addmm_(a2, weight.t())


Attend = Callable[
    [Tensor, Tensor, Tensor], Tensor
]  # (queries [R, C, nq, d], k cache, v cache) -> [R, C, nq*d]


def _sdpa_plan(
    slots: Tensor,
    positions: Tensor,
    kv_len: int,
    nq: int,
    nk: int,
    capacity: int,
    slots_n: int,
    one_slot: bool = False,
) -> Attend:
    """Reference attention: each row reads its slot's first kv_len positions; query at position p sees
    positions <= p (``_masked_plan`` under the causal mask)."""
    allowed = (
        torch.arange(kv_len, device=positions.device)[None, None, :] <= positions[:, :, None]
    )  # [R, C, L]
    return _masked_plan(slots, allowed, nq, nk, one_slot)


def _masked_plan(slots: Tensor, allowed: Tensor, nq: int, nk: int, one_slot: bool = False) -> Attend:
    """Attention under an explicit mask ``allowed`` [R, C, L] (True: the query reads that position): each
    row reads its slot's first L positions. The query heads that share a key head are stacked along the
    query axis, each stacked query with its own mask row, so keys and values are read once per key head and
    the result is exact under any mask (a tree's ancestors included). The mask is built once per step, for
    every layer. ``one_slot``: the cache holds one slot and the row is that slot's (a decode engine's):
    keys and values are read as a view of slot 0, not gathered (a copy of the whole context per layer)."""
    rows, chunk, kv_len = allowed.shape
    rep = nq // nk
    mask = allowed[:, None, None].expand(rows, 1, rep, chunk, kv_len).reshape(rows, 1, rep * chunk, kv_len)

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        d = q.shape[-1]
        if one_slot:
            k, v = k_cache[:1, :kv_len].transpose(1, 2), v_cache[:1, :kv_len].transpose(1, 2)
        else:
            k = k_cache[slots, :kv_len].transpose(1, 2)  # [R, nk, L, d]
            v = v_cache[slots, :kv_len].transpose(1, 2)
        qg = q.view(rows, chunk, nk, rep, d).permute(0, 2, 3, 1, 4).reshape(rows, nk, rep * chunk, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=d**-0.5)
        return out.view(rows, nk, rep, chunk, d).permute(0, 3, 1, 2, 4).reshape(rows, chunk, nq * d)

    return attend


def _tree_plan(allowed: Tensor, nq: int, nk: int, dtype: torch.dtype) -> Attend:
    """``_masked_plan`` for a cache of one slot (a decode engine's: its row is slot 0, the other slot is the
    scratch one), with the fewest kernels a layer (on a GPU a step's cost is its kernel count): the mask,
    stacked per query head, becomes one additive bias once per step, its rows 16-aligned as the fused
    attention kernels want them; each layer then reads slot 0's keys and values straight from the cache (a
    view: no gather of the slot's rows, no mask conversion, no padding per layer). Exact under any mask: the
    same scores, the hidden positions at -inf."""
    _, chunk, kv_len = allowed.shape
    rep = nq // nk
    padded = -(-kv_len // 16) * 16
    bias = torch.zeros(1, 1, rep, chunk, padded, dtype=dtype, device=allowed.device)
    bias[..., :kv_len].masked_fill_(~allowed[:, None, None], float("-inf"))
    bias = bias.view(1, 1, rep * chunk, padded)[..., :kv_len]

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        d = q.shape[-1]
        k = k_cache[0, :kv_len].transpose(0, 1)[None]  # [1, nk, kv_len, d], a view of slot 0
        v = v_cache[0, :kv_len].transpose(0, 1)[None]
        qg = q.view(1, chunk, nk, rep, d).permute(0, 2, 3, 1, 4).reshape(1, nk, rep * chunk, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=d**-0.5)
        return out.view(1, nk, rep, chunk, d).permute(0, 3, 1, 2, 4).reshape(1, chunk, nq * d)

    return attend


def _packed_sdpa_plan(p: Packing, nq: int, nk: int) -> Attend:
    """Reference attention for packed prompts: each token is a row of its own, reading its slot's
    positions up to its own (``_masked_plan``)."""
    t = p.positions.shape[0]
    allowed = torch.arange(p.kv_len, device=p.positions.device)[None, None, :] <= p.positions[:, None, None]
    per_token = _masked_plan(p.slots, allowed, nq, nk)

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return per_token(q.view(t, 1, nq, q.shape[-1]), k_cache, v_cache).view(1, t, -1)

    return attend


def _packed_flash_plan(p: Packing, nq: int, nk: int, capacity: int, slots_n: int) -> Attend:
    """FlashAttention's variable-length kernel over packed prompts: segment j's queries are its tokens,
    its keys start at its slot's first position and it uses positions up to its last token's; causal
    alignment is bottom-right, so each token sees the positions up to its own."""
    end = torch.full((1,), slots_n * capacity, device=p.offsets.device, dtype=torch.int32)
    cu_k = torch.cat([p.segment_slots.to(torch.int32) * capacity, end])
    t = p.positions.shape[0]

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        d = q.shape[-1]
        out = flash_varlen(
            q.reshape(t, nq, d),
            k_cache.view(slots_n * capacity, nk, d),
            v_cache.view(slots_n * capacity, nk, d),
            p.offsets,
            cu_k,
            p.longest,
            p.kv_len,
            0.0,
            True,
            False,
            scale=d**-0.5,
            seqused_k=p.used,
        )[0]
        return out.view(1, t, nq * d)

    return attend


def _flash_plan(
    slots: Tensor, positions: Tensor, kv_len: int, nq: int, nk: int, capacity: int, slots_n: int
) -> Attend:
    """FlashAttention's variable-length kernel over the cache: row r's keys start at slot r's first
    position and it uses positions 0 .. (its last query's position); causal alignment is bottom-right, so
    query c of a row of C sees positions <= its own. The offsets are built once per step, for every layer.

    A decode step (C = 1) packs the query heads that share a key head as that head's query rows (all see
    every used position, so no causal mask is needed): the kernel then reads each slot's keys and values
    once per key head instead of once per query head."""
    rows, chunk = positions.shape
    rep = nq // nk
    packed = chunk == 1 and rep > 1
    per_row = rep if packed else chunk
    dev = positions.device
    cu_q = torch.arange(0, (rows + 1) * per_row, per_row, device=dev, dtype=torch.int32)
    end = torch.full((1,), slots_n * capacity, device=dev, dtype=torch.int32)
    cu_k = torch.cat([slots.to(torch.int32) * capacity, end])
    used = (positions[:, -1] + 1).to(torch.int32)

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        d = q.shape[-1]
        if packed:  # [R, 1, nk * rep, d] -> [R * rep, nk, d]: query "token" g of row r is head (j * rep + g)
            q = q.view(rows, nk, rep, d).transpose(1, 2)
        out = flash_varlen(
            q.reshape(rows * per_row, nk if packed else nq, d),
            k_cache.view(slots_n * capacity, nk, d),
            v_cache.view(slots_n * capacity, nk, d),
            cu_q,
            cu_k,
            per_row,
            kv_len,
            0.0,
            not packed,
            False,
            scale=d**-0.5,
            seqused_k=used,
        )[0]
        if packed:
            return out.view(rows, rep, nk, d).transpose(1, 2).reshape(rows, 1, nq * d)
        return out.view(rows, chunk, nq * d)

    return attend

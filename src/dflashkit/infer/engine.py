"""Decode engines: where the target and drafter passes of the decode loops run, and what they cache.

The loops (``dflashkit.infer.speculative``) are the same for every engine; an engine answers four calls,
for batch 1:

- ``prefill(prompt)``: the target reads the prompt; returns the logits of its last position. Its features
  become the drafter's first context rows.
- ``draft(anchor, start)``: the drafter reads the context rows it has not seen yet and fills the block
  [anchor, MASK x (B-1)] at positions start .. start+B-1; returns the logits of the B-1 drafted slots.
- ``verify(ids)``: the target reads ids [1, t] after everything cached (t = 1 for a token, B for a
  block); returns their logits [t, V] and keeps their features.
- ``crop(n)``: keep the first n positions; of the last verified tokens, those below n are the drafter's
  next context rows.

Engines:

- ``"dynamic"`` (``DynamicEngine``, the default and the reference): transformers' DynamicCache, which
  grows by concatenation and crops by slicing, the drafter's growing DraftCache, eager PyTorch. Any HF
  target. On a GPU every step pays the launch of every kernel (~25-35 ms per target pass for the
  embedded 30-layer target, whether 1 or 16 tokens).
- ``"static"`` (``StaticEngine``): caches allocated once for ``capacity`` positions, crop by moving the
  write position only (rows beyond are hidden by the causal/anchor masks and overwritten later), and
  fixed-shape steps: the target at [1, 1] (a token) and [1, B] (a block), the drafter at [1, B] (the
  last verified block's rows, then the draft block). With ``compile=True`` each step compiles once per
  shape through ``CompiledRegion`` (CUDA graphs on a GPU: one launch per step) during ``warm_up()``,
  and runs with compiles frozen after it. The prefill (any prompt length) runs eagerly.

In fp32 greedy outputs and acceptance lengths are token for token the same on both engines (tested).
In bf16 the engines round differently (the static engine's attention spans its whole capacity under a
mask), so their outputs may part after a near tie, as bf16 speculative and AR outputs already do. An
engine object holds the state of one generation at a time; reuse it for the next prompt (``prefill``
starts afresh), not from two threads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import check_supported

ENGINES: tuple[str, ...] = ("dynamic", "static", "graphs")
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINES)  # what --engine takes
WARM_CALLS_GRAPHED = 3  # a CUDA-graph region warms, records, then replays: all three before freezing


class Engine(Protocol):
    name: str
    target: TargetModel
    drafter: DFlashDrafter | None

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None: ...
    def prefill(self, prompt: Tensor) -> Tensor: ...
    def draft(self, anchor: int, start: int) -> Tensor: ...
    def verify(self, ids: Tensor) -> Tensor: ...
    def crop(self, n: int) -> None: ...


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
        self._last: tuple[Tensor, int] = (torch.empty(0), 0)  # features of the last verify, its start
        self._pending: tuple[Tensor, Tensor] = (torch.empty(0), torch.empty(0))

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Growing caches: any length fits."""

    def prefill(self, prompt: Tensor) -> Tensor:
        self._tcache = self.target.new_cache()
        self._dcache = self.drafter.new_cache() if self.drafter is not None else None
        logits, feats = self.target.forward_step(prompt, self._tcache, self.layer_ids, all_logits=False)
        self._pending = (feats, torch.arange(prompt.shape[1], device=prompt.device)[None])
        return logits[0, -1]

    def draft(self, anchor: int, start: int) -> Tensor:
        drafter = _need_drafter(self)
        B = drafter.config.block_size
        block = torch.full((1, B), drafter.config.mask_token_id, dtype=torch.long, device=self.target.device)
        block[0, 0] = anchor
        feats, positions = self._pending
        hidden = drafter.draft(
            feats, positions, self.target.embed(block), start + self._slot, self._dcache, self.backend
        )
        self._pending = (feats[:, :0], positions[:, :0])  # seen: the drafter's cache holds them now
        return self.target.lm_head(hidden[:, 1:])[0]

    def verify(self, ids: Tensor) -> Tensor:
        start = len(self._tcache)
        logits, feats = self.target.forward_step(ids, self._tcache, self.layer_ids)
        self._last = (feats, start)
        return logits[0]

    def crop(self, n: int) -> None:
        self._tcache.crop(n)
        feats, start = self._last
        kept = n - start
        self._pending = (feats[:, :kept], start + self._slot[:, :kept])


# --------------------------------------------------------------------------------------------------
# static


class StaticEngine:
    """Preallocated caches and fixed-shape steps, compiled once per shape with ``compile=True``.

    ``capacity`` bounds prompt + new tokens + block (``reserve`` checks each generation against it).
    Build one per (target, drafter, capacity) and reuse it: a new engine means new buffers, and
    compiled steps and CUDA graphs are tied to buffer addresses.
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
    ):
        from dflashkit.runtime.compiled_region import graph_mode

        if backend not in ("sdpa", "eager"):
            raise DflashkitError(f"the static engine drafts on the sdpa or eager backend, not {backend!r}")
        self.target, self.drafter, self.backend = target, drafter, backend
        self.capacity = capacity
        self.layer_ids = _layer_ids(drafter, layer_ids)
        self.block_size = _block_size(drafter)
        dev = target.device
        self._tcache = target.new_static_cache(capacity)
        self._dcache = drafter.new_static_cache(capacity) if drafter is not None else None
        self._block = torch.full((1, self.block_size), self._mask_id(), dtype=torch.long, device=dev)
        self._length = 0  # positions held by the target cache: the next write goes here
        self._last: tuple[Tensor, Tensor] | None = None  # features and positions of the last verify
        self.compiled = compile
        self._warm = False  # warm_up() ran: compiled steps run with compiles frozen
        self.mode = graph_mode(dev) if compile else None
        self._target_step: Callable[..., tuple[Tensor, Tensor]] = self._target_block
        self._draft_step: Callable[..., Tensor] = self._draft_block
        if compile:
            self._target_step = self._region(self._target_block, "the static engine's target step")
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

    def _draft_block(
        self, rows: Tensor, row_positions: Tensor, block: Tensor, block_positions: Tensor
    ) -> Tensor:
        """Write the last verified rows (features [1, B, n*H] at their positions; those at or beyond the
        anchor are rejected drafts, hidden by the mask and overwritten later), then draft the block.
        Returns the logits [B-1, V] of the drafted slots."""
        drafter = _need_drafter(self)
        assert self._dcache is not None
        drafter.write_context(rows, row_positions, self._dcache)
        hidden = drafter.draft_block(self.target.embed(block), block_positions, self._dcache, self.backend)
        return self.target.lm_head(hidden[:, 1:])[0]

    # --- the engine calls -----------------------------------------------------------------------

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a generation the preallocated caches cannot hold, before anything runs."""
        need = prompt_len + max_new_tokens + self.block_size
        if need > self.capacity:
            raise DflashkitError(
                f"the static engine holds {self.capacity} positions, but a prompt of {prompt_len} tokens + "
                f"max_new_tokens {max_new_tokens} + block {self.block_size} needs {need}: build it with "
                f"capacity >= {need} (eval sizes it from the prompts; generate from --max-new-tokens and "
                "the prompt), shorten the prompt or max_new_tokens, or use --engine dynamic"
            )

    def prefill(self, prompt: Tensor) -> Tensor:
        P = prompt.shape[1]
        positions = torch.arange(P, device=prompt.device)[None]
        logits, feats = self.target.walk(prompt, positions, self._tcache, self.layer_ids, last_only=True)
        self._length = P
        if self.drafter is not None:
            assert self._dcache is not None
            self.drafter.write_context(feats, positions, self._dcache)
            # the first draft step writes B rows from the anchor on: nothing there yet, and masked
            self._last = (
                feats.new_zeros(1, self.block_size, feats.shape[-1]),
                self._positions(P, self.block_size),
            )
        return logits[0]

    def draft(self, anchor: int, start: int) -> Tensor:
        _need_drafter(self)
        assert self._last is not None
        rows, row_positions = self._last
        self._block[0, 0] = anchor
        with self._frozen():
            return self._draft_step(rows, row_positions, self._block, self._positions(start, self.block_size))

    def verify(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t not in (1, self.block_size):
            raise ValueError(f"the static engine's target steps take 1 or {self.block_size} tokens, got {t}")
        if self._length + t > self.capacity:
            raise DflashkitError(
                f"the static engine's cache of {self.capacity} positions is full; reserve() first"
            )
        positions = self._positions(self._length, t)
        with self._frozen():
            logits, feats = self._target_step(ids, positions)
        self._last = (feats, positions)
        self._length += t
        return logits

    def crop(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot crop a static engine holding {self._length} positions to {n}")
        self._length = n  # the next step writes from n on; rows beyond are masked until then

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
) -> Engine:
    """An engine by name ("dynamic" or "static"; a static one needs ``capacity``), or ``name`` itself
    when it already is an engine (checked to serve this target and drafter)."""
    if not isinstance(name, str):
        if name.target is not target or (drafter is not None and name.drafter is not drafter):
            raise DflashkitError(f"this {name.name} engine was built for another target or drafter")
        return name
    if name == "dynamic":
        return DynamicEngine(target, drafter, layer_ids=layer_ids, backend=backend)
    if name == "static":
        if capacity is None:
            raise ValueError("a static engine needs its capacity (prompt + max_new_tokens + block)")
        return StaticEngine(
            target, drafter, capacity=capacity, layer_ids=layer_ids, compile=compile, backend=backend
        )
    if name == "graphs":
        if capacity is None:
            raise ValueError("a graphs engine needs its capacity (prompt + max_new_tokens + block)")
        return GraphEngine(target, drafter, capacity=capacity, layer_ids=layer_ids, graphs=compile)
    raise DflashkitError(f"unknown decode engine {name!r}; choose one of {', '.join(ENGINES)}")


def resolve_engine(name: str, target: TargetModel) -> str:
    """ "auto" is the fastest lossless engine for this target: "graphs" on a GPU for the decoder families
    its fused forward reproduces exactly, else "dynamic" (the reference, any target)."""
    if name != "auto":
        return name
    if target.device.type != "cuda":
        return "dynamic"
    try:
        check_supported(target.config)
    except DflashkitError:
        return "dynamic"
    return "graphs"


def ready_engine(
    name: str,
    target: TargetModel,
    drafter: DFlashDrafter | None,
    *,
    capacity: int,
    compile: bool | None = None,
) -> tuple[str | Engine, dict[str, float]]:
    """What the commands and benchmarks decode with: "dynamic" (an engine per call), or one static engine
    of this capacity, compiled and warmed up (compiles then frozen) when ``compile`` is True, or None and
    the target is on a GPU. Returns it and the warm-up seconds per step shape."""
    name = resolve_engine(name, target)
    if name not in ENGINES:
        raise DflashkitError(f"unknown decode engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if name == "dynamic":
        return name, {}
    if compile is None:
        compile = target.device.type == "cuda"
    if name == "graphs":
        graph_engine = GraphEngine(target, drafter, capacity=capacity, graphs=compile)
        return graph_engine, graph_engine.warm_up()
    engine = StaticEngine(target, drafter, capacity=capacity, compile=compile)
    return engine, engine.warm_up()

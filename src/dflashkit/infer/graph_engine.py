"""The ``"graphs"`` decode engine: the target as plain fused tensor operations, each step one CUDA graph.

The ``"static"`` engine runs transformers' decoder layers through torch.compile: every process compiles for
about a minute before its first token, and a one-token step still launches the many small kernels of the
library's layer code. This engine runs the target with ``dflashkit.target.slot_decoder`` (the forward that
``prepare`` generates with): the query, key and value projections fused into one matmul, gate and up into
another, rotary as one complex multiplication of queries and keys together, the residual adds inside the
output matmuls, and FlashAttention reading the cache up to the tokens it holds. Nothing is compiled: on a
GPU each step shape is captured once as a CUDA graph (about a second for all of them) and replayed, so a
step costs one launch from the host.

Steps (fixed shapes, as the static engine's):

- target [1, 1] and [1, B]: write the tokens' keys and values at the engine's length, return their logits
  (float32) and, for a block, the features of the drafter's target layers;
- draft [1, B]: write the last verified block's features as the drafter's context rows (rows at or beyond
  the new anchor are rejected drafts: the drafter's mask hides them, and committing those positions later
  writes them again), then draft the block [anchor, MASK x (B-1)].

The prefill (any prompt length) runs eagerly. Step inputs and outputs live in buffers allocated once: the
logits an engine call returns are valid until the next call of the same kind (the decode loops read them
at once).

In fp32 greedy outputs and acceptance lengths equal the dynamic engine's token for token (tested on the
CPU, where the same steps run eagerly). On a GPU in bf16 the kernels differ from transformers' (fused
projections, FlashAttention), so outputs may part from the other engines' after a near tie.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from dflashkit.data.generator import Steps
from dflashkit.errors import DflashkitError
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import Attention, DecoderWeights, SlotCache, decode, logits


def _attention(device: torch.device, dtype: torch.dtype) -> Attention:
    return "flash" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"


class GraphEngine:
    """Preallocated caches, the fused target forward, and (on a GPU) one CUDA graph per step shape.

    ``capacity`` bounds prompt + new tokens + block. ``graphs`` (default: on a GPU) captures each step;
    without graphs the same steps run eagerly with exact attention widths (the CPU path).
    ``fixed_shapes`` (default: with graphs) makes attention read the whole capacity, as a graph must,
    so the graphed path can be tested on the CPU. Build one per (target, drafter, capacity) and reuse it
    across prompts.
    """

    name = "graphs"

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        *,
        capacity: int,
        layer_ids: Sequence[int] | None = None,
        graphs: bool | None = None,
        fixed_shapes: bool | None = None,
    ):
        dev = target.device
        graphs = dev.type == "cuda" if graphs is None else graphs
        if graphs and dev.type != "cuda":
            raise DflashkitError("the graphs engine captures CUDA graphs: it needs the target on a GPU")
        self.target, self.drafter, self.capacity = target, drafter, capacity
        self.layer_ids = (
            list(drafter.config.target_layer_ids) if drafter is not None else list(layer_ids or [])
        )
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.w = DecoderWeights.from_hf(target.model, max_positions=capacity)
        self.cache = SlotCache(self.w, slots=1, capacity=capacity)
        self.attention = _attention(dev, self.w.dtype)
        self.steps = Steps(graphs)
        self.graphs = graphs
        self.fixed_shapes = graphs if fixed_shapes is None else fixed_shapes
        self._length = 0  # positions held by the target cache: the next write goes here
        B, V, long = self.block_size, self.w.vocab_size, dict(dtype=torch.long, device=dev)
        self._slot = torch.zeros(1, **long)  # type: ignore[arg-type]
        self._start = torch.zeros(1, **long)  # type: ignore[arg-type]  # where a target step writes
        self._ids = {t: torch.zeros(1, t, **long) for t in {1, B}}  # type: ignore[arg-type]
        self._logits = {t: torch.zeros(t, V, dtype=torch.float32, device=dev) for t in {1, B}}
        self._dcache = drafter.new_static_cache(capacity) if drafter is not None else None
        if drafter is not None:
            width = len(self.layer_ids) * target.hidden_size
            self._rows = torch.zeros(1, B, width, dtype=self.w.dtype, device=dev)  # the last block's features
            self._row_start = torch.zeros(1, **long)  # type: ignore[arg-type]
            self._block = torch.full((1, B), drafter.config.mask_token_id, **long)  # type: ignore[arg-type]
            self._block_start = torch.zeros(1, **long)  # type: ignore[arg-type]
            self._draft_logits = torch.zeros(B - 1, V, dtype=torch.float32, device=dev)
        self._offsets = torch.arange(B, device=dev)[None]

    # --- the steps (fixed shapes; one CUDA graph each with graphs) ----------------------------------

    def _kv_len(self, t: int) -> int:
        """The positions attention may read: fixed for a graph (FlashAttention then reads only the used
        ones), exact when eager."""
        return self.capacity if self.fixed_shapes else self._length + t

    def _target_step(self, t: int) -> None:
        keep = tuple(self.layer_ids) if t == self.block_size and self.drafter is not None else ()
        x, kept = decode(
            self.w,
            self.cache,
            self._ids[t],
            self._slot,
            self._start,
            kv_len=self._kv_len(t),
            attention=self.attention,
            keep=keep,
        )
        self._logits[t].copy_(logits(self.w, x[0]))
        if keep:
            self._rows.copy_(torch.cat(kept, dim=-1))

    def _draft_step(self) -> None:
        drafter, cache = self._need_drafter(), self._dcache
        assert cache is not None
        drafter.write_context(self._rows, self._row_start + self._offsets, cache)
        embeds = self.w.embed[self._block]
        hidden = drafter.draft_block(embeds, self._block_start + self._offsets, cache, "sdpa")
        self._draft_logits.copy_(torch.nn.functional.linear(hidden[0, 1:].to(self.w.dtype), self.w.lm_head))

    def _need_drafter(self) -> DFlashDrafter:
        if self.drafter is None:
            raise DflashkitError(
                "this graphs engine was built without a drafter: it decodes autoregressively only"
            )
        return self.drafter

    # --- the engine calls ----------------------------------------------------------------------------

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a generation the preallocated caches cannot hold, before anything runs."""
        need = prompt_len + max_new_tokens + self.block_size
        if need > self.capacity:
            raise DflashkitError(
                f"the graphs engine holds {self.capacity} positions, but a prompt of {prompt_len} tokens + "
                f"max_new_tokens {max_new_tokens} + block {self.block_size} needs {need}: build it with "
                f"capacity >= {need}, shorten the prompt or max_new_tokens, or use --engine dynamic"
            )

    @torch.no_grad()
    def prefill(self, prompt: Tensor) -> Tensor:
        P = prompt.shape[1]
        if P + self.block_size > self.capacity:
            raise DflashkitError(f"a prompt of {P} tokens does not fit the graphs engine's {self.capacity}")
        keep = tuple(self.layer_ids) if self.drafter is not None else ()
        start = torch.zeros(1, dtype=torch.long, device=prompt.device)
        x, kept = decode(
            self.w, self.cache, prompt, self._slot, start, kv_len=P, attention=self.attention, keep=keep
        )
        self._length = P
        if self.drafter is not None:
            assert self._dcache is not None
            positions = torch.arange(P, device=prompt.device)[None]
            self.drafter.write_context(torch.cat(kept, dim=-1), positions, self._dcache)
            self._rows.zero_()  # the first draft step's rows sit at the anchor and beyond: masked
            self._row_start.fill_(P)
        return logits(self.w, x[0, -1:])[0]

    @torch.no_grad()
    def draft(self, anchor: int, start: int) -> Tensor:
        self._need_drafter()
        self._block[0, 0] = anchor
        self._block_start.fill_(start)
        self.steps.run(("draft",), self._draft_step)
        return self._draft_logits

    @torch.no_grad()
    def verify(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t not in self._ids:
            raise ValueError(f"the graphs engine's target steps take 1 or {self.block_size} tokens, got {t}")
        if self._length + t > self.capacity:
            raise DflashkitError(
                f"the graphs engine's cache of {self.capacity} positions is full; reserve() first"
            )
        self._ids[t].copy_(ids)
        self._start.fill_(self._length)
        self.steps.run(("target", t), lambda: self._target_step(t))
        if t == self.block_size and self.drafter is not None:
            self._row_start.fill_(self._length)
        self._length += t
        return self._logits[t]

    def crop(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot crop a graphs engine holding {self._length} positions to {n}")
        self._length = n  # the next step writes from n on; positions beyond are never read until then

    # --- warm-up -----------------------------------------------------------------------------------

    @torch.no_grad()
    def warm_up(self) -> dict[str, float]:
        """Capture every step shape now (run once, then record). Returns seconds per step shape; without
        graphs, a no-op. The writes land at positions 0 .. B-1, which every prefill writes again."""
        if not self.graphs:
            return {}
        seconds: dict[str, float] = {}
        B = self.block_size
        shapes = [1] if B == 1 else [1, B]
        for t in shapes:
            t0 = time.perf_counter()
            self._start.zero_()
            self.steps.run(("target", t), lambda t=t: self._target_step(t))
            torch.cuda.synchronize(self.target.device)
            seconds[f"target [1, {t}]"] = time.perf_counter() - t0
        if self.drafter is not None:
            t0 = time.perf_counter()
            self._row_start.zero_()
            self._block_start.fill_(B)
            self.steps.run(("draft",), self._draft_step)
            torch.cuda.synchronize(self.target.device)
            seconds[f"draft [1, {B}]"] = time.perf_counter() - t0
        return seconds

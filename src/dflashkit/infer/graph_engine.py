"""The ``"graphs"`` decode engine: the target as plain fused tensor operations, each step one CUDA graph.

The target runs through ``dflashkit.target.slot_decoder`` (the forward that ``prepare`` generates with): the
query, key and value projections fused into one matmul, gate and up into another, rotary as one complex
multiplication of queries and keys together, the residual adds inside the output matmuls, and FlashAttention
reading the cache up to the tokens it holds. Nothing is compiled by Inductor: on a GPU each step shape is
captured once as a CUDA graph (``dflashkit.runtime.cuda_graph``; about a second for all of them) and replayed,
so a step costs one launch from the host. Its layers run by torch (``layers="torch"``) or through our Triton
kernels (``layers="triton"``, ``dflashkit.infer.kernels``: six launches a layer, the draft step and a tree
round's small steps a kernel each).

Steps (fixed shapes):

- target [1, 1] and [1, B]: write the tokens' keys and values at the engine's length, return their logits
  (float32) and, for a block, the features of the drafter's target layers;
- draft [1, B]: write the context's rows (the kept tokens of the last verified block; rows at or beyond
  the new anchor are rejected drafts: the block's own keys overwrite them, the drafter's mask hides any past
  the block, and committing those positions later writes them again), then draft the block [anchor, MASK x
  (B-1)] over the drafter's cache in place;
- greedy round [1, B]: the draft step, the target step over [anchor, drafts], the acceptance (drafts
  kept while they equal the target's argmax) and the next round's state (its context rows, block start and
  anchor), as one step: a greedy chain round is one replay and one copy to the host (`round`, unless
  ``fused_rounds`` is False; a tree's: below);
- next token [1, 1] (one per temperature and top-p, captured on its first call): autoregressive decoding's
  step, the target step and the next token chosen on the device (`next_token`);
- sampled round [1, B] (one per temperature, top-p and proposal, captured on its first call): the same at
  T > 0 under the rejection rule, the drafts proposed by ``sampling.propose`` and accepted by
  ``sampling.accept_sampled`` from noise written before the replay (`sampled_round`): for a seed, the tokens
  the separate calls commit;
- target tree [1, N+1] (built with ``tree_budget=N``): the root and N nodes of a ``DraftTree``, written at
  start .. start+N, each at rotary position start + depth, under a boolean mask [N+1, capacity] (the cache
  before start, and each node's ancestors and itself) that the step builds from the nodes' parents, so a
  round sends the device one small tensor (tokens, depths, parents); one SDPA under the whole mask
  (``slot_decoder._tree_plan``), as FlashAttention's varlen kernel takes no arbitrary mask (a split attention,
  FlashAttention over the cache before the root plus a small masked attention over the tree's rows merged by
  log-sum-exp, measured slower on an H200: a tree-8 round 2.62 ms against 1.98, and was retired). Returns the
  nodes' logits and features, as a block does;
- tree keep [N+1 rows]: after a tree, move the accepted path's K/V rows to start .. start+len(path)-1 in
  every layer (one gather and one index_copy for all layers' keys, the same for values: the layers are views
  of one tensor), so the caches are a chain's. A path that is the tree's first nodes (0 .. k-1) moves nothing
  and runs no step;
- greedy tree round [N+1 nodes]: the draft step, the tree's build from the drafted slots' probabilities
  (with Triton layers: from their logits, the top-k and the softmax in the build's three kernels), the tree
  step, the walk along the target's argmax, the keep step and the next round's state (with Triton layers: the
  argmax and that state by ``kernels.tree``'s own kernels, a dozen small torch kernels fewer), as one step: a
  greedy tree round is one replay and one copy to the host, as a chain's (`round(tree=True)`, when the budget
  holds a block: N+1 >= B).

With Triton layers and a ``kernel_cache`` file, the kernels' compiled binaries are unpacked from it before
the warm-up and packed into it after (``dflashkit.runtime.triton_cache``), so a second process starts without
compiling them again.

The prefill (any prompt length) runs eagerly. Step inputs and outputs live in buffers allocated once: the
logits an engine call returns are valid until the next call of the same kind (the decode loops read them
at once).

In fp32 greedy outputs and acceptance lengths equal the reference engine's token for token (tested on the
CPU, where the same steps run eagerly). On a GPU in bf16 the kernels differ from transformers' (fused
projections, FlashAttention), so outputs may part from the other engines' after a near tie.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.infer.kernels.decoder import KERNELS, check_runnable, decode_by_kernels, unsupported
from dflashkit.infer.kernels.draft import (
    DraftKernels,
    draft_kernels,
    kernel_draft_step,
    unsupported_drafter,
    write_prompt_context,
)
from dflashkit.infer.round import Context, Round, Verified, check_kept_path, kept_rows, separate_round
from dflashkit.infer.sampling import (
    Sampling,
    accept_sampled,
    choose,
    probabilities,
    propose,
    race,
    rejection_noise,
)
from dflashkit.infer.tree import (
    DraftTree,
    accepted_path,
    ancestors,
    build_tree,
    path_moves,
    read_walk,
    tree_candidates,
    walk_outputs,
)
from dflashkit.model.drafter import DFlashDrafter, StaticDraftCache
from dflashkit.runtime import triton_cache
from dflashkit.runtime.compile_cache import CompileCacheError
from dflashkit.runtime.cuda_graph import Steps
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import (
    Attention,
    DecoderWeights,
    SlotCache,
    decode,
    head_into,
    linear,
    logits,
    rms_norm,
)

LAYERS: tuple[str, ...] = ("torch", "triton")  # what the target's layers run by (``--layers``)


def _attention(device: torch.device, dtype: torch.dtype) -> Attention:
    return "flash" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"


# --- the step functions: plain tensor code over the engine's buffers ------------------------------------


def target_step(
    w: DecoderWeights,
    cache: SlotCache,
    ids: Tensor,
    slot: Tensor,
    start: Tensor,
    out_logits: Tensor,
    out_rows: Tensor | None,
    kv_len: int,
    attention: Attention,
    keep: tuple[int, ...],
    positions: Tensor | None = None,
    mask: Tensor | None = None,
) -> None:
    """ids [1, t] written at position ``start`` of the cache; their float32 logits into ``out_logits`` [t, V]
    and the outputs of the layers ``keep`` (concatenated) into ``out_rows`` [1, t, n*H]. A tree's nodes give
    their own rotary ``positions`` and attention ``mask``."""
    common = dict(kv_len=kv_len, attention=attention, keep=keep, positions=positions, mask=mask)
    x, kept = decode(w, cache, ids, slot, start, **common)  # type: ignore[arg-type]
    head_into(w, rms_norm(x[0], w.norm, w.eps), out_logits)
    if keep:
        assert out_rows is not None
        out_rows.copy_(torch.cat(kept, dim=-1))


def kernel_target_step(
    w: DecoderWeights,
    cache: SlotCache,
    ids: Tensor,
    slot: Tensor,
    start: Tensor,
    out_logits: Tensor,
    out_rows: Tensor | None,
    kv_len: int,
    attention: Attention,
    keep: tuple[int, ...],
    *_: Any,
) -> None:
    """``target_step`` of a chain through the decoder kernels (``dflashkit.infer.kernels.decoder``: six launches a
    layer), for the engine's one slot (``slot`` is its index 0; the kernels read each step's used positions
    from ``start``, so ``kv_len`` and ``attention`` need not say)."""
    decode_by_kernels(w, cache, ids, start, out_logits, out_rows, keep)


def kernel_tree_step(
    w: DecoderWeights,
    cache: SlotCache,
    nodes: Tensor,
    start: Tensor,
    out_logits: Tensor,
    out_rows: Tensor | None,
    keep: tuple[int, ...],
) -> None:
    """The tree step through the decoder kernels: the tree's ``nodes`` [3, N+1] (token, depth, parent; padded
    to the engine's budget) written at ``start``, each node turned by the root's position + its depth and
    reading the cache before ``start``, itself and its ancestors; logits and kept features as
    ``target_step``'s. The mask in one launch (``tree_kernels.ancestors``)."""
    from dflashkit.infer.kernels import tree as tree_kernels  # Triton: the engine checked for it

    positions, seen = start + nodes[1], tree_kernels.ancestors(nodes[2])
    decode_by_kernels(w, cache, nodes[:1], start, out_logits, out_rows, keep, positions=positions, seen=seen)


def kernel_build_step(anchor: Tensor, probs: Tensor, candidates: Tensor, out_nodes: Tensor) -> None:
    """``tree_build_step`` as torch's top-k and one launch (``tree_kernels.build``), with Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.build(anchor, probs, candidates, out_nodes)


def kernel_logits_build_step(anchor: Tensor, logits: Tensor, candidates: Tensor, out_nodes: Tensor) -> None:
    """``kernel_build_step`` of ``softmax(logits)``, from the drafted slots' logits in two launches and no
    softmax (``tree_kernels.build_from_logits``): a greedy tree round's build with Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.build_from_logits(anchor, logits, candidates, out_nodes)


def kernel_walk_step(
    nodes: Tensor, choices: Tensor, start: Tensor, out_walk: Tensor, out_moves: Tensor
) -> None:
    """``tree_walk_step`` in one launch (``tree_kernels.walk``), with Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.walk(nodes, choices, start, out_walk, out_moves)


def keep_step(keys: Tensor, values: Tensor, moves: Tensor) -> None:
    """The keep step: in every layer's ``keys`` and ``values`` [layer, position, kv head, head dim], the rows
    ``moves[0]`` to ``moves[1]`` (all read before any is written), one gather and one copy per tensor."""
    for rows in (keys, values):
        rows.index_copy_(1, moves[1], rows.index_select(1, moves[0]))


def kernel_keep_step(keys: Tensor, values: Tensor, moves: Tensor) -> None:
    """``keep_step`` in one launch that moves only the rows that move (``tree_kernels.keep``), with
    Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.keep(keys, values, moves)


def kernel_argmax(logits: Tensor, out: Tensor) -> None:
    """``out.copy_(logits.argmax(-1))`` in two launches over many programs (``tree_kernels.argmax``: 0.004 ms
    against torch's 0.013 for [1 to 16, 49,152], H100), with Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.argmax(logits, out)


def finish_step(
    walked: Tensor, moves: Tensor, start: Tensor, nodes: Tensor, tree_rows: Tensor, rows: Tensor,
    round_out: Tensor, row_start: Tensor, block_start: Tensor, block: Tensor,
) -> None:  # fmt: skip
    """A fused tree round's tail after the walk (``walked``, ``moves``) and the keep: the next round's context
    ``rows`` [B, W] (the tree step's ``tree_rows`` [N, W] of the path's j-th node for j below its length, else of
    node j: rows past the path's end are masked by the drafter and never committed), ``round_out`` [B + 1]
    (accepted n, those nodes' B - 1 tokens after the root, the target's token at the path's end), ``row_start``
    = ``start``, ``block_start`` += n + 1, ``block[0]`` the target's token (the next anchor)."""
    b = rows.shape[0]
    accepted = walked[: nodes.shape[1]].sum().view(1) - 1  # the path's nodes after the root
    at = moves[0, :b] - start  # B <= N: the moves cover the block
    rows.copy_(tree_rows.index_select(0, at))
    bonus = walked[2 * nodes.shape[1] :]
    round_out.copy_(torch.cat([accepted, nodes[0].index_select(0, at[1:]), bonus]))
    row_start.copy_(start)
    block_start.add_(accepted + 1)
    block[:1].copy_(bonus)


def kernel_finish_step(
    walked: Tensor, moves: Tensor, start: Tensor, nodes: Tensor, tree_rows: Tensor, rows: Tensor,
    round_out: Tensor, row_start: Tensor, block_start: Tensor, block: Tensor,
) -> None:  # fmt: skip
    """``finish_step`` in one launch (``tree_kernels.finish``), with Triton layers."""
    from dflashkit.infer.kernels import tree as tree_kernels

    tree_kernels.finish(
        walked, moves, start, nodes, tree_rows, rows, round_out, row_start, block_start, block
    )


def draft_step(
    drafter: DFlashDrafter,
    cache: StaticDraftCache,
    embed: Tensor,
    lm_head: Tensor,
    rows: Tensor,
    row_start: Tensor,
    block: Tensor,
    block_start: Tensor,
    offsets: Tensor,
    out_logits: Tensor,
    lm_head_packed: Tensor | None = None,
) -> None:
    """Write the context rows (features [1, B, n*H] from position ``row_start``) into the drafter's cache,
    draft the block [1, B] anchored at ``block_start``, and put the drafted slots' float32 logits (the
    target's head, through its packed copy where there is one) into ``out_logits`` [B-1, V]."""
    drafter.write_context(rows, row_start + offsets, cache)
    hidden = drafter.draft_block(embed[block], block_start + offsets, cache, "sdpa")
    out_logits.copy_(linear(hidden[0, 1:].to(lm_head.dtype), lm_head, packed=lm_head_packed))


def tree_build_step(anchor: Tensor, probs: Tensor, candidates: Tensor, out_nodes: Tensor) -> None:
    """``build_tree`` of ``out_nodes``' width less the root (the engine's budget) from the drafted slots'
    ``probs`` [B-1, V] below the root ``anchor`` [1] (``candidates``: the engine's ``tree_candidates``),
    written into ``out_nodes`` [3, N+1]."""
    out_nodes.copy_(build_tree(anchor, probs, out_nodes.shape[1] - 1, candidates).nodes)


def tree_walk_step(
    nodes: Tensor, choices: Tensor, start: Tensor, out_walk: Tensor, out_moves: Tensor
) -> None:
    """``walk_outputs`` of the tree ``nodes`` along the target's ``choices`` into ``out_walk``, and the keep
    step's row moves of the path it finds (``path_moves``, from ``start``) into ``out_moves``."""
    walked = walk_outputs(nodes, choices)
    out_walk.copy_(walked)
    out_moves.copy_(path_moves(walked[: choices.shape[0]].bool(), start))


class WarmUp(dict[str, float]):
    """Seconds per step shape (what ``warm_up`` returns), with Triton layers how many of the kernels'
    binaries the ``kernel_cache`` file served (``kernels_loaded``), and ``notes``: why that file was not used
    or written, a line each."""

    kernels_loaded: int = 0
    notes: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.notes = []


class GraphEngine:
    """Preallocated caches, the fused target forward, and (on a GPU) one CUDA graph per step shape.

    ``capacity`` bounds prompt + new tokens + block. ``graphs`` (default: on a GPU) captures each step;
    without graphs the same steps run eagerly with exact attention widths (the CPU path). ``fixed_shapes``
    (default: with graphs or Triton layers) makes attention read the whole capacity, as a graph must, so the
    graphed path can be tested on the CPU. ``layers``: the target's layers by torch (``"torch"``) or through
    our Triton kernels (``"triton"``, ``dflashkit.infer.kernels``: the chain's and the tree's target steps six
    kernels a layer, the draft step through them too (a drafter with sliding-window layers keeps torch's),
    a tree's build, walk, keep and tail a kernel each; compiled by Triton on their first call, the CPU runs them
    only in Triton's interpreter); ``kernel_cache``: the file of their compiled binaries ``warm_up`` loads
    first and writes after (``runtime.triton_cache``). ``tree_budget`` N: the engine also verifies trees of up
    to N drafted nodes, in one step of N+1 tokens (a smaller tree is padded; the build, walk and keep steps
    captured on a GPU; the tree step attends through one SDPA under its whole mask, or through the kernels'
    attention under the tree's own). Build one per (target, drafter, capacity, tree budget) and reuse it
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
        layers: Literal["torch", "triton"] = "torch",
        kernel_cache: str | os.PathLike[str] | None = None,
        tree_budget: int | None = None,
    ):
        dev = target.device
        graphs = dev.type == "cuda" if graphs is None else graphs
        if graphs and dev.type != "cuda":
            raise DflashkitError("the graphs engine captures CUDA graphs: it needs the target on a GPU")
        if layers not in LAYERS:
            raise DflashkitError(f"GraphEngine(layers={layers!r}): choose {' or '.join(LAYERS)}")
        self._kernels = layers == "triton"
        self.layers = layers
        fixed_shapes = graphs or self._kernels if fixed_shapes is None else fixed_shapes
        self.target, self.drafter, self.capacity = target, drafter, capacity
        self.layer_ids = (
            list(drafter.config.target_layer_ids) if drafter is not None else list(layer_ids or [])
        )
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.w = target.decoder_weights(capacity)
        if self._kernels:
            why = unsupported(self.w)
            if why:
                raise DflashkitError(
                    f"the decoder kernels cannot run this target ({why}): choose --layers torch"
                )
            check_runnable(dev)
        # eager steps on a CPU in bf16: every weight packed once for oneDNN (no-op elsewhere)
        self.packed = not self._kernels and not graphs and self.w.pack_for_cpu()
        self.cache = SlotCache(self.w, slots=1, capacity=capacity)
        self.attention = _attention(dev, self.w.dtype)
        self.steps = Steps(graphs)
        self.graphs = graphs
        self.fixed_shapes = fixed_shapes
        self.kernel_cache = kernel_cache
        # the chain's target steps ([1, 1] and [1, B]) and the tree's: by torch, or the decoder kernels
        self._target_fn: Callable[..., None] = kernel_target_step if self._kernels else target_step
        self._draft_fn: Callable[..., None] = draft_step
        # Triton layers: the draft step through the decoder kernels too, where they can run the drafter
        self._dk: DraftKernels | None = None
        if self._kernels and drafter is not None and unsupported_drafter(drafter) is None:
            self._dk = draft_kernels(drafter, self.w, capacity)
            self._draft_fn = kernel_draft_step
        # a tree's build and walk: torch's, or a kernel each (the build after torch's top-k; in a greedy tree
        # round, two kernels from the drafted slots' logits: ``kernel_logits_build_step``)
        self._build_fn: Callable[..., None] = kernel_build_step if self._kernels else tree_build_step
        self._walk_fn: Callable[..., None] = kernel_walk_step if self._kernels else tree_walk_step
        self._length = 0  # positions held by the target cache: the next write goes here
        self._open: Verified | None = None  # the last verify, until keep() settles the caches
        self._tree_open = False  # the last verify was a tree's
        self.context: Context | None = None  # what the drafter has not read yet, for separate calls' rounds
        self._first_round = False  # prefill ran, no one-step round since: the next one starts at its anchor
        B, V, long = self.block_size, self.w.vocab_size, dict(dtype=torch.long, device=dev)
        self._slot = torch.zeros(1, **long)  # type: ignore[arg-type]
        self._start = torch.zeros(1, **long)  # type: ignore[arg-type]  # where a target step writes
        self._ids = {t: torch.zeros(1, t, **long) for t in {1, B}}  # type: ignore[arg-type]
        self._logits = {t: torch.zeros(t, V, dtype=torch.float32, device=dev) for t in {1, B}}
        # the drafter's keys and values (the draft kernels keep their own)
        self._dcache = drafter.new_static_cache(capacity) if drafter is not None and not self._dk else None
        if drafter is not None:
            width = len(self.layer_ids) * target.hidden_size
            self._rows = torch.zeros(1, B, width, dtype=self.w.dtype, device=dev)  # the last block's features
            self._row_start = torch.zeros(1, **long)  # type: ignore[arg-type]
            self._block = torch.full((1, B), drafter.config.mask_token_id, **long)  # type: ignore[arg-type]
            self._block_start = torch.zeros(1, **long)  # type: ignore[arg-type]
            self._draft_logits = torch.zeros(B - 1, V, dtype=torch.float32, device=dev)
            self._round_out = torch.zeros(B + 1, **long)  # type: ignore[arg-type]  # a fused round's
            self._block_choices = torch.zeros(B, **long)  # type: ignore[arg-type]  # a greedy round's target's
            # a sampled round's noise (`sampling.rejection_noise`), written before each replay
            self._noise = (
                torch.ones(B, V, dtype=torch.float32, device=dev),
                torch.zeros(B - 1, dtype=torch.float32, device=dev),
            )
        # a one-step round's or token's temperature and top-p (constants of the captured step: its key names them)
        self._step_sampling = Sampling()
        self._token_noise = torch.ones(V, dtype=torch.float32, device=dev)  # `next_token`'s race, at T > 0
        self._token_out = torch.zeros(1, **long)  # type: ignore[arg-type]
        # chain rounds as one step (`greedy_round`, `sampled_round`) and autoregressive tokens (`next_token`);
        # False: draft, verify and keep as separate calls, and a token as verify and the host's choice
        self.fused_rounds = True
        self._offsets = torch.arange(B, device=dev)[None]
        self.tree_budget = tree_budget or None
        if self.tree_budget:
            self._new_tree_buffers(self.tree_budget + 1)

    def _new_tree_buffers(self, n: int) -> None:
        """The tree step's inputs and outputs for n = N+1 tokens, and the keep step's row moves."""
        dev, long = self.target.device, torch.long
        # per node: token, depth, parent (the root's and padding nodes': themselves)
        self._tree_inputs = torch.zeros(3, n, dtype=long, device=dev)
        self._tree_logits = torch.zeros(n, self.w.vocab_size, dtype=torch.float32, device=dev)
        self._tree_rows: Tensor | None = None
        if self.drafter is not None:
            self._tree_rows = torch.zeros(1, n, self._rows.shape[-1], dtype=self.w.dtype, device=dev)
        self._cache_positions = torch.arange(self.capacity, device=dev)
        self._moves = torch.zeros(2, n, dtype=long, device=dev)  # cache rows: from (the path's), to
        # the walk step's input (the target's choice after each node) and output (`walk_outputs`)
        self._choices = torch.zeros(n, dtype=long, device=dev)
        self._walked_out = torch.zeros(2 * n + 1, dtype=long, device=dev)
        self._walked: list[int] | None = None  # the path whose row moves the walk step wrote
        if (
            self.drafter is not None
        ):  # the build step's inputs: the root's token, the drafted slots' probabilities
            self._anchor = torch.zeros(1, dtype=long, device=dev)
            self._tree_probs = torch.zeros(self.block_size - 1, self.w.vocab_size, device=dev)
            # the rank branches the build scores: made here, once (a copy from the host cannot be captured)
            self._tree_candidates = tree_candidates(self.block_size - 1, self.w.vocab_size, n - 1, dev)
            # the kernels engine: a table beyond the build kernel's one program builds by torch's top-k (eager,
            # captured as any step)
            if self._kernels:
                from dflashkit.infer.kernels import tree as tree_kernels

                fits = tree_kernels.builds(self._tree_candidates.shape[1])
                self._build_fn = kernel_build_step if fits else tree_build_step
            # a sampled tree round's noise: the target's draw at every node (`sampling.choose`'s), written
            # before each replay
            self._tree_noise = torch.ones(n, self.w.vocab_size, dtype=torch.float32, device=dev)

    # --- the steps (fixed shapes; one CUDA graph each with graphs) ----------------------------------

    def _kv_len(self, t: int) -> int:
        """The positions attention may read: fixed for a graph (FlashAttention then reads only the used
        ones), exact when eager."""
        return self.capacity if self.fixed_shapes else self._length + t

    def _target_step(self, t: int) -> None:
        keep = tuple(self.layer_ids) if t == self.block_size and self.drafter is not None else ()
        self._target_fn(
            self.w,
            self.cache,
            self._ids[t],
            self._slot,
            self._start,
            self._logits[t],
            self._rows if keep else None,
            self._kv_len(t),
            self.attention,
            keep,
        )

    def _tree_step(self) -> None:
        """The target step over the tree's nodes (by torch, or through the decoder kernels)."""
        keep = tuple(self.layer_ids) if self.drafter is not None else ()
        if self._kernels:
            w, cache, nodes, start = self.w, self.cache, self._tree_inputs, self._start
            kernel_tree_step(w, cache, nodes, start, self._tree_logits, self._tree_rows, keep)
            return
        target_step(
            self.w,
            self.cache,
            self._tree_inputs[:1],
            self._slot,
            self._start,
            self._tree_logits,
            self._tree_rows,
            self._kv_len(self._tree_inputs.shape[1]),
            "sdpa",  # a tree step attends through one SDPA under its mask (slot_decoder._tree_plan)
            keep,
            self._start + self._tree_inputs[1:2],  # positions: the root's + depth
            self._tree_mask(),
        )

    def _build_step(self) -> None:
        """The tree of the engine's budget from ``_tree_probs``, written as the tree step's inputs."""
        self._build_fn(self._anchor, self._tree_probs, self._tree_candidates, self._tree_inputs)

    def _tree_mask(self) -> Tensor:
        """[1, N+1, capacity] bool: node i sees the cache before start and, at start .. start+N, itself and
        its ancestors."""
        n = self._tree_inputs.shape[1]
        seen = ancestors(self._tree_inputs[2])
        at = self._cache_positions - self._start  # cache position relative to the root
        in_tree = seen[:, at.clamp(0, n - 1)] & (at < n)
        return ((at < 0) | in_tree)[None]

    def _walk_step(self) -> None:
        """The walk over the tree step's nodes and ``_choices`` (``walk_outputs``), and the keep step's row
        moves for the path it finds, so that keeping it needs nothing from the host."""
        self._walk_fn(self._tree_inputs, self._choices, self._start, self._walked_out, self._moves)

    def _keep_step(self) -> None:
        """Move the cache rows ``_moves[0]`` to ``_moves[1]`` in every layer's keys and values (all rows
        are read before any is written): every layer at once (the layers are views of one tensor; a layer at
        a time was 120 small kernels for the embedded target), one launch with the kernels."""
        # [layer, position, kv head, head dim]: the engine's one slot (self._slot)
        keep = kernel_keep_step if self._kernels else keep_step
        keep(self.cache.keys[:, 0], self.cache.values[:, 0], self._moves)

    def _draft_step(self) -> None:
        self._draft_fn(*self._draft_args())

    def _draft_args(self) -> tuple[Any, ...]:
        if self._dk is not None:
            args = (self._rows, self._row_start, self._block, self._block_start)
            return (self._dk, *args, self._draft_logits)
        drafter, cache = self._need_drafter(), self._dcache
        assert cache is not None
        return (
            drafter,
            cache,
            self.w.embed,
            self.w.lm_head,
            self._rows,
            self._row_start,
            self._block,
            self._block_start,
            self._offsets,
            self._draft_logits,
            self.w.lm_head_packed,
        )

    def _round_step(self) -> None:
        """A greedy chain round on the device: draft the block anchored at ``_block_start``, verify [anchor,
        drafts] there, accept the drafts while they equal the target's choices, and leave the next round's
        state (`_next_round`). Writes [accepted n, the B-1 drafts, the target's token] to ``_round_out``."""
        B = self.block_size
        self._draft_step()
        drafts = self._ids[B][0, 1:]  # written where the verify reads them
        self._argmax(self._draft_logits, drafts)
        self._verify_block()
        choices = self._block_choices
        self._argmax(self._logits[B], choices)
        n = (drafts == choices[:-1]).long().cumprod(0).sum().view(1)
        self._next_round(n, drafts, choices.index_select(0, n))

    def _argmax(self, logits: Tensor, out: Tensor) -> None:
        """``out`` = each row's argmax of ``logits`` [R, V] (a kernel of ``kernels.tree`` with Triton layers)."""
        if self._kernels:
            kernel_argmax(logits, out)
        else:
            out.copy_(logits.argmax(-1))

    def _sampled_round_step(self) -> None:
        """A sampled chain round on the device under the rejection rule (`sampling.accept_sampled`), from the
        noise in ``_noise`` and the temperature, top-p and proposal of ``_step_sampling`` (constants of the
        captured step: its key names them): draft, propose the drafts (`sampling.propose`), verify, accept,
        the next round's state, as `_round_step` does greedily."""
        B, s = self.block_size, self._step_sampling
        races, uniforms = self._noise
        self._draft_step()
        proposed, q = propose(self._draft_logits, s, races[:-1])
        drafts = self._ids[B][0, 1:]  # written where the verify reads them
        drafts.copy_(proposed)
        self._verify_block()
        n, token = accept_sampled(drafts, q, probabilities(self._logits[B], s), uniforms, races[-1])
        self._next_round(n, drafts, token)

    def _verify_block(self) -> None:
        """The target step over [anchor, drafts] at the block's start (the drafts written into its ids)."""
        B = self.block_size
        self._ids[B][0, :1].copy_(self._block[0, :1])
        self._start.copy_(self._block_start)
        self._target_step(B)

    def _next_round(self, n: Tensor, drafts: Tensor, token: Tensor) -> None:
        """After a chain round that kept n [1] drafts and then ``token`` [1]: write [n, drafts, token] to
        ``_round_out``, and leave the next round's state (its context rows start at this block, its block
        after the kept drafts, anchored at ``token``)."""
        self._round_out.copy_(torch.cat([n, drafts, token]))
        self._row_start.copy_(self._start)
        self._block_start.add_(n + 1)
        self._block[0, :1].copy_(token)

    def _tree_round_step(self) -> None:
        """A greedy tree round on the device (the chain's ``_round_step`` for trees): draft the block anchored
        at ``_block_start``, build the tree of the engine's budget from the drafted slots' probabilities,
        verify it there, walk it along the target's argmax, keep the accepted path as a chain would have
        left the caches, and leave the next round's state (its context rows: the path's features, from the
        root; its block after the path, anchored at the target's token at the path's end). Writes [accepted
        n, the path's B-1 tokens after the root (the first n valid), the target's token] to ``_round_out``."""
        self._tree_round(sampled=False)

    def _sampled_tree_round_step(self) -> None:
        """A sampled tree round on the device under the exact rule (the target draws its own token at every
        node, from ``_tree_noise`` and the temperature and top-p of ``_step_sampling``, and the walk follows its
        draws), the tree built from the drafter's distributions at that temperature; otherwise as
        ``_tree_round_step``."""
        self._tree_round(sampled=True)

    def _tree_round(self, sampled: bool) -> None:
        """The body of both tree rounds: the target's choice at every node its argmax, or (``sampled``) its
        draw at ``_step_sampling``'s temperature from ``_tree_noise``."""
        s = self._step_sampling
        self._draft_step()
        logits, candidates = self._draft_logits, self._tree_candidates
        # with the kernels, a greedy round's softmax and top-k are in the build's kernels
        if not sampled and self._build_fn is kernel_build_step:
            kernel_logits_build_step(self._block[0, :1], logits, candidates, self._tree_inputs)
        else:
            self._anchor.copy_(self._block[0, :1])
            self._tree_probs.copy_(probabilities(logits, s) if sampled else torch.softmax(logits, dim=-1))
            self._build_step()
        self._start.copy_(self._block_start)
        self._tree_step()
        if sampled:
            self._choices.copy_(race(probabilities(self._tree_logits, s), self._tree_noise))
        else:
            self._argmax(self._tree_logits, self._choices)
        self._walk_step()
        self._keep_step()
        assert self._tree_rows is not None
        finish = kernel_finish_step if self._kernels else finish_step
        finish(
            self._walked_out, self._moves, self._start, self._tree_inputs, self._tree_rows[0], self._rows[0],
            self._round_out, self._row_start, self._block_start, self._block[0],
        )  # fmt: skip

    def _run(self, key: tuple[Any, ...], step: Callable[[], None]) -> None:
        """One step: replayed (graphs: captured on its first run) or called."""
        self.steps.run(key, step)

    def _check_room(self, t: int) -> None:
        """Refuse a step that would write past the caches (``reserve`` refuses such a generation first)."""
        if self._length + t > self.capacity:
            raise DflashkitError(
                f"the graphs engine's cache of {self.capacity} positions is full; reserve() first"
            )

    def _need_drafter(self) -> DFlashDrafter:
        if self.drafter is None:
            raise DflashkitError(
                "this graphs engine was built without a drafter: it decodes autoregressively only"
            )
        return self.drafter

    # --- the engine calls ----------------------------------------------------------------------------

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None:
        """Refuse a generation the preallocated caches cannot hold, before anything runs. ``width``: the
        positions one round writes (``round_width``: the block, or a tree's N+1; default the block)."""
        width = max(width or 0, self.block_size)
        need = prompt_len + max_new_tokens + width
        if need > self.capacity:
            raise DflashkitError(
                f"the graphs engine holds {self.capacity} positions, but a prompt of {prompt_len} tokens + "
                f"max_new_tokens {max_new_tokens} + a round of {width} needs {need}: build it with "
                f"capacity >= {need}, shorten the prompt or max_new_tokens, or use --engine dynamic"
            )

    @torch.no_grad()
    def prefill(self, prompt: Tensor) -> tuple[Tensor, Context]:
        """The prompt, eagerly; the drafter reads the prompt's features here too, so the context handed
        back is empty."""
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
            features = torch.cat(kept, dim=-1)
            if self._dk is not None:
                write_prompt_context(self._dk, features)
            else:
                assert self._dcache is not None
                positions = torch.arange(P, device=prompt.device)[None]
                self.drafter.write_context(features, positions, self._dcache)
            self._rows.zero_()  # the first draft step's rows sit at the anchor and beyond: masked
        self._open = None
        empty = torch.zeros(1, 0, len(self.layer_ids) * self.target.hidden_size, device=prompt.device)
        self.context = Context(empty, P)
        self._first_round = True
        return logits(self.w, x[0, -1:])[0], self.context

    @torch.no_grad()
    def draft(self, context: Context, anchor: int) -> Tensor:
        self._need_drafter()
        rows = context.features
        if rows.shape[1] > self.block_size:
            raise ValueError(
                f"the graphs engine's draft step reads at most {self.block_size} context rows, got {rows.shape[1]}"
            )
        if rows.shape[1] and rows.data_ptr() != self._rows.data_ptr():  # kept rows of a block: already there
            self._rows[:, : rows.shape[1]].copy_(rows)
        self._row_start.fill_(context.start)
        self._block[0, 0] = anchor
        self._block_start.fill_(context.end)
        self._run(("draft",), self._draft_step)
        return self._draft_logits

    @torch.no_grad()
    def verify(self, ids: Tensor) -> Verified:
        t = ids.shape[1]
        if t not in self._ids:
            raise ValueError(f"the graphs engine's target steps take 1 or {self.block_size} tokens, got {t}")
        return self._target_pass(ids, ("target", t), lambda: self._target_step(t))

    def _target_pass(self, ids: Tensor, key: tuple[Any, ...], step: Callable[[], None]) -> Verified:
        """Run ``step`` (a target step over ``ids`` [1, t], with what else it does) at the engine's length;
        its logits and features are open until ``keep``."""
        t = ids.shape[1]
        self._check_room(t)
        self._ids[t].copy_(ids)
        self._start.fill_(self._length)
        self._run(key, step)
        features = self._rows if t == self.block_size and self.drafter is not None else None
        self._open = Verified(self._logits[t], features, self._length)
        self._tree_open = False
        self._length += t
        return self._open

    @torch.no_grad()
    def next_token(self, token: Tensor, s: Sampling, gen: torch.Generator | None) -> Tensor:
        """Autoregressive decoding's step: the target step over ``token`` (one id, on the device) and the next
        token chosen there (argmax; at T > 0 raced from noise ``gen`` draws first, as `sampling.choose` draws
        it), as one step (`_next_token_step`: one replay; the caller's read of the token is the copy to the
        host). Returns the token [1], valid until the next call. With ``fused_rounds`` False: a verify and the
        host's choice."""
        if not self.fused_rounds:
            return choose(self.verify(token.view(1, 1)).logits[-1], s, gen)
        if not s.greedy:
            self._token_noise.exponential_(generator=gen)
        self._step_sampling = s
        key = ("next token",) if s.greedy else ("next token", s.temperature, s.top_p)
        self._target_pass(token.view(1, 1), key, self._next_token_step)
        return self._token_out

    def _next_token_step(self) -> None:
        """The target step over one token, and the next one chosen from its logits (`next_token`)."""
        self._target_step(1)
        logits, s = self._logits[1], self._step_sampling
        if s.greedy:
            self._argmax(logits, self._token_out)
        else:
            self._token_out.copy_(race(probabilities(logits[-1], s), self._token_noise).view(1))

    @torch.no_grad()
    def round(
        self, anchor: int, s: Sampling, gen: torch.Generator | None, tree_budget: int | None = None
    ) -> Round:
        """One round: as one step where one applies (`fuses_rounds` and `fuses`: `greedy_round`,
        `sampled_round`; one replay, one copy to the host), else as the separate calls
        (``round.separate_round``). A one-step round starts at ``anchor`` after ``prefill``; later ones
        continue from the state the last one left on the device. Its path is the committed tokens' nodes."""
        if not (self.fuses_rounds(tree_budget) and fuses(s, tree_budget)):
            return separate_round(self, anchor, s, gen, tree_budget)
        start = anchor if self._first_round else None
        self._first_round = False
        self.context = None  # the device holds the next round's context rows
        tree = bool(tree_budget)
        committed = (
            self.greedy_round(start, tree) if s.greedy else self.sampled_round(start, s, gen, tree=tree)
        )
        return Round(committed, list(range(len(committed))))

    def fuses_rounds(self, tree_budget: int | None = None) -> bool:
        """Whether a round runs as one step (`greedy_round`, `sampled_round`): the chain's (no ``tree_budget``),
        or a greedy tree of the engine's own budget that holds at least a block of nodes (its path fills the
        next round's context rows)."""
        if not self.fused_rounds or self.drafter is None:
            return False
        if not tree_budget:
            return True
        return tree_budget == self.tree_budget and tree_budget + 1 >= self.block_size

    @torch.no_grad()
    def greedy_round(self, anchor: int | None = None, tree: bool = False) -> list[int]:
        """One greedy round as one step (`_round_step`, or `_tree_round_step` with ``tree``: a tree of the
        engine's budget; one replay, one copy to the host), instead of the draft, verify (or build, verify
        and walk) and keep calls with the host's glue between them. ``anchor``: given on the first round
        after ``prefill`` (the target's token after the prompt); later rounds continue from the state the
        last one left on the device. Returns the committed tokens: the accepted drafts (a tree: the accepted
        path's tokens), then the target's own token."""
        self._need_drafter()
        if not self.fuses_rounds(self.tree_budget if tree else None):
            raise DflashkitError(
                f"this graphs engine runs no greedy {'tree' if tree else 'chain'} round as one step "
                f"(fused_rounds {self.fused_rounds}, tree budget {self.tree_budget}, block {self.block_size})"
            )
        self._check_room(self._tree_inputs.shape[1] if tree else self.block_size)
        self._start_rounds(anchor)
        if tree:
            self._run(("tree round", self._tree_inputs.shape[1]), self._tree_round_step)
        else:
            self._run(("round",), self._round_step)
        return self._committed()

    @torch.no_grad()
    def sampled_round(
        self, anchor: int | None, s: Sampling, gen: torch.Generator | None, tree: bool = False
    ) -> list[int]:
        """One sampled chain round under the rejection rule as one step (`_sampled_round_step`: one replay of
        the step captured for this temperature, top-p and proposal, one copy to the host), from noise ``gen`` draws
        first, in the order the separate calls draw it (`sampling.rejection_noise`): for a seed, the tokens
        the draft, verify and keep calls commit. ``anchor`` as for `greedy_round`. ``tree``: a sampled tree
        round of the engine's budget (`_sampled_tree_round_step`; a tree always takes the exact rule), its
        noise the target's draw at every node, as `sampling.choose` draws it in the separate calls."""
        self._need_drafter()
        if tree:
            if s.greedy or not self.fuses_rounds(self.tree_budget):
                raise DflashkitError(
                    f"this graphs engine runs a sampled tree round as one step at T > 0 only, with a tree "
                    f"budget (temperature {s.temperature}, tree budget {self.tree_budget}, fused_rounds "
                    f"{self.fused_rounds})"
                )
            n = self._tree_inputs.shape[1]
            self._check_room(n)
            self._start_rounds(anchor)
            self._tree_noise.exponential_(generator=gen)
            self._step_sampling = s
            self._run(("sampled tree round", n, s.temperature, s.top_p), self._sampled_tree_round_step)
            return self._committed()
        if s.greedy or s.rule != "rejection" or not self.fuses_rounds():
            raise DflashkitError(
                f"this graphs engine runs a sampled chain round as one step under the rejection rule at T > 0 "
                f"only (temperature {s.temperature}, rule {s.rule}, fused_rounds {self.fused_rounds})"
            )
        B = self.block_size
        self._check_room(B)
        self._start_rounds(anchor)
        rejection_noise(B, self.w.vocab_size, gen, self.target.device, out=self._noise)
        self._step_sampling = s
        self._run(("sampled round", s.temperature, s.top_p, s.draft_sampling), self._sampled_round_step)
        return self._committed()

    def _start_rounds(self, anchor: int | None) -> None:
        """On the first fused round after ``prefill``: the drafter's context rows and block start at the
        prompt's end, anchored at the target's token after it."""
        if anchor is not None:
            self._row_start.fill_(self._length)  # the prompt's features are in the drafter's cache already
            self._block_start.fill_(self._length)
            self._block[0, 0] = anchor

    def _committed(self) -> list[int]:
        """A fused round's committed tokens from ``_round_out`` (one copy to the host); the caches hold them."""
        out = self._round_out.tolist()
        n = out[0]
        self._length += n + 1
        self._open = None
        return out[1 : 1 + n] + [out[self.block_size]]

    @torch.no_grad()
    def build_tree(self, anchor: int, probs: Tensor, budget: int) -> DraftTree:
        """``dflashkit.infer.tree.build_tree`` as one step (captured on a GPU: 47 operations eager, in one
        replay): the tree of the engine's budget from the drafted slots' probabilities ``probs`` [B-1, V],
        written straight into the tree step's inputs (the returned tree is a view of them, valid until the
        next build). Another budget is built eagerly."""
        if budget != self.tree_budget or self.drafter is None or probs.shape != self._tree_probs.shape:
            return build_tree(anchor, probs, budget)
        self._anchor.fill_(anchor)
        self._tree_probs.copy_(probs)
        self.steps.run(("build", budget + 1), self._build_step)
        return DraftTree(self._tree_inputs)

    @torch.no_grad()
    def verify_tree(self, tree: DraftTree) -> Verified:
        """The nodes of ``tree`` in one target step of N+1 tokens (padded when the tree is smaller): logits
        [len(tree), V] and features, valid until the next tree step."""
        n = self._tree_width(len(tree))
        start = self._length
        self._check_room(n)
        self._fill_tree(tree)
        self._start.fill_(start)
        self._run(("tree", n), self._tree_step)
        features = None if self._tree_rows is None else self._tree_rows[:, : len(tree)]
        self._open = Verified(self._tree_logits[: len(tree)], features, start)
        self._tree_open = True
        self._length = start + n
        return self._open

    @torch.no_grad()
    def walk(self, tree: DraftTree, choices: Tensor) -> tuple[list[int], list[int]]:
        """``dflashkit.infer.tree.accepted_path`` for the tree just verified, as one step (captured on a GPU:
        the walk's ~30 small kernels in one replay) that also writes the row moves ``keep`` needs; one copy
        to the host. Another tree (not built by ``build_tree`` into this engine's inputs) walks eagerly."""
        own = tree.nodes.data_ptr() == self._tree_inputs.data_ptr() and choices.shape == self._choices.shape
        if not (self._tree_open and own):
            return accepted_path(tree, choices)
        self._choices.copy_(choices)
        self.steps.run(("walk",), self._walk_step)
        path, committed = read_walk(self._walked_out.tolist(), self._choices.shape[0])
        self._walked = path
        return path, committed

    def _tree_width(self, nodes: int) -> int:
        """The tree step's tokens (N+1), once a tree of ``nodes`` (its root included) fits it."""
        if not self.tree_budget:
            raise DflashkitError(
                "this graphs engine was built without a tree budget: build it with tree_budget=N "
                "(ready_engine(..., tree_budget=N)) to verify trees of N drafted nodes"
            )
        if nodes > self.tree_budget + 1:
            raise DflashkitError(
                f"this graphs engine verifies trees of up to {self.tree_budget} drafted nodes, got "
                f"{nodes - 1}: build it with tree_budget={nodes - 1}"
            )
        return self.tree_budget + 1

    def _fill_tree(self, tree: DraftTree) -> None:
        """The tree step's inputs: tokens, depths and parents, copied as they are (a tree built on the device
        never leaves it). Padding nodes beyond a smaller tree are their own parents: they see the cache and
        themselves; no node sees them."""
        n, width = len(tree), self._tree_inputs.shape[1]
        if tree.nodes.data_ptr() == self._tree_inputs.data_ptr():  # built by build_tree: in place already
            return
        self._tree_inputs[:, :n].copy_(tree.nodes, non_blocking=True)
        if n < width:
            self._tree_inputs[:2, n:].zero_()
            self._tree_inputs[2, n:].copy_(torch.arange(n, width), non_blocking=True)

    def keep(self, verified: Verified, path: Sequence[int]) -> Context:
        n = check_kept_path(verified, self._open, path)
        if list(path) != list(range(n)):
            if not self._tree_open:
                raise ValueError(f"a chain keeps its first tokens, not the path {list(path)}")
            self._move_rows(verified.start, path)
        self._open = None
        self._walked = None
        self._length = verified.start + n  # the next step writes from here; positions beyond are never read
        self.context = Context(kept_rows(verified.features, path), verified.start)
        return self.context

    def _move_rows(self, start: int, path: Sequence[int]) -> None:
        """The keep step: the path's K/V rows to start .. start+len(path)-1. The step moves N+1 rows: row
        start+j takes the path's j-th node, or itself past the path's end."""
        if self._walked is None or list(path) != self._walked:  # else the walk step wrote the moves
            width = self._moves.shape[1]
            frm = [start + node for node in path] + list(range(start + len(path), start + width))
            self._moves.copy_(torch.tensor([frm, list(range(start, start + width))]))
        self.steps.run(("keep",), self._keep_step)

    # --- warm-up -----------------------------------------------------------------------------------

    @torch.no_grad()
    def warm_up(self) -> WarmUp:
        """Capture (``graphs``) every step shape now, and with Triton layers compile their kernels (around the
        ``kernel_cache`` file when there is one). Returns seconds per step shape (a ``WarmUp``); eager torch
        layers without graphs: a no-op. The build, tree and keep steps too when built with a tree budget. The
        writes land at positions 0 .. max(B, N+1) - 1: rows beyond a sequence's length, which no step reads."""
        seconds = WarmUp()
        if not (self.graphs or self._kernels):
            return seconds
        B = self.block_size
        steps: dict[str, tuple[tuple[Any, ...], Callable[[], None]]] = {
            f"target [1, {t}]": (("target", t), lambda t=t: self._target_step(t)) for t in sorted({1, B})
        }
        if self.drafter is not None:
            steps[f"draft [1, {B}]"] = (("draft",), self._draft_step)
        with self._kernel_cache(seconds):
            self._start.zero_()
            if self.drafter is not None:
                self._row_start.zero_()
                self._block_start.fill_(B)
            for name, (key, step) in steps.items():
                seconds[name] = self._warm_step(key, step)
            if self.drafter is not None:  # the round: the two steps above and the glue, captured as one
                self._block_start.zero_()
                seconds[f"greedy round [1, {B}]"] = self._warm_step(("round",), self._round_step)
            # autoregressive decoding's greedy step (the target step and the argmax); a temperature's is
            # captured on its first call, as a sampled round's
            self._step_sampling = Sampling()
            seconds["next token [1, 1]"] = self._warm_step(("next token",), self._next_token_step)
            if self.tree_budget:
                seconds.update(self._warm_tree())
        return seconds

    def _warm_tree(self) -> dict[str, float]:
        """Capture the tree step (over a chain of N+1 tokens at positions 0 .. N), the walk step and the keep
        step (every row onto itself)."""
        n, dev = self._tree_inputs.shape[1], self.target.device
        seconds: dict[str, float] = {}
        if self.drafter is not None:
            self._tree_probs.fill_(1.0 / self.w.vocab_size)
            seconds[f"tree build [{n} nodes]"] = self._warm_step(("build", n), self._build_step)
        self._start.zero_()
        nodes = torch.arange(n, device=dev)
        self._tree_inputs.copy_(torch.stack([torch.zeros_like(nodes), nodes, (nodes - 1).clamp(min=0)]))
        seconds[f"target tree [1, {n}]"] = self._warm_step(("tree", n), self._tree_step)
        self._choices.zero_()
        seconds[f"tree walk [{n} nodes]"] = self._warm_step(("walk",), self._walk_step)
        self._moves.copy_(nodes.expand(2, n))
        seconds[f"tree keep [{n} rows]"] = self._warm_step(("keep",), self._keep_step)
        if self.fuses_rounds(self.tree_budget):  # the greedy tree round: the steps above and the glue, as one
            self._block_start.zero_()
            self._row_start.zero_()
            seconds[f"greedy tree round [{n} nodes]"] = self._warm_step(
                ("tree round", n), self._tree_round_step
            )
        return seconds

    def _warm_step(self, key: tuple[Any, ...], step: Callable[[], None]) -> float:
        """Run a step for the first time (capture it; Triton compiles a kernel's first launch); its seconds, to
        the device's end."""
        t0 = time.perf_counter()
        self.steps.run(key, step)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def _kernel_cache(self, seconds: WarmUp) -> Iterator[None]:
        """The decoder kernels' compiled binaries (Triton layers, with a ``kernel_cache`` file): unpacked from
        it before the warm-up, packed into it after (``runtime.triton_cache``);
        what failed is a note, never an error. Written only when the warm-up compiled a kernel it lacks."""
        if not (self._kernels and self.kernel_cache is not None):
            yield
            return
        from dflashkit.infer.kernels import tree as tree_kernels

        path = Path(self.kernel_cache)
        names = [f"{k}_kernel" for k in KERNELS] + list(tree_kernels.KERNELS)
        before = triton_cache.listing()
        if path.is_file():
            try:
                seconds.kernels_loaded = triton_cache.load(path)
            except CompileCacheError as e:
                seconds.notes.append(f"the kernels' cache not used: {e}")
        with triton_cache.launchers_loaded() as loaded:
            yield
        held = triton_cache.held(path) if path.is_file() else set()
        # the launchers this warm-up loaded (built or found), built (new in the folder), or the file held
        launchers = triton_cache.launchers(loaded | (triton_cache.listing() - before) | held)
        if path.is_file() and {d.name for d in [*triton_cache.entries(names), *launchers]} <= held:
            return
        try:
            triton_cache.save(path, names, launchers)
        except (CompileCacheError, OSError) as e:
            seconds.notes.append(f"the kernels' cache not written: {e}")


def fuses(s: Sampling, tree_budget: int | None) -> bool:
    """Whether a round of these settings runs as one step on an engine that fuses rounds: a greedy chain or
    tree, a sampled chain under the rejection rule, or a sampled tree (a tree always takes the exact rule)."""
    return s.greedy or bool(tree_budget) or s.rule == "rejection"

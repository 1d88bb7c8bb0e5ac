"""A tree round's small steps as one Triton kernel each, for the "graphs-kernels" engine.

Between the draft and the next round a tree round has two steps of its own around the target's tree step: the
tree's mask (``tree.ancestors``: each node and its ancestors) and the walk (``tree.walk_outputs`` and
``tree.path_moves``: the accepted path and the cache rows that keep it as a chain). In torch they are a few
dozen tiny kernels (the mask by repeated squaring, the walk by masks, reductions and a scatter); each is a
walk up at most n - 1 parents over n <= 128 nodes, which one program does with the parents in registers
(``tl.gather``), in one launch. Same outputs as the torch functions, for any tree (tested against them; on
the CPU in Triton's interpreter). Imported only where Triton is (``target.kernels.triton_missing``).

(No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.)
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def ancestors_kernel(PARENTS, SEEN, N: tl.constexpr, BLOCK: tl.constexpr):
    """SEEN [N, N] int8: row i marks node i and its ancestors (``tree.ancestors``), by walking each node's
    parents N - 1 times (the root and padding nodes are their own parents, so a walk stays there)."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    parents = tl.load(PARENTS + i, mask=ok, other=0).to(tl.int32)
    at = i
    seen = i[:, None] == i[None, :]
    for _ in range(N - 1):
        at = tl.gather(parents, at, 0)
        seen = seen | (i[None, :] == at[:, None])
    tl.store(SEEN + i[:, None] * N + i[None, :], seen.to(tl.int8), mask=ok[:, None] & ok[None, :])


@triton.jit
def walk_kernel(NODES, CHOICES, START, WALK, MOVES, N: tl.constexpr, BLOCK: tl.constexpr):
    """``tree.walk_outputs`` of NODES [3, N] (token, depth, parent) and the target's CHOICES [N] into WALK
    [2N + 1], and ``tree.path_moves`` of the path it finds into MOVES [2, N] (from START)."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    tokens = tl.load(NODES + i, mask=ok, other=-1)
    depths = tl.load(NODES + N + i, mask=ok, other=-1)
    parents = tl.load(NODES + 2 * N + i, mask=ok, other=0).to(tl.int32)
    choices = tl.load(CHOICES + i, mask=ok, other=-1)
    # a node matches when its token is its parent's choice (the root always; padding never)
    match = ((tokens == tl.gather(choices, parents, 0)) & (parents != i)) | (i == 0)
    matched = (match & ok).to(tl.int32)
    accepted = matched
    at = i
    for _ in range(N - 1):  # accepted: it and every ancestor matched
        at = tl.gather(parents, at, 0)
        accepted = accepted & tl.gather(matched, at, 0)
    last = tl.argmax(tl.where(accepted != 0, depths, -1), 0)  # the first of the deepest accepted nodes
    on_path = i == last
    node = last
    for _ in range(N - 1):  # the path: the last node and its ancestors
        node = tl.load(NODES + 2 * N + node)
        on_path = on_path | (i == node)
    tl.store(WALK + i, on_path.to(tl.int64), mask=ok)
    tl.store(WALK + N + i, tokens, mask=ok)
    tl.store(WALK + 2 * N, tl.load(CHOICES + last))
    # the cache rows: the path's j-th node (in node order: by depth) moves to start + j; the rest stay
    start = tl.load(START)
    rank = tl.cumsum(on_path.to(tl.int32), 0) - 1
    length = tl.sum(on_path.to(tl.int32), 0)
    tl.store(MOVES + i, start + i, mask=ok & (i >= length))
    tl.store(MOVES + rank, start + i, mask=ok & on_path)
    tl.store(MOVES + N + i, start + i, mask=ok)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def ancestors(parents: Tensor) -> Tensor:
    """``tree.ancestors`` in one launch: [n, n] int8 (1: node i reads node j)."""
    n = parents.shape[0]
    seen = torch.empty(n, n, dtype=torch.int8, device=parents.device)
    ancestors_kernel[(1,)](parents, seen, N=n, BLOCK=_block(n), num_warps=4)
    return seen


def walk(nodes: Tensor, choices: Tensor, start: Tensor, out_walk: Tensor, out_moves: Tensor) -> None:
    """``graph_engine.tree_walk_step`` in one launch: ``walk_outputs(nodes, choices)`` into ``out_walk``
    [2n + 1] and the row moves of its path from ``start`` into ``out_moves`` [2, n]."""
    n = nodes.shape[1]
    walk_kernel[(1,)](nodes, choices, start, out_walk, out_moves, N=n, BLOCK=_block(n), num_warps=4)

"""A tree round's small steps as one Triton kernel each, for the graphs engine's Triton layers.

Around the target's tree step a tree round has four steps of its own: the build (``tree.build_tree``: after
a top-k of each drafted slot, every candidate branch scored, the budget's best kept and numbered), the tree's
mask (``tree.ancestors``: each node and its ancestors), the walk (``tree.walk_outputs`` and
``tree.path_moves``: the accepted path and the cache rows that keep it as a chain) and the keep (those rows
moved in every layer's keys and values). In torch they are a few dozen tiny kernels; here the build is torch's
top-k and one launch (the candidates scored in one program, as integers that order as their float keys, and
the budget's best taken by a bitonic top-k), or, in a greedy round, three launches from the drafted logits
(``build_from_logits``: each chunk's top-k, maximum and sum of exponentials, then each slot's merge, then the
build; no softmax); the mask and the walk one launch each (every node's walk up its parents at once, until
none moves: the tree's depth + 1 steps, the parents in registers, ``tl.gather``); the keep one launch, a
program per layer moving only the rows that move. A greedy round's target choices are ``argmax`` (two
launches over many programs, where torch's reduction runs a few), and its tail after the keep (the next
round's context rows and state, the round's outputs) is ``finish``, one launch. Same outputs as the torch
functions (tested against them; on the CPU in Triton's interpreter; a tie between two branches' exact scores
may be broken otherwise than torch's top-k breaks it). Imported only where Triton is
(``kernels.decoder.triton_missing``).

(No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.)
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# their names in Triton's cache folder
KERNELS = (
    "ancestors_kernel", "walk_kernel", "build_kernel", "top_kernel", "keep_kernel", "slot_top_kernel",
    "chunk_max_kernel", "row_argmax_kernel", "finish_kernel",
)  # fmt: skip
# logits a program reads, in ``top_kernel`` and ``chunk_max_kernel``: 24 programs a row for a vocabulary of
# 49,152 (round_glue.py, H100: 1,024 and 2,048 within 0.0011 ms of each other in both, 4,096 slower)
LOGITS_CHUNK = 2048
# the candidate branches ``build_kernel`` scores in its one program, at most: below 15 drafted slots a tree of 32
# nodes has 3,576 (a block of 4,096), one of 64 has 29,934, whose one-program top-k and sort Triton had not
# finished compiling after 200 s (H100, 2026-12-06); larger tables take torch's top-k (``tree.build_tree``)
MAX_BUILD_CANDIDATES = 4096


def builds(candidates: int) -> bool:
    """Whether ``build_kernel`` builds from a candidate table of this many columns (``tree.tree_candidates``')."""
    return _block(candidates) <= MAX_BUILD_CANDIDATES


@triton.jit
def _walk_up(parents, at):
    """One step up the tree for every lane (``at`` the nodes, ``parents`` in registers): the parents, and
    whether any lane moved (the root and padding nodes are their own parents, so a finished walk stays)."""
    up = tl.gather(parents, at, 0)
    return up, tl.max((up != at).to(tl.int32), 0)


@triton.jit
def ancestors_kernel(PARENTS, SEEN, N: tl.constexpr, BLOCK: tl.constexpr):
    """SEEN [N, N] int8: row i marks node i and its ancestors (``tree.ancestors``), by walking every node's
    parents at once until no walk moves (the root and padding nodes are their own parents, so a walk stops
    there): the tree's depth + 1 steps (8 for a block of 8's drafted slots), at most N - 1."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    parents = tl.load(PARENTS + i, mask=ok, other=0).to(tl.int32)
    at = i
    seen = i[:, None] == i[None, :]
    moving = tl.full([], 1, tl.int32)
    step = tl.full([], 0, tl.int32)
    while (moving != 0) & (step < N - 1):
        at, moving = _walk_up(parents, at)
        seen = seen | (i[None, :] == at[:, None])
        step += 1
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
    # accepted: it and every ancestor matched (every node's walk up at once, until none moves, as in
    # ``ancestors_kernel``)
    accepted = matched
    at = i
    moving = tl.full([], 1, tl.int32)
    step = tl.full([], 0, tl.int32)
    while (moving != 0) & (step < N - 1):
        at, moving = _walk_up(parents, at)
        accepted = accepted & tl.gather(matched, at, 0)
        step += 1
    last = tl.argmax(tl.where(accepted != 0, depths, -1), 0)  # the first of the deepest accepted nodes
    # the path: the last node and its ancestors (its walk up in every lane, in registers)
    on_path = i == last
    at = tl.zeros([BLOCK], dtype=tl.int32) + last.to(tl.int32)
    moving = tl.full([], 1, tl.int32)
    step = tl.full([], 0, tl.int32)
    while (moving != 0) & (step < N - 1):
        at, moving = _walk_up(parents, at)
        on_path = on_path | (i == at)
        step += 1
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


@triton.jit
def keep_kernel(
    KEYS,
    VALUES,
    MOVES,
    LAYER_STRIDE,
    N: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The keep step of layer ``program_id(0)``: its cache rows MOVES[0] to MOVES[1] [2, N] (the walk's row
    moves) in KEYS and VALUES (a position's ROW elements contiguous, layers LAYER_STRIDE apart), only the
    rows that move. Every row is read before any is written (a path's row may be read for one move and
    written by another: the path's nodes (0, 2, 3) read row 2 for its second node and write it from row 3)."""
    layer = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    frm = tl.load(MOVES + i, mask=i < N, other=0)
    to = tl.load(MOVES + N + i, mask=i < N, other=0)
    move = (i < N) & (frm != to) & (r < ROW)
    base = layer * LAYER_STRIDE
    keys = tl.load(KEYS + base + frm * ROW + r, mask=move)
    values = tl.load(VALUES + base + frm * ROW + r, mask=move)
    tl.debug_barrier()
    tl.store(KEYS + base + to * ROW + r, keys, mask=move)
    tl.store(VALUES + base + to * ROW + r, values, mask=move)


@triton.jit
def _ordered(x):
    """float32 -> int64 that orders as the floats (-inf below every finite value)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unordered(key):
    """The float32 of ``_ordered``'s int64 ``key`` shifted into its high 32 bits (the inverse)."""
    bits = (key >> 32).to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def top_kernel(
    LOGITS,  # [D, V] float32: the drafted slots' logits
    KEYS,  # [D, CHUNKS, K] int64 out: each chunk's K largest logits with their columns (``_ordered``)
    MAXES,  # [D, CHUNKS] float32 out: each chunk's largest logit
    SUMS,  # [D, CHUNKS] float32 out: each chunk's sum of exp(logit - its largest)
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    K: tl.constexpr,
):
    """The first of the build from logits' launches (``build_from_logits``): program (s, c) reads chunk c of
    slot s's logits once and keeps what the softmax and the top-k need of it: its largest logit, its sum of
    exponentials below it, and its K largest logits, each packed with its column (the earlier column first
    among equal logits) into one int64 that orders as the pair."""
    s = tl.program_id(0)
    c = tl.program_id(1)
    v = c * CHUNK + tl.arange(0, CHUNK)
    ok = v < V
    x = tl.load(LOGITS + s * V + v, mask=ok, other=float("-inf"))
    top = tl.max(x, 0)
    tl.store(MAXES + s * CHUNKS + c, top)
    tl.store(SUMS + s * CHUNKS + c, tl.sum(tl.where(ok, tl.exp(x - top), 0.0), 0))
    lowest = tl.full([CHUNK], -(2**63), dtype=tl.int64)
    packed = tl.where(ok, (_ordered(x) << 32) | (V - 1 - v).to(tl.int64), lowest)
    tl.store(KEYS + (s * CHUNKS + c) * K + tl.arange(0, K), tl.topk(packed, K))


@triton.jit
def build_kernel(
    TOP_P,  # [D, T] float32: each drafted slot's T most likely tokens' probabilities, descending
    TOP_IDS,  # [D, T] int64: their tokens
    CAND,  # [D + 3, C] int64: ``tree.tree_candidates``' table
    ANCHOR,  # [1] int64: the root's token
    NUMBER,  # [C] int64 scratch: each chosen candidate's node number
    NODES,  # [3, N + 1] int64 out: token, depth, parent
    D: tl.constexpr,
    T: tl.constexpr,
    C: tl.constexpr,
    N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``tree.build_tree`` after its top-k: every candidate branch scored (the sum of its ranks' log
    probabilities), the N best kept (ties to the shallower, then to the earlier column), numbered depth by
    depth (best first; padding and branches of probability 0 last), with each node's token and parent."""
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    score = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s in tl.static_range(D):
        r = tl.load(CAND + s * C + c, mask=c_ok, other=T)
        score += tl.log(tl.load(TOP_P + s * T + r, mask=c_ok & (r < T), other=1.0))  # past its depth: 0
    pad = tl.load(CAND + (D + 2) * C + c, mask=c_ok, other=1)
    score = tl.where(pad != 0, float("-inf"), score)
    depth = tl.load(CAND + D * C + c, mask=c_ok, other=0)
    key = score - depth.to(tl.float32) * 1e-4  # ties go to the shallower node
    # the N best: the keys as integers in float order, the column below them (the earlier first), the
    # BLOCK_N largest in descending order (a bitonic top-k: no sort of all BLOCK_C)
    lowest = tl.full([BLOCK_C], -(2**63), dtype=tl.int64)  # below every key (-inf included): past C
    packed = tl.where(c_ok, (_ordered(key) << 32) | (BLOCK_C - 1 - c).to(tl.int64), lowest)
    i = tl.arange(0, BLOCK_N)
    i_ok = i < N
    best = BLOCK_C - 1 - (tl.topk(packed, BLOCK_N) & 0xFFFFFFFF)  # the i-th best column
    valid = tl.zeros([BLOCK_N], dtype=tl.int32) == 0
    for s in tl.static_range(D):
        r = tl.load(CAND + s * C + best, mask=i_ok, other=T)
        p = tl.load(TOP_P + s * T + r, mask=i_ok & (r < T), other=1.0)
        valid = valid & (p > 0.0)
    valid = valid & (tl.load(CAND + (D + 2) * C + best, mask=i_ok, other=1) == 0)
    d = tl.load(CAND + D * C + best, mask=i_ok, other=0)
    # depth by depth (padding last), the best first within a depth
    by_depth = (tl.where(valid, d, D) << 32) | i.to(tl.int64)
    at = (tl.sort(tl.where(i_ok, by_depth, 2**62)) & 0xFFFFFFFF).to(tl.int32)
    chosen = tl.gather(best, at, 0)
    d = tl.gather(d, at, 0)
    valid = tl.gather(valid.to(tl.int32), at, 0) != 0
    tl.store(NUMBER + chosen, i.to(tl.int64) + 1, mask=i_ok)
    tl.debug_barrier()
    rank = tl.load(CAND + d * C + chosen, mask=i_ok, other=0)
    token = tl.load(TOP_IDS + d * T + tl.minimum(rank, T - 1), mask=i_ok, other=0)
    parent_column = tl.load(CAND + (D + 1) * C + chosen, mask=i_ok, other=0)
    parent = tl.where(d == 0, 0, tl.load(NUMBER + parent_column, mask=i_ok & (d > 0), other=0))
    node = i.to(tl.int64) + 1
    tl.store(NODES + node, tl.where(valid, token, 0), mask=i_ok)
    tl.store(NODES + (N + 1) + node, tl.where(valid, d + 1, 0), mask=i_ok)
    tl.store(NODES + 2 * (N + 1) + node, tl.where(valid, parent, node), mask=i_ok)
    tl.store(NODES, tl.load(ANCHOR))
    tl.store(NODES + (N + 1), 0)
    tl.store(NODES + 2 * (N + 1), 0)


@triton.jit
def slot_top_kernel(
    KEYS,  # [D, CHUNKS, K] int64, MAXES and SUMS [D, CHUNKS] float32: ``top_kernel``'s
    MAXES,
    SUMS,
    TOP_P,  # [D, T] float32 out: the slot's T most likely tokens' probabilities, descending
    TOP_IDS,  # [D, T] int64 out: their tokens
    T: tl.constexpr,
    V: tl.constexpr,
    CHUNKS: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    """The second of the build from logits' launches, a program per slot (slot ``program_id(0)``): its T best
    of its chunks' K best (``top_kernel``'s), their probabilities exp(logit - logsumexp), the logsumexp from
    the chunks' maxima and sums."""
    s = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    keys = tl.load(KEYS + s * CHUNKS * K + j, mask=j < CHUNKS * K, other=-(2**63))
    best = tl.topk(keys, K)  # [K], descending
    c = tl.arange(0, BLOCK_CHUNKS)
    maxes = tl.load(MAXES + s * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    top = tl.max(maxes, 0)
    sums = tl.load(SUMS + s * CHUNKS + c, mask=c < CHUNKS, other=0.0)
    lse = top + tl.log(tl.sum(sums * tl.exp(maxes - top), 0))
    t = tl.arange(0, K)
    tl.store(TOP_P + s * T + t, tl.exp(_unordered(best) - lse), mask=t < T)
    tl.store(TOP_IDS + s * T + t, V - 1 - (best & 0xFFFFFFFF), mask=t < T)


@triton.jit
def chunk_max_kernel(LOGITS, KEYS, V: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """The first half of ``argmax``: program (r, c) writes KEYS[r, c], the largest of row r's logits in chunk c
    packed with its column (the earlier column first among equal logits) into one int64 that orders as the
    pair."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    v = c * CHUNK + tl.arange(0, CHUNK)
    ok = v < V
    x = tl.load(LOGITS + r * V + v, mask=ok, other=float("-inf"))
    lowest = tl.full([CHUNK], -(2**63), dtype=tl.int64)
    packed = tl.where(ok, (_ordered(x) << 32) | (V - 1 - v).to(tl.int64), lowest)
    tl.store(KEYS + r * CHUNKS + c, tl.max(packed, 0))


@triton.jit
def row_argmax_kernel(KEYS, OUT, V: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """The second half of ``argmax``: OUT[r] the column of row r's largest chunk key."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    keys = tl.load(KEYS + r * CHUNKS + c, mask=c < CHUNKS, other=-(2**63))
    tl.store(OUT + r, V - 1 - (tl.max(keys, 0) & 0xFFFFFFFF))


@triton.jit
def finish_kernel(
    WALK,  # [2N + 1] int64: the walk's outputs (on the path, tokens, the target's token at its end)
    MOVES,  # [2, N] int64: the walk's row moves (MOVES[0, j] - START: the path's j-th node, j < its length)
    START,  # [1] int64: where the tree step wrote
    NODES,  # [3, N] int64: the tree (row 0: the tokens)
    TREE_ROWS,  # [N, W]: the tree step's context features
    ROWS,  # [B, W] out: the next round's context rows (the path's, then the nodes after it)
    ROUND_OUT,  # [B + 1] int64 out: accepted n, the path's B - 1 tokens after the root, the target's token
    ROW_START,  # [1] int64 out: START
    BLOCK_START,  # [1] int64 in and out: + n + 1
    BLOCK,  # [B] int64 out: BLOCK[0] the next anchor (the target's token)
    N: tl.constexpr,
    B: tl.constexpr,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """A greedy tree round's last step after the walk and the keep: the next round's context rows (program p
    copies columns p * BLOCK_W onwards of the B rows) and, in program 0, the round's outputs and the next
    round's state."""
    p = tl.program_id(0)
    j = tl.arange(0, BLOCK_B)
    j_ok = j < B
    start = tl.load(START)
    nodes = tl.load(MOVES + j, mask=j_ok, other=0) - start
    w = p * BLOCK_W + tl.arange(0, BLOCK_W)
    at = j_ok[:, None] & (w[None, :] < W)
    rows = tl.load(TREE_ROWS + nodes[:, None] * W + w[None, :], mask=at)
    tl.store(ROWS + j[:, None] * W + w[None, :], rows, mask=at)
    if p == 0:
        i = tl.arange(0, BLOCK_N)
        n = tl.sum(tl.load(WALK + i, mask=i < N, other=0), 0) - 1
        bonus = tl.load(WALK + 2 * N)
        tokens = tl.load(NODES + nodes, mask=j_ok & (j > 0), other=0)
        tl.store(ROUND_OUT + j, tokens, mask=j_ok & (j > 0))
        tl.store(ROUND_OUT, n)
        tl.store(ROUND_OUT + B, bonus)
        tl.store(ROW_START, start)
        tl.store(BLOCK_START, tl.load(BLOCK_START) + n + 1)
        tl.store(BLOCK, bonus)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _block(n: int) -> int:
    return max(16, _pow2(n))


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


def keep(keys: Tensor, values: Tensor, moves: Tensor) -> None:
    """``graph_engine``'s keep step in one launch: in every layer's ``keys`` and ``values`` [layer, position,
    kv head, head dim] (one slot's), the rows ``moves[0]`` to ``moves[1]`` ([2, n]: a tree step's rows), as ``rows.index_copy_(1, moves[1], rows.index_select(1, moves[0]))`` does; rows that stay
    are neither read nor written."""
    layers, _, heads, dim = keys.shape
    n = moves.shape[1]
    if values.stride() != keys.stride() or keys.stride()[1:] != (heads * dim, dim, 1):
        raise ValueError(
            f"keep: keys and values of one layout, each position's row contiguous (strides {keys.stride()} "
            f"and {values.stride()})"
        )
    keep_kernel[(layers,)](
        keys, values, moves, keys.stride(0), N=n, ROW=heads * dim, BLOCK_N=_pow2(n), BLOCK_R=_pow2(heads * dim),
        num_warps=4,
    )  # fmt: skip


def build(anchor: Tensor, probs: Tensor, candidates: Tensor, out_nodes: Tensor) -> None:
    """``graph_engine.tree_build_step`` as torch's top-k and one launch: the tree of ``out_nodes``' width less
    the root from the drafted slots' ``probs`` [D, V] below ``anchor`` [1], written into ``out_nodes``
    [3, N+1] (``tree.build_tree``'s nodes)."""
    t = min(out_nodes.shape[1] - 1, probs.shape[-1])
    top_p, top_ids = probs.float().topk(t, dim=-1)
    _build(anchor, top_p, top_ids, candidates, out_nodes)


def build_from_logits(
    anchor: Tensor, logits: Tensor, candidates: Tensor, out_nodes: Tensor, chunk: int = LOGITS_CHUNK
) -> None:
    """``build`` from the drafted slots' float32 ``logits`` [D, V] instead of their probabilities, in three
    launches and no softmax: ``top_kernel`` reads the logits once (each chunk's top-k, maximum and sum of
    exponentials), ``slot_top_kernel`` merges each slot's chunks into its top-k and their probabilities (a
    program a slot), then ``build_kernel`` builds. The tree of ``build(anchor, softmax(logits), ...)`` (the
    probabilities equal to rounding). (The merge inside the build's one program, every slot's at once, took
    0.030 ms with the chunks' launch against 0.018 for these three: H100, round_glue.py.) ``chunk``: the logits
    a program of ``top_kernel`` reads (a power of two)."""
    depth, vocab = logits.shape
    n = out_nodes.shape[1] - 1
    t = min(n, vocab)
    chunk = min(chunk, _block(vocab))
    k = min(_block(t), chunk)
    chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    keys = torch.empty(depth, chunks, k, dtype=torch.long, device=dev)
    maxes = torch.empty(depth, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty(depth, chunks, dtype=torch.float32, device=dev)
    top_kernel[(depth, chunks)](
        logits, keys, maxes, sums, V=vocab, CHUNK=chunk, CHUNKS=chunks, K=k, num_warps=4
    )
    top_p = torch.empty(depth, t, dtype=torch.float32, device=dev)
    top_ids = torch.empty(depth, t, dtype=torch.long, device=dev)
    slot_top_kernel[(depth,)](
        keys, maxes, sums, top_p, top_ids, T=t, V=vocab, CHUNKS=chunks, K=k, BLOCK_K=_block(chunks * k),
        BLOCK_CHUNKS=_block(chunks), num_warps=4,
    )  # fmt: skip
    _build(anchor, top_p, top_ids, candidates, out_nodes)


def argmax(logits: Tensor, out: Tensor, chunk: int = LOGITS_CHUNK) -> None:
    """``out.copy_(logits.argmax(-1))`` for float32 ``logits`` [R, V] (rows contiguous) in two launches: each
    chunk's largest logit with its column (a program per row and chunk), then each row's largest (the earlier
    column first among equal logits, as torch's argmax). torch's reduction runs few programs over a few rows of
    a large vocabulary."""
    rows, vocab = logits.shape
    if logits.stride() != (vocab, 1) or not out.is_contiguous() or out.numel() != rows:
        raise ValueError(
            f"argmax: logits with contiguous rows (strides {logits.stride()}) and a contiguous output of "
            f"{rows} (shape {tuple(out.shape)})"
        )
    chunk = min(chunk, _block(vocab))
    chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty(rows, chunks, dtype=torch.long, device=logits.device)
    chunk_max_kernel[(rows, chunks)](logits, keys, V=vocab, CHUNK=chunk, CHUNKS=chunks, num_warps=4)
    row_argmax_kernel[(rows,)](keys, out, V=vocab, CHUNKS=chunks, BLOCK=_block(chunks), num_warps=1)


def finish(
    walked: Tensor, moves: Tensor, start: Tensor, nodes: Tensor, tree_rows: Tensor, rows: Tensor,
    round_out: Tensor, row_start: Tensor, block_start: Tensor, block: Tensor,
) -> None:  # fmt: skip
    """A tree round's tail after the walk (``walked``, ``moves``) and the keep, in one launch: the next round's
    context ``rows`` [B, W] (the tree step's ``tree_rows`` [N, W] of the path's nodes, then of the nodes after
    it), ``round_out`` [B + 1] (accepted n, the path's B - 1 tokens after the root, the target's token at its
    end), ``row_start`` = ``start``, ``block_start`` += n + 1, ``block[0]`` the target's token: what
    ``graph_engine.finish_step`` writes in a dozen small torch kernels."""
    n, width = tree_rows.shape
    b = rows.shape[0]
    if b > n or rows.shape[1] != width or round_out.shape[0] != b + 1:
        raise ValueError(
            f"finish: rows {tuple(rows.shape)} and round_out {tuple(round_out.shape)} for a tree of {n}"
        )
    block_w = 1024
    finish_kernel[(triton.cdiv(width, block_w),)](
        walked, moves, start, nodes, tree_rows, rows, round_out, row_start, block_start, block,
        N=n, B=b, W=width, BLOCK_N=_block(n), BLOCK_B=_block(b), BLOCK_W=block_w, num_warps=4,
    )  # fmt: skip


def _build(anchor: Tensor, top_p: Tensor, top_ids: Tensor, candidates: Tensor, out_nodes: Tensor) -> None:
    """``build_kernel``'s launch: its scratch, its sizes."""
    depth, t = top_p.shape
    n, c = out_nodes.shape[1] - 1, candidates.shape[1]
    if not builds(c):
        raise ValueError(
            f"build: {c} candidate branches are more than one program scores ({MAX_BUILD_CANDIDATES}): "
            "build this tree with tree.build_tree"
        )
    block_c = _block(c)
    number = torch.empty(c, dtype=torch.long, device=top_p.device)
    build_kernel[(1,)](
        top_p, top_ids, candidates, anchor, number, out_nodes,
        D=depth, T=t, C=c, N=n, BLOCK_C=block_c, BLOCK_N=_block(n), num_warps=4 if block_c <= 2048 else 8,
    )  # fmt: skip

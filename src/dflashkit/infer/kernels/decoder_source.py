"""The Triton source of the target's decoder layer in six kernels (``dflashkit.infer.kernels.decoder`` launches
them; read that module first). Imported once Triton is known to be there: ``triton.jit`` compiles them for a
GPU, or gives the interpreter's functions (TRITON_INTERPRET=1: the CPU tests), so both run this very source.

Shapes: a step of M new tokens (M <= BLOCK_M, a power of 2), hidden H, query heads NQ, key/value heads NK,
head dim D, MLP width I. A step's matmuls have a few rows and read far more weight than they compute, so each
runs over many programs of a few output columns, the inner dimension in unrolled steps of BLOCK_K: for one
token (DOT False) as a matrix-vector product (products broadcast over [rows, columns, inner] and summed in
float32), for a block (DOT True) through ``tl.dot`` (tensor cores; rows padded to 16, at least 16 columns).
The attention's score and value products go through ``tl.dot`` too. Each result is rounded to the model's
dtype where the plain forward (``slot_decoder.decoder_layer``) rounds it.

(No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.)
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST: the operands in float32 first (Triton's interpreter multiplies
    bf16 operands wrongly; bf16 products are exact in float32, so the result is the same up to summation
    order; PRECISION is then "ieee" for any dtype)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def norm_scale(X, eps, rm, row_ok, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row of x [M, H] (every program recomputes it: H values a row)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * H + rk[None, :], mask=row_ok[:, None] & (rk < H)[None, :], other=0.0)
        x = x.to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return tl.rsqrt(squares / H + eps)


@triton.jit
def normed(X, NORM, scale, rm, row_ok, rk, k_ok, H: tl.constexpr, DTYPE: tl.constexpr):
    """rms_norm(x)[:, rk] in the model's dtype (as the plain forward rounds it), as float32 [M, BLOCK_K]."""
    x = tl.load(X + rm[:, None] * H + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    g = tl.load(NORM + rk, mask=k_ok, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * scale[:, None] * g[None, :]).to(DTYPE).to(tl.float32)


@triton.jit
def wait_for_inputs(GDC: tl.constexpr):
    """Programmatic dependent launch (GDC): wait until the kernel before this one has finished and its writes
    are seen, then let the next kernel launch (it waits here in turn). Before this, a kernel reads only its
    first weight tile (with GDC; without, it loads it in its loop, as before), which no kernel writes; every
    read of an activation or a cache and every write comes after."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def weight_tile(W, rows, rows_ok, rk, k_ok, K: tl.constexpr):
    """The weight rows ``rows`` [BLOCK_N] of W [*, K] at the columns rk: [BLOCK_N, BLOCK_K]."""
    return tl.load(W + rows[:, None] * K + rk[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def row_tile(ROW_TILES: tl.constexpr, BLOCK_M: tl.constexpr):
    """A matmul program's column tile and its rows [BLOCK_M]. ROW_TILES > 1 (a tree's rows in tiles of
    BLOCK_M): program axis 0 holds (column tile, row tile) with the row tiles of a column tile side by side,
    so that the programs reading one weight tile run together (the second read from the L2 cache); each
    program is then a block's, and a tile of more rows would hold more registers than fit two programs to a
    multiprocessor (255 a thread at 32 rows, sm_90)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    if ROW_TILES > 1:
        rm += (pid % ROW_TILES) * BLOCK_M
        pid = pid // ROW_TILES
    return pid, rm


@triton.jit
def rows_times(a, w, DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] (float32 holding model-dtype values) times a weight tile w [BLOCK_N, BLOCK_K]:
    [BLOCK_M, BLOCK_N] float32, summed over this step of the inner dimension."""
    if DOT:
        out = dot(a.to(w.dtype), tl.trans(w), PRECISION, UPCAST)
    else:
        out = tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return out


@triton.jit
def share_written(PARTS, acc, at, ok):
    """Split-K: this program's sum over its share of the inner dimension, written to PARTS [.., M, N] at ``at``
    (float32, not rounded)."""
    tl.store(PARTS + at, acc, mask=ok)


@triton.jit
def arrived_last(ARRIVED, tile, SPLIT_K: tl.constexpr):
    """Count this program's part of its tile as done (after every thread's share of its writes: the barrier,
    then a release): split-K's share of a column tile, or the attention's split of a (head, row tile);
    whether it is the last of the tile's SPLIT_K parts, which then reads them all (acquire) and finishes the
    tile."""
    tl.debug_barrier()
    return tl.atomic_add(ARRIVED + tile, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def shares_summed(PARTS, at, ok, SIZE, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K, in the last share's program: the shares' sums added in order (the same sum whichever share
    arrived last), read past the multiprocessor's own cache (.cg); SIZE: one share's elements in PARTS."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(0, SPLIT_K):
        acc += tl.load(PARTS + s * SIZE + at, mask=ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def split_k_summed(
    acc,
    PARTS,
    ARRIVED,
    tile,
    at,
    ok,
    SIZE,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split-K for one accumulator: this program's share written, counted, and (the last share of its column
    tile) the shares' sum with its count reset: (the sum, or this share's own; whether it is the last)."""
    share_written(PARTS + tl.program_id(1) * SIZE, acc, at, ok)
    last = arrived_last(ARRIVED, tile, SPLIT_K)
    if last:
        acc = shares_summed(PARTS, at, ok, SIZE, SPLIT_K, BLOCK_M, BLOCK_N)
        tl.store(ARRIVED + tile, 0)
    return acc, last


@triton.jit
def qkv_kernel(
    X,  # [M, H] the residual stream
    NORM,  # [H] the layer's input norm
    W,  # [NQ*D + 2*NK*D, H] the fused projection, q and k rows in side-by-side rotary order
    BIAS,  # [NQ*D + 2*NK*D] or a dummy (HAS_BIAS False)
    QN,  # [D] the per-head query norm (Qwen3, in the rows' rotary order), or a dummy (HEAD_NORM False)
    KN,  # [D] the per-head key norm, or a dummy
    ROT,  # [max positions, D/2, 2] float32 (cos, sin)
    START,  # [1] int64: the first new token's position
    POS,  # [M] int64: a tree's rotary positions (the root's + each node's depth), or a dummy (TREE False)
    Q,  # [M, NQ*D] out: the turned queries
    KC,  # [capacity, NK, D] the layer's key cache (the engine's slot), written at START + m
    VC,  # the same for values
    PARTS,  # [LAYERS, SPLIT_K, M, N] float32: each share's sum (SPLIT_K > 1), or a dummy
    ARRIVED,  # [>= LAYERS x the column tiles] int32, zero: the shares done per column tile (SPLIT_K > 1), or a dummy
    eps,
    capacity,
    cache_layers,  # LAYERS > 1: elements between one layer's cache and the next's (KC's and VC's)
    M,  # rows: a runtime value (a drafter's prompt context comes in any count; BLOCK_M is the compile's)
    LAYERS: tl.constexpr,  # > 1: W, BIAS and KN stacked by layer, program axis 2 the layer (a drafter's context)
    H: tl.constexpr,
    NQD: tl.constexpr,
    NKD: tl.constexpr,
    D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HEAD_NORM: tl.constexpr,  # each query and key head normalised before the rotation (BLOCK_N == D)
    TREE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SHARE: tl.constexpr,  # the inner dimension's share a program sums: H, or cdiv(H, SPLIT_K), in steps of BLOCK_K
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_TILES: tl.constexpr,  # the rows' tiles of BLOCK_M (1: all rows in one)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per program, even: BLOCK_N / 2 rotary pairs
    BLOCK_K: tl.constexpr,
    GDC: tl.constexpr,
):
    """rms_norm(x) @ W.T (+ bias), each (even, odd) column pair of the queries and keys turned by its rotary
    angle, the keys and values written into the cache: one program per BLOCK_N columns (NQD 0: W holds the
    keys' and values' rows alone, a drafter's context). Token m is written at position START + m and turned by
    that position's angle, or (TREE) by the angle of POS[m].
    SPLIT_K > 1 (a block's few column tiles): program (n, s) sums the s-th share of the inner dimension, and
    the share that arrives last for its tile adds them up and does the rest (``arrived_last``). LAYERS > 1:
    program (n, s, l) does layer l's (the keys and values of every layer over the same rows, in one launch).
    ROW_TILES > 1: the rows in tiles of BLOCK_M, each a program of its own (``row_tile``)."""
    tile = tl.program_id(0)  # the split-K counters' index: one per (column tile, row tile)
    pid, rm = row_tile(ROW_TILES, BLOCK_M)
    dt = W.dtype.element_ty
    N: tl.constexpr = NQD + 2 * NKD
    if LAYERS > 1:
        layer = tl.program_id(2).to(tl.int64)
        W += layer * N * H
        if HAS_BIAS:
            BIAS += layer * N
        if HEAD_NORM:
            KN += layer * D
        KC += layer * cache_layers
        VC += layer * cache_layers
        PARTS += layer * SPLIT_K * M * N
        ARRIVED += layer * tl.num_programs(0)
    row_ok = rm < M
    n0 = pid * BLOCK_N  # this program's first column
    rn = n0 + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    k_lo = tl.program_id(1) * SHARE
    if GDC:  # the first weight tile while the kernel before runs (no kernel writes weights)
        rk0 = k_lo + tl.arange(0, BLOCK_K)
        first = weight_tile(W, rn, n_ok, rk0, rk0 < H, H)
    wait_for_inputs(GDC)
    scale = norm_scale(X, eps, rm, row_ok, H, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, SHARE, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        h = normed(X, NORM, scale, rm, row_ok, rk, k_ok, H, dt)
        if GDC and k0 == 0:
            w = first
        else:
            w = weight_tile(W, rn, n_ok, rk, k_ok, H)
        acc += rows_times(h, w, DOT, PRECISION, UPCAST)
    last = True
    if SPLIT_K > 1:
        at = rm[:, None] * N + rn[None, :]
        ok = row_ok[:, None] & n_ok[None, :]
        acc, last = split_k_summed(acc, PARTS, ARRIVED, tile, at, ok, M * N, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
        turned_and_written(
            acc, BIAS, QN, KN, ROT, START, POS, Q, KC, VC, eps, capacity, rm, row_ok, n0, rn, n_ok, dt,
            N, NQD, NKD, D, HAS_BIAS, HEAD_NORM, TREE, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def turned_and_written(
    acc, BIAS, QN, KN, ROT, START, POS, Q, KC, VC, eps, capacity, rm, row_ok, n0, rn, n_ok, dt: tl.constexpr,
    N: tl.constexpr, NQD: tl.constexpr, NKD: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_NORM: tl.constexpr, TREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The qkv kernel's end for its column tile: the projection's sum acc [BLOCK_M, BLOCK_N] (+ bias) rounded,
    each query and key head normalised (HEAD_NORM), the pairs turned, queries into Q, keys and values into
    the cache."""
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # the projection's output in the model's dtype, as the plain forward rounds it before the rotation
    acc = acc.to(dt).to(tl.float32)
    if HEAD_NORM:  # this program's columns are one head: a query's or a key's normalised by its own norm
        j_head = rn % D
        is_q = n0 < NQD
        g = tl.where(is_q, tl.load(QN + j_head), tl.load(KN + j_head)).to(tl.float32)
        head_scale = tl.rsqrt(tl.sum(acc * acc, axis=1) / D + eps)
        normed_head = (acc * head_scale[:, None] * g[None, :]).to(dt).to(tl.float32)
        acc = tl.where(n0 < NQD + NKD, normed_head, acc)  # values are not normalised
    even, odd = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    rp = n0 // 2 + tl.arange(0, BLOCK_N // 2)  # the pairs' index: columns 2 rp and 2 rp + 1
    col = 2 * rp
    start = tl.load(START)
    written = tl.minimum(start + rm, capacity - 1)  # [BLOCK_M]: each token's cache row
    if TREE:
        pos = tl.load(POS + rm, mask=row_ok, other=0)
    else:
        pos = written
    j = (col % D) // 2  # the pair's index within its head
    rot_ok = (
        row_ok[:, None] & ((col < NQD + NKD) & (col < N))[None, :]
    )  # queries and keys turn; values do not
    cos = tl.load(ROT + pos[:, None] * D + 2 * j[None, :], mask=rot_ok, other=1.0)
    sin = tl.load(ROT + pos[:, None] * D + 2 * j[None, :] + 1, mask=rot_ok, other=0.0)
    turned = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [BLOCK_M, BLOCK_N])
    turned = turned.to(Q.dtype.element_ty)
    ok = row_ok[:, None] & n_ok[None, :]
    tl.store(Q + rm[:, None] * NQD + rn[None, :], turned, mask=ok & (rn < NQD)[None, :])
    at = written[:, None] * NKD
    tl.store(KC + at + (rn - NQD)[None, :], turned, mask=ok & ((rn >= NQD) & (rn < NQD + NKD))[None, :])
    tl.store(VC + at + (rn - NQD - NKD)[None, :], turned, mask=ok & (rn >= NQD + NKD)[None, :])


@triton.jit
def attention_kernel(
    Q,  # [M, NQ*D]
    KC,  # [capacity, NK, D]
    VC,
    START,  # [1] int64
    SEEN,  # [M, M] int8: a tree's mask among its nodes (row m: m and its ancestors), or a dummy (TREE False)
    PO,  # [SPLITS, M*NQ, D] float32 out: each split's unnormalised output
    PM,  # [SPLITS, M*NQ] float32 out: each split's score maximum
    PL,  # [SPLITS, M*NQ] float32 out: each split's sum of exp(score - maximum)
    OUT,  # [M, NQ*D] out (MERGE): the attention's output in the model's dtype, or a dummy
    ARRIVED,  # [>= NK * row tiles] int32, zero: the splits done per (head, row tile) (MERGE), or a dummy
    sm_scale,
    capacity,
    M: tl.constexpr,
    NQ: tl.constexpr,
    NK: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    STEPS: tl.constexpr,  # cdiv(capacity, SPLITS * BLOCK_N): the most steps of BLOCK_N positions a split takes
    TREE: tl.constexpr,
    MERGE: tl.constexpr,  # the split that arrives last merges its rows (``merge_kernel``'s work, no launch)
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GDC: tl.constexpr,
):
    """Attention of the M new tokens over the cache, split along the positions (as flash-decoding does):
    program (g, s, t) reads key/value head g over its share s of the used positions, for BLOCK_R rows of
    every query head of g's group and every new token (rows r = m * G + head within the group; t: the rows'
    tile, one unless a tree makes them many), and writes its partial output, maximum and sum;
    ``merge_kernel`` merges the splits. Token m reads the positions before START and, among the new ones,
    those up to its own (causal), or (TREE) those SEEN[m] marks: its own and its ancestors'."""
    g = tl.program_id(0)
    s = tl.program_id(1)
    G: tl.constexpr = NQ // NK
    wait_for_inputs(GDC)
    start = tl.load(START)
    used = tl.minimum(start + M, capacity)  # positions 0 .. used - 1 hold keys
    share = tl.cdiv(tl.cdiv(used, SPLITS), BLOCK_N) * BLOCK_N
    lo = s * share
    hi = tl.minimum(lo + share, used)
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = rr // G
    head = g * G + rr % G
    row_ok = rr < M * G
    rd = tl.arange(0, D)
    q = tl.load(Q + m[:, None] * (NQ * D) + head[:, None] * D + rd[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = start + m  # each new token sees the positions up to its own
    top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    # a fixed number of steps (a loop bound read from the device cannot be a Python range in the
    # interpreter), the ones past this split's share skipped
    for step in range(0, STEPS):
        n0 = lo + step * BLOCK_N
        if n0 < hi:
            rn = n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < hi
            at = rn[:, None] * (NK * D) + g * D + rd[None, :]
            k = tl.load(KC + at, mask=n_ok[:, None], other=0.0)
            scores = dot(q, tl.trans(k), PRECISION, UPCAST) * sm_scale
            if TREE:
                new = rn - start  # the node written at that position, where it is one
                is_new = (new >= 0) & (new < M)
                marked = tl.load(
                    SEEN + m[:, None] * M + new[None, :],
                    mask=row_ok[:, None] & (is_new & n_ok)[None, :],
                    other=0,
                )
                seen = n_ok[None, :] & ((new < 0)[None, :] | (marked != 0))
            else:
                seen = n_ok[None, :] & (rn[None, :] <= q_pos[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that has seen nothing yet
            alpha = tl.exp(top - safe)
            p = tl.exp(scores - safe[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(VC + at, mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
            top = new_top
    row = m * NQ + head
    tl.store(PO + (s * (M * NQ) + row)[:, None] * D + rd[None, :], acc, mask=row_ok[:, None])
    tl.store(PM + s * (M * NQ) + row, top, mask=row_ok)
    tl.store(PL + s * (M * NQ) + row, total, mask=row_ok)
    if MERGE:
        tile = g * tl.num_programs(2) + tl.program_id(2)
        if arrived_last(ARRIVED, tile, SPLITS):
            merged_rows(PO, PM, PL, OUT, row, row_ok, rd, M, NQ, D, SPLITS)
            tl.store(ARRIVED + tile, 0)


@triton.jit
def merged_rows(PO, PM, PL, OUT, row, row_ok, rd, M: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr,
                SPLITS: tl.constexpr):  # fmt: skip
    """The rows ``row`` (m * NQ + head) of the attention's splits merged by their maxima and sums, as
    ``merge_kernel`` merges one, read past the multiprocessor's own cache (.cg: other programs wrote them)."""
    top = tl.full(row.shape, float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(PM + s * (M * NQ) + row, mask=row_ok, other=0.0, cache_modifier=".cg"))
    total = tl.zeros(row.shape, dtype=tl.float32)
    out = tl.zeros([row.shape[0], D], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        at = s * (M * NQ) + row
        weight = tl.exp(tl.load(PM + at, mask=row_ok, other=0.0, cache_modifier=".cg") - top)
        total += weight * tl.load(PL + at, mask=row_ok, other=0.0, cache_modifier=".cg")
        part = tl.load(
            PO + at[:, None] * D + rd[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
        )
        out += part * weight[:, None]
    out = out / tl.where(row_ok, total, 1.0)[:, None]
    tl.store(OUT + row[:, None] * D + rd[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def merge_kernel(
    PO,  # [SPLITS, M*NQ, D] float32
    PM,  # [SPLITS, M*NQ]
    PL,
    OUT,  # [M, NQ*D] out: the attention's output in the model's dtype
    M: tl.constexpr,
    NQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    GDC: tl.constexpr,
):
    """The attention's splits merged by their maxima and sums: one program per (new token, query head)."""
    r = tl.program_id(0)  # m * NQ + head: its row of OUT is r * D
    rs = tl.arange(0, SPLITS)
    rd = tl.arange(0, D)
    wait_for_inputs(GDC)
    tops = tl.load(PM + rs * (M * NQ) + r)
    top = tl.max(tops, axis=0)  # split 0 always holds position 0, which every token sees: finite
    weight = tl.exp(tops - top)
    total = tl.sum(weight * tl.load(PL + rs * (M * NQ) + r), axis=0)
    parts = tl.load(PO + (rs[:, None] * (M * NQ) + r) * D + rd[None, :])
    tl.store(OUT + r * D + rd, (tl.sum(parts * weight[:, None], axis=0) / total).to(OUT.dtype.element_ty))


@triton.jit
def up_kernel(
    X,  # [M, H]
    NORM,  # [H] the post-attention norm
    W,  # [2*I, H] gate rows then up rows
    A,  # [M, I] out: silu(gate) * up
    PARTS,  # [SPLIT_K, 2, M, I] float32: each share's gate and up sums (SPLIT_K > 1), or a dummy
    ARRIVED,  # [>= the column tiles] int32, zero: the shares done per column tile (SPLIT_K > 1), or a dummy
    eps,
    M: tl.constexpr,
    H: tl.constexpr,
    I: tl.constexpr,  # noqa: E741 (the MLP's width, as the method names it)
    SPLIT_K: tl.constexpr,
    SHARE: tl.constexpr,  # the inner dimension's share a program sums (split-K, as the qkv kernel's)
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GDC: tl.constexpr,
):
    """rms_norm(x), its gate and up projections for BLOCK_N columns, and SwiGLU's product. SPLIT_K > 1:
    program (n, s) sums the s-th share of the inner dimension; the last share of a tile adds them up and
    does the product. ROW_TILES > 1: the rows in tiles of BLOCK_M, each a program of its own (``row_tile``)."""
    tile = tl.program_id(0)
    pid, rm = row_tile(ROW_TILES, BLOCK_M)
    dt = W.dtype.element_ty
    row_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    k_lo = tl.program_id(1) * SHARE
    if GDC:  # the first weight tiles while the kernel before runs
        rk0 = k_lo + tl.arange(0, BLOCK_K)
        first_gate = weight_tile(W, rn, n_ok, rk0, rk0 < H, H)
        first_up = weight_tile(W, I + rn, n_ok, rk0, rk0 < H, H)
    wait_for_inputs(GDC)
    scale = norm_scale(X, eps, rm, row_ok, H, BLOCK_M, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, SHARE, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        h = normed(X, NORM, scale, rm, row_ok, rk, k_ok, H, dt)
        if GDC and k0 == 0:
            w_gate, w_up = first_gate, first_up
        else:
            w_gate, w_up = weight_tile(W, rn, n_ok, rk, k_ok, H), weight_tile(W, I + rn, n_ok, rk, k_ok, H)
        gate += rows_times(h, w_gate, DOT, PRECISION, UPCAST)
        up += rows_times(h, w_up, DOT, PRECISION, UPCAST)
    ok = row_ok[:, None] & n_ok[None, :]
    at = rm[:, None] * I + rn[None, :]
    last = True
    if SPLIT_K > 1:
        share = PARTS + tl.program_id(1) * (2 * M * I)
        share_written(share, gate, at, ok)
        share_written(share + M * I, up, at, ok)
        last = arrived_last(ARRIVED, tile, SPLIT_K)
        if last:
            gate = shares_summed(PARTS, at, ok, 2 * M * I, SPLIT_K, BLOCK_M, BLOCK_N)
            up = shares_summed(PARTS + M * I, at, ok, 2 * M * I, SPLIT_K, BLOCK_M, BLOCK_N)
            tl.store(ARRIVED + tile, 0)
    if last:
        gate = gate.to(dt).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        product = silu * up.to(dt).to(tl.float32)
        tl.store(A + at, product.to(A.dtype.element_ty), mask=ok)


@triton.jit
def residual_kernel(
    A,  # [M, K]: the attention's output (K = NQ*D) or SwiGLU's product (K = I)
    W,  # [H, K]: the output or the down projection
    X,  # [M, H] updated in place: x + a @ W.T
    PARTS,  # [SPLIT_K, M, H] float32: each share's sum (SPLIT_K > 1), or a dummy
    ARRIVED,  # [cdiv(H, BLOCK_N)] int32, zero: the shares done per column tile (SPLIT_K > 1), or a dummy
    M: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SHARE: tl.constexpr,  # the inner dimension's share a program sums: cdiv(K, SPLIT_K) in steps of BLOCK_K
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GDC: tl.constexpr,
):
    """A projection back to the residual stream and its add, for BLOCK_N columns of x (the matmul's output
    rounded to the model's dtype first, as the plain forward adds it). SPLIT_K > 1: program (n, s) sums the
    s-th share of the inner dimension (split-K: more programs for a matmul of few columns) and writes it to
    PARTS; the share that arrives last adds them up in order (the same sum whichever arrives last), does the
    residual add and sets its tile's count back to zero for the next launch. ROW_TILES > 1: the rows in
    tiles of BLOCK_M, each a program of its own (``row_tile``)."""
    tile = tl.program_id(0)
    pid, rm = row_tile(ROW_TILES, BLOCK_M)
    row_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    ok = row_ok[:, None] & n_ok[None, :]
    k_lo = tl.program_id(1) * SHARE
    if GDC:  # the first weight tile while the kernel before runs
        rk0 = k_lo + tl.arange(0, BLOCK_K)
        first = weight_tile(W, rn, n_ok, rk0, rk0 < K, K)
    wait_for_inputs(GDC)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, SHARE, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(A + rm[:, None] * K + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if GDC and k0 == 0:
            w = first
        else:
            w = weight_tile(W, rn, n_ok, rk, k_ok, K)
        acc += rows_times(a.to(tl.float32), w, DOT, PRECISION, UPCAST)
    last = True
    if SPLIT_K > 1:
        at = rm[:, None] * H + rn[None, :]
        acc, last = split_k_summed(acc, PARTS, ARRIVED, tile, at, ok, M * H, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
        x_at = X + rm[:, None] * H + rn[None, :]
        x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_at, (x + acc.to(W.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty), mask=ok)

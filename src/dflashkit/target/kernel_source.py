"""The Triton source of the target's decoder layer in five kernels (``dflashkit.target.kernels`` launches
them; read that module first). Imported once Triton is known to be there: ``triton.jit`` compiles them for a
GPU, or gives the interpreter's functions (TRITON_INTERPRET=1: the CPU tests), so both run this very source.

Shapes: a step of M new tokens (M <= BLOCK_M, a power of 2), hidden H, query heads NQ, key/value heads NK,
head dim D, MLP width I. A step's matmuls have a few rows and read far more weight than they compute, so each
is written as a matrix-vector product over many programs (each a few output columns, the whole inner
dimension in unrolled steps of BLOCK_K: products broadcast over [rows, columns, inner] and summed in float32),
which spreads the weight's bytes over the GPU's multiprocessors; the attention's score and value products go
through ``tl.dot`` (its rows padded to 16). Each result is rounded to the model's dtype where the plain
forward (``slot_decoder.decoder_layer``) rounds it.

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
def rows_times(a, W, rows, rows_ok, rk, k_ok, K: tl.constexpr):
    """a [M, BLOCK_K] (float32) times the weight rows ``rows`` [BLOCK_N] of W [*, K] at the columns rk:
    [M, BLOCK_N] float32, summed over this step of the inner dimension."""
    w = tl.load(W + rows[:, None] * K + rk[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
    return tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def qkv_kernel(
    X,  # [M, H] the residual stream
    NORM,  # [H] the layer's input norm
    W,  # [NQ*D + 2*NK*D, H] the fused projection, q and k rows in side-by-side rotary order
    BIAS,  # [NQ*D + 2*NK*D] or a dummy (HAS_BIAS False)
    ROT,  # [max positions, D/2, 2] float32 (cos, sin)
    START,  # [1] int64: the first new token's position
    Q,  # [M, NQ*D] out: the turned queries
    KC,  # [capacity, NK, D] the layer's key cache (the engine's slot), written at START + m
    VC,  # the same for values
    eps,
    capacity,
    M: tl.constexpr,
    H: tl.constexpr,
    NQD: tl.constexpr,
    NKD: tl.constexpr,
    D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """rms_norm(x) @ W.T (+ bias), each (even, odd) column pair of the queries and keys turned by its rotary
    angle, the keys and values written into the cache: one program per PAIRS column pairs."""
    pid = tl.program_id(0)
    dt = W.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    scale = norm_scale(X, eps, rm, row_ok, H, BLOCK_M, BLOCK_K)
    rp = pid * PAIRS + tl.arange(0, PAIRS)  # column pair: columns 2 rp (even) and 2 rp + 1 (odd)
    pair_ok = rp < (NQD + 2 * NKD) // 2
    even = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
    odd = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        h = normed(X, NORM, scale, rm, row_ok, rk, k_ok, H, dt)
        even += rows_times(h, W, 2 * rp, pair_ok, rk, k_ok, H)
        odd += rows_times(h, W, 2 * rp + 1, pair_ok, rk, k_ok, H)
    if HAS_BIAS:
        even += tl.load(BIAS + 2 * rp, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        odd += tl.load(BIAS + 2 * rp + 1, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    # the projection's output in the model's dtype, as the plain forward rounds it before the rotation
    even = even.to(dt).to(tl.float32)
    odd = odd.to(dt).to(tl.float32)
    col = 2 * rp
    start = tl.load(START)
    pos = tl.minimum(start + rm, capacity - 1)  # [BLOCK_M]
    turned = col < NQD + NKD  # queries and keys turn; values do not
    j = (col % D) // 2  # the pair's index within its head
    rot_ok = row_ok[:, None] & (turned & pair_ok)[None, :]
    cos = tl.load(ROT + pos[:, None] * D + 2 * j[None, :], mask=rot_ok, other=1.0)
    sin = tl.load(ROT + pos[:, None] * D + 2 * j[None, :] + 1, mask=rot_ok, other=0.0)
    out_even = (even * cos - odd * sin).to(Q.dtype.element_ty)
    out_odd = (even * sin + odd * cos).to(Q.dtype.element_ty)
    ok = row_ok[:, None] & pair_ok[None, :]
    is_q = (col < NQD)[None, :]
    q_at = Q + rm[:, None] * NQD + col[None, :]
    tl.store(q_at, out_even, mask=ok & is_q)
    tl.store(q_at + 1, out_odd, mask=ok & is_q)
    is_k = ((col >= NQD) & (col < NQD + NKD))[None, :]
    k_at = KC + pos[:, None] * NKD + (col - NQD)[None, :]
    tl.store(k_at, out_even, mask=ok & is_k)
    tl.store(k_at + 1, out_odd, mask=ok & is_k)
    is_v = (col >= NQD + NKD)[None, :]
    v_at = VC + pos[:, None] * NKD + (col - NQD - NKD)[None, :]
    tl.store(v_at, out_even, mask=ok & is_v)
    tl.store(v_at + 1, out_odd, mask=ok & is_v)


@triton.jit
def attention_kernel(
    Q,  # [M, NQ*D]
    KC,  # [capacity, NK, D]
    VC,
    START,  # [1] int64
    PO,  # [SPLITS, M*NQ, D] float32 out: each split's unnormalised output
    PM,  # [SPLITS, M*NQ] float32 out: each split's score maximum
    PL,  # [SPLITS, M*NQ] float32 out: each split's sum of exp(score - maximum)
    sm_scale,
    capacity,
    M: tl.constexpr,
    NQ: tl.constexpr,
    NK: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    STEPS: tl.constexpr,  # cdiv(capacity, SPLITS * BLOCK_N): the most steps of BLOCK_N positions a split takes
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Causal attention of the M new tokens over the cache, split along the positions (as flash-decoding
    does): program (g, s) reads key/value head g over its share s of the used positions, for every query
    head of g's group and every new token at once (rows r = m * G + head within the group), and writes its
    partial output, maximum and sum; ``out_kernel`` merges the splits."""
    g = tl.program_id(0)
    s = tl.program_id(1)
    G: tl.constexpr = NQ // NK
    start = tl.load(START)
    used = tl.minimum(start + M, capacity)  # positions 0 .. used - 1 hold keys
    share = tl.cdiv(tl.cdiv(used, SPLITS), BLOCK_N) * BLOCK_N
    lo = s * share
    hi = tl.minimum(lo + share, used)
    rr = tl.arange(0, BLOCK_R)
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


@triton.jit
def add_residual(X, acc, rm, row_ok, rn, n_ok, H: tl.constexpr, DTYPE: tl.constexpr):
    """x[:, rn] += acc, the matmul's output rounded to the model's dtype first (as the plain forward adds it)."""
    ok = row_ok[:, None] & n_ok[None, :]
    x_at = X + rm[:, None] * H + rn[None, :]
    x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_at, (x + acc.to(DTYPE).to(tl.float32)).to(X.dtype.element_ty), mask=ok)


@triton.jit
def out_kernel(
    PO,  # [SPLITS, M*NQ, D] float32
    PM,  # [SPLITS, M*NQ]
    PL,
    W,  # [H, NQ*D] the output projection
    X,  # [M, H] the residual stream, updated in place: x + attention @ W.T
    M: tl.constexpr,
    H: tl.constexpr,
    NQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The attention's splits merged (a head at a time, as the matmul reads it), the output projection and
    the residual add: one program per BLOCK_N columns of x."""
    pid = tl.program_id(0)
    dt = W.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rs = tl.arange(0, SPLITS)
    rd = tl.arange(0, D)
    d_ok = rd < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for head in tl.static_range(0, NQ):  # unrolled: every head's loads issued at once
        row = rm * NQ + head  # [BLOCK_M]
        at = rs[:, None] * (M * NQ) + row[None, :]  # [SPLITS, BLOCK_M]
        tops = tl.load(PM + at, mask=row_ok[None, :], other=float("-inf"))
        top = tl.max(tops, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # padding rows
        weight = tl.exp(tops - top[None, :])
        total = tl.sum(weight * tl.load(PL + at, mask=row_ok[None, :], other=0.0), axis=0)
        total = tl.where(total > 0.0, total, 1.0)
        parts = tl.load(PO + at[:, :, None] * D + rd[None, None, :], mask=row_ok[None, :, None], other=0.0)
        o = tl.sum(parts * weight[:, :, None], axis=0) / total[:, None]  # [BLOCK_M, D]
        o = o.to(dt).to(tl.float32)  # the attention's output in the model's dtype
        acc += rows_times(o, W + head * D, rn, n_ok, rd, d_ok, NQ * D)
    add_residual(X, acc, rm, row_ok, rn, n_ok, H, dt)


@triton.jit
def up_kernel(
    X,  # [M, H]
    NORM,  # [H] the post-attention norm
    W,  # [2*I, H] gate rows then up rows
    A,  # [M, I] out: silu(gate) * up
    eps,
    M: tl.constexpr,
    H: tl.constexpr,
    I: tl.constexpr,  # noqa: E741 (the MLP's width, as the method names it)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """rms_norm(x), its gate and up projections for BLOCK_N columns, and SwiGLU's product."""
    pid = tl.program_id(0)
    dt = W.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    scale = norm_scale(X, eps, rm, row_ok, H, BLOCK_M, BLOCK_K)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        h = normed(X, NORM, scale, rm, row_ok, rk, k_ok, H, dt)
        gate += rows_times(h, W, rn, n_ok, rk, k_ok, H)
        up += rows_times(h, W, I + rn, n_ok, rk, k_ok, H)
    gate = gate.to(dt).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
    product = silu * up.to(dt).to(tl.float32)
    tl.store(
        A + rm[:, None] * I + rn[None, :],
        product.to(A.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def down_kernel(
    A,  # [M, K]
    W,  # [H, K]
    X,  # [M, H] updated in place: x + a @ W.T
    M: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The MLP's down projection and the residual add, for BLOCK_N columns of x."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(A + rm[:, None] * K + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += rows_times(a.to(tl.float32), W, rn, n_ok, rk, k_ok, K)
    add_residual(X, acc, rm, row_ok, rn, n_ok, H, W.dtype.element_ty)

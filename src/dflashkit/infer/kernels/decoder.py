"""The target's chain steps as hand-written kernels: a decoder layer in six launches.

A one-token step of the embedded target is 30 small layers. Compiled one layer at a time by Inductor (an engine
retired on 2026-12-07) each layer is ~9.6 kernels (the norms, the fused projection, rotary and the cache writes, FlashAttention,
the output projection, SwiGLU, the down projection), and replayed as a CUDA graph a step costs what its 288
kernels cost one after another, ~0.9 us between each (benchmarks/NOTES.md: 0.64 ms of kernel time, 0.84 ms a
token). Here a layer is six Triton kernels (``kernels.decoder_source``), each doing all the work around one matmul or
the attention:

1. ``qkv``: the input norm, the fused query/key/value projection (Qwen3: each query and key head normalised,
   a program's columns then one head), rotary on the query and key pairs, the keys and values written into
   the cache (a tree's nodes turned by their own positions);
2. ``attention``: attention of the new tokens over the cache (causal, or under a tree's mask), split along the positions (flash-decoding:
   every key/value head's used positions shared among up to SPLITS programs, each reading its keys once for
   every query head of the group and every new token);
3. ``merge``: the splits merged by their maxima and sums, the attention's output in the model's dtype;
4. ``residual``: the output projection and the residual add;
5. ``up``: the post-attention norm, the gate and up projections and SwiGLU's product;
6. ``residual`` again: the down projection and the residual add;

and after the last layer the plain forward's final norm and head (cuBLAS reads the vocabulary's rows near the
memory's bandwidth). A step of M tokens (one, or a block) is 6 x layers launches, an embedding gather and the
head's few kernels. One token's matmuls are matrix-vector products over many programs (a few output columns
each: the weights are what a step reads); a block's go through ``tl.dot`` on the tensor cores. The kernels
round to the model's dtype where the plain forward (``slot_decoder.decode``) rounds, so in float32 they give
its numbers up to summation order (tested against it, and the engine against the reference one token for
token). Measured on the H200: benchmarks/RESULTS.md.

On a GPU the kernels are compiled by Triton (``triton.jit``); on the CPU they run in Triton's interpreter
(TRITON_INTERPRET=1 before Triton is first imported), the same source in numpy: slow, for tests.
``unsupported`` says which targets they cannot run (choose --layers torch for those).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.target.slot_decoder import DecoderWeights, LayerWeights, SlotCache, head_into, rms_norm

KERNELS = ("qkv", "attention", "merge", "up", "residual")
MAX_ROWS = 128  # new tokens a step: a token, a block or a tree (a prompt goes through the plain forward)
# tl.dot's smallest tile: a block of up to this many rows is padded to it; more rows are a tree's
DOT_ROWS = 16


@dataclass(frozen=True)
class Tiles:
    """Each kernel's share of the work. One token: output columns per program (a few, so that the weight's
    bytes spread over many programs) and the products a program holds at once (columns x inner step: the
    inner step follows from it, the whole hidden size for one step). A block (more than one token, through
    ``tl.dot``): ``block_columns`` (at least 16) and ``block_inner`` (any block: tl.dot pads its rows to 16);
    ``tree_columns`` and ``tree_inner`` for more rows (a tree's). The attention's splits along the positions,
    positions per step and rows per program, and whether the last split merges them (else a kernel of their
    own does); a block's split of the inner dimension in each matmul kernel (split-K: more programs for their
    few output columns); warps per program; dependent launch."""

    qkv_columns: int = 4  # even: rotary pairs
    up_columns: int = 4  # gate and up columns each
    residual_columns: int = 4  # the output and down projections
    products: int = 16384
    # a block's (or tree's) output columns a program: 16 x 32 is four m16n8 products, one for each of 4 warps
    # (16 x 16 had two). Measured (kernel_tiles, one H100, 2026-12-06): 16 -> 32 the block [1,8] 0.640 -> 0.582
    # ms, the tree [1,16] 0.695 -> 0.605
    block_columns: int = 32
    # the same for more than 16 rows in one tile (a tree's, with tree_rows 0): at 32 rows a 32-column gate/up
    # program spills 700 bytes a thread (sm_90, kernel_registers.py), 16 columns none
    tree_columns: int = 16
    # a block's inner step (a split's share of the down projection's 1,536 in one step; the other matmuls'
    # shares of 576 stay one step of 256).
    # Measured (one H100, 2026-12-06): 256 -> 512 kernel_tiles' block [1,8] -0.02 ms in three runs; in
    # the engine (decode_steps, one machine) its kernels -0.008 ms, the captured [1,8] 0.663 -> 0.633, the tree
    # round 0.785 -> 0.762; no spill (kernel_registers.py)
    block_inner: int = 512
    tree_inner: int = 256  # the step for more than 16 rows in one tile (tree_rows 0)
    # a matmul program's rows past 16 (a tree's): 0, all of a step's rows in one tile (tree_columns, tree_inner);
    # 16 (or 32 ...), tiles of that many rows, each a program of its own with a block's columns and inner step.
    # At 32 rows in one tile the gate/up program holds 255 registers a thread (sm_90, kernel_registers.py): two
    # programs a multiprocessor, 384 programs in 1.45 waves; 16-row tiles hold ~128, one wave.
    # Measured (one H100, 2026-12-07, kernel_tiles --tree-nodes 20, benchmarks/RESULTS.md): the tree step
    # [1,21] 0.790 / 0.773 -> 0.646 / 0.630 ms, its up kernel 0.312 -> 0.200 ms; one token and a block of 8 level.
    # In the engine (decode_steps, Triton layers, benchmarks/results/decode_steps.json): a tree-of-20 round +29.6% ->
    # +12.0% over the chain's, a tree of 31 +40.5% -> +21.8%
    tree_rows: int = 16
    attention_positions: int = 64
    # an attention program's rows (new tokens x query heads of a group) at most: a tree of 16 rows and 3 query
    # heads a group has 48, a block of 8 has 24. Measured (kernel_tiles, 2026-12-05, one H100): 16 against 64
    # the tree step [1,16] 0.740 -> 0.705 ms at context 400 and 0.809 -> 0.744 at 800, the block 0.654 -> 0.646
    attention_rows: int = 16
    splits: int = 8  # programs per key/value head along the positions
    residual_splits: int = 4  # a block's output and down projections' inner dimension among this many
    # programs (one token takes none: its many programs of few columns already fill the GPU)
    qkv_splits: int = 4  # the same for a block's qkv and up kernels (the last share does the rotary or
    up_splits: int = 4  # SwiGLU: ``kernel_source.arrived_last``): a block of 8 0.717 -> 0.646 ms, a tree of
    # 33 0.947 -> 0.931, one token unchanged (kernel_tiles, H100, 2026-12-05)
    merge_in_attention: bool = False  # the attention's splits merged by the split that arrives last (no
    # merge kernel: 30 launches a step fewer; ``kernel_source.merged_rows``)
    warps: int = 4
    # warps a program of a block's (or a tree's) matmul kernels: tl.dot's 16 x 16 tile is two m16n8 products,
    # so of 4 warps two repeat the others' (the loads use all of them)
    block_warps: int = 4
    pdl: bool = True  # programmatic dependent launch where the GPU has it (``pdl_args``): its GPU test (a
    # captured step equal to the serial one, 200 replays) passed on an H200, one token 0.532 -> 0.436 ms and a
    # block of 8 0.788 -> 0.686 (kernel_tiles, 2026-12-05)

    # the residual kernels (output and down projections) by dependent launch too: off, each waits for the kernel
    # before it to end and the next waits for it (a measurement's switch: split-K 8 there took 0.015 ms of kernel
    # time off a tree step and added 0.06 ms to the captured step, where without dependent launch the two were
    # level; docs/design-notes.md, 2026-12-06)
    residual_pdl: bool = True

    def __post_init__(self) -> None:
        flags = ("warps", "pdl", "merge_in_attention", "residual_pdl")
        sizes = {k: v for k, v in vars(self).items() if k not in flags and not (k == "tree_rows" and v == 0)}
        odd = [f"{k}={v}" for k, v in sizes.items() if v < 1 or v & (v - 1)]
        narrow = min(self.block_columns, self.tree_columns, self.attention_rows) < DOT_ROWS
        narrow = narrow or 0 < self.tree_rows < DOT_ROWS
        if odd or self.qkv_columns < 2 or narrow:
            raise ValueError(
                f"Tiles: {', '.join(odd) or 'qkv_columns, block_columns, tree_columns, attention_rows, tree_rows'}:"
                " each a power of 2, qkv_columns at least 2 (rotary pairs), block_columns, tree_columns and "
                "attention_rows at least 16 (tl.dot), tree_rows 0 or at least 16"
            )

    def tile_rows(self, rows: int) -> int:
        """The rows of a matmul program's tile in a step of ``rows`` rows: all of them, or (``tree_rows``, past
        DOT_ROWS rows) at most tree_rows."""
        return min(rows, self.tree_rows) if self.tree_rows and rows > DOT_ROWS else rows

    def row_tiles(self, rows: int) -> int:
        """How many row tiles a matmul of ``rows`` rows takes (programs along axis 0 per column tile)."""
        return -(-rows // self.tile_rows(rows))

    def columns(self, kernel: str, rows: int) -> int:
        """A program's output columns: a token's per kernel, a block's (up to DOT_ROWS rows), a tree's (more);
        for a tile's rows (``tile_rows``)."""
        rows = self.tile_rows(rows)
        if rows > DOT_ROWS:
            return self.tree_columns
        return self.block_columns if rows > 1 else getattr(self, f"{kernel}_columns")

    def inner(self, k: int, rows: int, columns: int) -> int:
        """The inner dimension's step for a matmul of inner size k: a power of 2, at least 32, at most k's."""
        # a block (up to 16 rows: tl.dot pads them to 16) takes ``block_inner``, a tree (more rows) ``tree_inner``
        # (measured: a 33-row tree step 1.36 -> 1.18 ms at 4x the step, 2026-12-05); for a tile's rows
        rows = self.tile_rows(rows)
        if rows > DOT_ROWS:
            step = self.tree_inner
        elif rows > 1:
            step = self.block_inner
        else:
            step = _pow2_floor(self.products // columns)
        return max(32, min(_pow2(k), step))


def unsupported(w: DecoderWeights) -> str | None:
    """Why the kernels cannot run this target's layers (None: they can)."""
    return unsupported_shape(w.head_dim, w.dtype)


def unsupported_shape(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run layers of this head dim in this dtype (None: they can)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"a head dim of {head_dim} (the kernels take powers of 2 from 16)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weights in {dtype}"
    return None


def triton_missing() -> str | None:
    """Why Triton cannot be imported (None: it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e}): pip install triton, or choose --layers torch"
    return None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 before Triton's first import: the CPU
    tests set it), where they take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _compiled() -> SimpleNamespace:
    """The kernels of ``kernels.decoder_source`` by name (``triton.jit`` gives the interpreter's functions when
    ``interpreting``)."""
    why = triton_missing()
    if why:
        raise DflashkitError(why)
    from dflashkit.infer.kernels import decoder_source as kernel_source

    return SimpleNamespace(**{k: getattr(kernel_source, f"{k}_kernel") for k in KERNELS})


def check_runnable(device: torch.device) -> None:
    """Refuse, saying what to do, a device the kernels cannot run on."""
    why = triton_missing()
    if why:
        raise DflashkitError(why)
    if device.type != "cuda" and not interpreting():
        raise DflashkitError(
            f"the decoder kernels run on a GPU (the target is on {device.type}): choose --layers torch, "
            "or set TRITON_INTERPRET=1 to run them, slowly, in Triton's interpreter"
        )


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _precision(dtype: torch.dtype, upcast: bool) -> str:
    """Float32 products exactly (the lossless checks run in float32, and ``upcast`` operands are float32);
    bf16 and fp16 operands ignore it."""
    return "ieee" if dtype == torch.float32 or upcast else "tf32"


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(device: torch.device, wanted: bool = True) -> dict:
    """Programmatic dependent launch (Hopper and later; never in the interpreter): each kernel is launched
    while the one before it still runs, reads its first weight tile, and waits for that kernel's writes
    (``kernel_source.wait_for_inputs``): the launch and the weights' first read off the critical path."""
    on = wanted and device.type == "cuda" and not interpreting() and _has_pdl(device.index or 0)
    return dict(GDC=True, launch_pdl=True) if on else dict(GDC=False)


def _launch_args(w: DecoderWeights, m: int, tiles: Tiles) -> tuple[dict, dict]:
    """The launch arguments every kernel of a step of m rows takes (``common``), and those of its matmuls:
    one token through matrix-vector products, a block through ``tl.dot`` over rows padded to 16 (a few rows
    the token's way measured 2.5-12x slower: docs/design-notes.md, 2026-12-05)."""
    block = m > 1
    upcast = interpreting()  # the interpreter's tl.dot takes float32 operands
    common = dict(
        num_warps=tiles.warps,
        PRECISION=_precision(w.dtype, upcast),
        UPCAST=upcast,
        **pdl_args(w.embed.device, tiles.pdl),
    )
    matmul = dict(common, num_warps=tiles.block_warps) if block else common
    rows = _pow2(tiles.tile_rows(m)) if block else 1
    return common, dict(DOT=block, BLOCK_M=rows, ROW_TILES=tiles.row_tiles(m), **matmul)


def _launch_qkv(
    w: DecoderWeights,
    weights: LayerWeights | KeyValueWeights,
    norm: Tensor,
    x: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start: Tensor,
    positions: Tensor | None,
    tiles: Tiles,
    split: tuple[int, Tensor, Tensor] | None = None,
    cache_layers: int = 0,
) -> None:
    """The qkv kernel over rows x [M, H] after ``norm``: a layer's (queries into q, keys and values into the
    layer's cache [capacity, NK, D] at ``start`` + m, turned by those positions or by ``positions``), or
    every layer's keys and values at once (``KeyValueWeights``: layer l's written ``cache_layers`` elements
    after k_cache and v_cache, layer 0's). ``split``: split-K's shares at most, its partial sums and its
    counts (``decode_by_kernels``)."""
    m, hidden = x.shape
    nq, nk, d = w.heads, w.kv_heads, w.head_dim
    _, matmul = _launch_args(w, m, tiles)
    if isinstance(weights, KeyValueWeights):  # no query rows: no query norm
        layers, nqd = weights.kv.shape[0], 0
        W, bias, q_norm, k_norm = weights.kv, weights.bias, None, weights.k_norm
    else:
        layers, nqd = 1, nq * d
        W, bias, q_norm, k_norm = weights.qkv, weights.qkv_bias, weights.q_norm, weights.k_norm
    cols = qkv_columns(w, tiles, m)
    splits, parts, arrived = split or (1, x, start)
    step, share, n = shares(tiles, hidden, splits, m, cols)
    grid = (triton_cdiv(nqd + 2 * nk * d, cols) * matmul["ROW_TILES"], n, layers)
    dummy = norm
    _compiled().qkv[grid](
        x, norm, W, dummy if bias is None else bias, dummy if q_norm is None else q_norm,
        dummy if k_norm is None else k_norm, w.rotary_pairs, start, start if positions is None else positions,
        q, k_cache, v_cache, parts, arrived, w.eps, k_cache.shape[0], cache_layers,
        M=m, LAYERS=layers, H=hidden, NQD=nqd, NKD=nk * d, D=d, HAS_BIAS=bias is not None,
        HEAD_NORM=k_norm is not None, TREE=positions is not None, SPLIT_K=n,
        SHARE=share, BLOCK_N=cols, BLOCK_K=step, **matmul,
    )  # fmt: skip


def qkv_columns(w: DecoderWeights, tiles: Tiles, m: int) -> int:
    """A qkv program's output columns over m rows: one head where the heads are normalised (Qwen3, a DFlash
    drafter: the norm reads the whole head), else the tiles' for m rows."""
    return w.head_dim if w.layers[0].q_norm is not None else tiles.columns("qkv", m)


def shares(tiles: Tiles, inner: int, splits: int, m: int, columns: int) -> tuple[int, int, int]:
    """Split-K for a matmul of inner size ``inner``: its inner step, the share of the inner dimension a
    program sums (whole steps) and the number of shares (at most ``splits``; 1: no split)."""
    step = tiles.inner(triton_cdiv(inner, splits), m, columns)
    share = triton_cdiv(triton_cdiv(inner, splits), step) * step
    return step, share, triton_cdiv(inner, share)


def counters(cache: SlotCache, n: int) -> Tensor:
    """n per-tile counters for a step's kernels, zero (each launch leaves them zero: a tile's last part resets
    its count): the cache's own (the steps that write a cache run in turn), or new ones where it holds fewer."""
    if n <= cache.counts.numel():
        return cache.counts
    return torch.zeros(n, dtype=torch.int32, device=cache.counts.device)


@dataclass(frozen=True)
class KeyValueWeights:
    """Every layer's key and value rows of its fused projection, stacked: ``kv`` [layers, 2 NK D, H], their
    biases [layers, 2 NK D] and the key norms [layers, D] where the layers have them. What
    ``write_keys_values`` reads (a drafter's context rows), built once (``key_value_weights``)."""

    kv: Tensor
    bias: Tensor | None
    k_norm: Tensor | None


def key_value_weights(w: DecoderWeights) -> KeyValueWeights:
    """``w``'s layers' key and value rows stacked (copies: the layers keep their fused projections)."""
    q = w.heads * w.head_dim
    first = w.layers[0]
    with torch.no_grad():
        kv = torch.stack([layer.qkv[q:] for layer in w.layers]).contiguous()
        bias = None if first.qkv_bias is None else torch.stack([lw.qkv_bias[q:] for lw in w.layers])  # type: ignore[index]
        k_norm = None if first.k_norm is None else torch.stack([lw.k_norm for lw in w.layers])  # type: ignore[misc]
    return KeyValueWeights(kv, bias, k_norm)


def write_keys_values(
    w: DecoderWeights,
    kv: KeyValueWeights,
    cache: SlotCache,
    x: Tensor,
    norm: Tensor,
    start: Tensor,
    tiles: Tiles = Tiles(),
) -> None:
    """Every layer's keys and values (``kv``: ``w``'s, stacked) of rows x [M, H] after ``norm`` (no layer runs
    over them: a drafter's context rows), turned and written at positions ``start`` [1] + 0 .. M-1 of the
    cache's first slot: every layer in one launch (a program's layer its third index; a launch a layer was
    ``layers - 1`` launches more a draft step), of at most MAX_ROWS rows, split-K as a block step's qkv (a
    drafter's keys and values are a few column tiles: 6 programs a layer for the embedded target's drafter
    without it, and one head a program spilled 668 bytes a thread at the whole inner dimension, where a share
    of it spills none: sm_90, ``kernel_registers.py``, benchmarks/RESULTS.md, 2026-12-06).
    Shape-static: a CUDA graph captures it."""
    most = min(x.shape[0], MAX_ROWS)
    layers, n = kv.kv.shape[:2]
    split = None
    if most > 1 and tiles.qkv_splits > 1:
        cols = qkv_columns(w, tiles, most)
        partials = torch.empty(layers * tiles.qkv_splits * most * n, dtype=torch.float32, device=x.device)
        # the shares done per layer, column tile and row tile
        arrived = counters(cache, layers * triton_cdiv(n, cols) * tiles.row_tiles(most))
        split = (tiles.qkv_splits, partials, arrived)
    k_cache, v_cache = cache.k[0][0], cache.v[0][0]
    between = cache.keys.stride(0)  # one layer's cache to the next's (values alike)
    for a in range(0, x.shape[0], MAX_ROWS):
        rows = x[a : a + MAX_ROWS]
        at = start + a if a else start  # (no launch for the first, or only, piece)
        _launch_qkv(
            w, kv, norm, rows, k_cache, k_cache, v_cache, at, None, tiles, split if rows.shape[0] > 1 else None,
            between,
        )  # fmt: skip


def decode_by_kernels(
    w: DecoderWeights,
    cache: SlotCache,
    ids: Tensor,
    start: Tensor,
    out_logits: Tensor,
    out_rows: Tensor | None = None,
    keep: tuple[int, ...] = (),
    tiles: Tiles = Tiles(),
    positions: Tensor | None = None,
    seen: Tensor | None = None,
    head_from: int = 0,
) -> None:
    """The target over the new tokens ``ids`` [1, M] of the cache's first slot, written at positions
    ``start`` [1] + 0 .. M-1: their float32 logits into ``out_logits`` [M, V], and the outputs of the layers
    ``keep`` (concatenated) into ``out_rows`` [1, M, n * hidden]. ``seen`` [M, M] (bool or int8: new token i
    reads new token j) in place of the causal rule among the new tokens: a token tree's (``dflashkit.infer.tree``:
    each node reads itself and its ancestors) with its nodes' rotary ``positions`` [M] (the root's + the depth),
    or a drafter's block (every slot reads every slot) at a chain's positions (no ``positions``). ``head_from``:
    the logits of the rows from there only (``out_logits`` [M - head_from, V]). Shape-static: a CUDA graph
    captures it."""
    m = ids.shape[1]
    if m > MAX_ROWS:
        raise DflashkitError(
            f"the decoder kernels take at most {MAX_ROWS} new tokens a step, got {m}: prefill through "
            "slot_decoder.decode"
        )
    tree = seen is not None
    if positions is not None and not tree:
        raise ValueError("decode_by_kernels: a tree gives its mask with its positions")
    k = _compiled()
    hidden = w.embed.shape[1]
    nq, nk, d = w.heads, w.kv_heads, w.head_dim
    width = w.layers[0].gate_up.shape[0] // 2
    t = tiles
    common, matmul = _launch_args(w, m, t)
    matmul_row_tiles = matmul["ROW_TILES"]  # a matmul's programs per column tile (``Tiles.tree_rows``)
    pdl = {k: common[k] for k in ("GDC", "launch_pdl") if k in common}  # the merge's (no matmul options)
    cols = {name: t.columns(name, m) for name in ("up", "residual")}
    # splits along the positions: fewer for a cache that holds fewer steps of positions (a power of 2)
    splits = min(t.splits, _pow2(triton_cdiv(cache.capacity, t.attention_positions), least=1))
    steps = triton_cdiv(cache.capacity, splits * t.attention_positions)
    attention_rows = _pow2(m * (nq // nk))
    row_tiles = triton_cdiv(attention_rows, t.attention_rows)
    # a tree's mask as bytes, and its positions (a chain's kernels take a dummy for each: start)
    seen_bytes = seen.to(torch.int8) if seen is not None else start
    x = w.embed[ids[0]]  # [M, H]: a new tensor, updated in place layer by layer
    q = torch.empty(m, nq * d, dtype=w.dtype, device=x.device)
    parts = torch.empty(splits, m * nq, d, dtype=torch.float32, device=x.device)
    tops = torch.empty(splits, m * nq, dtype=torch.float32, device=x.device)
    totals = torch.empty_like(tops)
    attended = torch.empty(m, nq * d, dtype=w.dtype, device=x.device)
    act = torch.empty(m, width, dtype=w.dtype, device=x.device)
    # split-K (blocks only): each kernel's most shares; one buffer of partial sums and one of per-tile counts,
    # which the kernels use in turn (the counts zero: each launch leaves them zero), or dummies
    qkv_cols = qkv_columns(w, t, m)
    split_k = {
        "qkv": t.qkv_splits if m > 1 else 1,
        "up": t.up_splits if m > 1 else 1,
        "residual": t.residual_splits if m > 1 else 1,
    }
    sums = max(
        split_k["qkv"] * m * (nq + 2 * nk) * d,
        split_k["up"] * 2 * m * width,
        split_k["residual"] * m * hidden,
    )
    tiles_most = matmul_row_tiles * max(
        triton_cdiv((nq + 2 * nk) * d, qkv_cols),
        triton_cdiv(width, cols["up"]),
        triton_cdiv(hidden, cols["residual"]),
    )
    split_any = max(split_k.values()) > 1
    partials = torch.empty(sums, dtype=torch.float32, device=x.device) if split_any else x
    counts = max(tiles_most, nk * row_tiles) if split_any else nk * row_tiles if t.merge_in_attention else 0
    arrived = counters(cache, counts) if counts else start
    grids = {
        "attention": (nk, splits, row_tiles),
        "merge": (m * nq,),
        "up": (triton_cdiv(width, cols["up"]) * matmul_row_tiles,),
    }

    def residual(inner: int) -> tuple[tuple[int, int], dict]:
        """The residual kernel's grid and sizes for a projection from ``inner`` columns."""
        step, share, n = shares(t, inner, split_k["residual"], m, cols["residual"])
        sizes = dict(M=m, H=hidden, K=inner, SPLIT_K=n, SHARE=share, BLOCK_N=cols["residual"])
        plain = {k: v for k, v in matmul.items() if k not in ("GDC", "launch_pdl")}
        launch = plain | pdl_args(x.device, t.pdl and t.residual_pdl)
        grid = (triton_cdiv(hidden, cols["residual"]) * matmul_row_tiles, n)
        return grid, dict(BLOCK_K=step, **sizes, **launch)

    o_grid, o_sizes = residual(nq * d)
    down_grid, down_sizes = residual(width)
    up_step, up_share, up_n = shares(t, hidden, split_k["up"], m, 2 * cols["up"])
    qkv_split = (split_k["qkv"], partials, arrived)
    kept = []
    for i, layer in enumerate(w.layers):
        k_cache, v_cache = cache.k[i][0], cache.v[i][0]  # [capacity, NK, D]: the engine's one slot
        _launch_qkv(w, layer, layer.input_norm, x, q, k_cache, v_cache, start, positions, t, split=qkv_split)
        k.attention[grids["attention"]](
            q, k_cache, v_cache, start, seen_bytes, parts, tops, totals, attended, arrived, d**-0.5,
            cache.capacity, M=m, NQ=nq, NK=nk, D=d, SPLITS=splits, STEPS=steps, TREE=tree,
            MERGE=t.merge_in_attention, BLOCK_R=min(attention_rows, t.attention_rows),
            BLOCK_N=t.attention_positions, **common,
        )  # fmt: skip
        if not t.merge_in_attention:
            k.merge[grids["merge"]](
                parts, tops, totals, attended, M=m, NQ=nq, D=d, SPLITS=splits, num_warps=t.warps, **pdl
            )  # fmt: skip
        k.residual[o_grid](attended, layer.o, x, partials, arrived, **o_sizes)
        k.up[grids["up"] + (up_n,)](
            x, layer.post_norm, layer.gate_up, act, partials, arrived, w.eps, M=m, H=hidden, I=width,
            SPLIT_K=up_n, SHARE=up_share, BLOCK_N=cols["up"], BLOCK_K=up_step, **matmul,
        )  # fmt: skip
        k.residual[down_grid](act, layer.down, x, partials, arrived, **down_sizes)
        if i in keep:
            kept.append(x.clone())  # x keeps changing in place
    # the final norm and the head: one matrix of the vocabulary's rows, which cuBLAS reads near the memory's
    # bandwidth (the plain forward's own head, so its logits are the plain forward's)
    head_into(w, rms_norm(x[head_from:], w.norm, w.eps), out_logits)
    if keep:
        assert out_rows is not None
        out_rows.copy_(torch.cat(kept, dim=-1)[None])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

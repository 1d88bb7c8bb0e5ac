"""The compile runtime: the one way dflashkit runs flex_attention, and the guards that keep it compiled.

Why: flex_attention is fast and memory-linear only when Dynamo traces it. Called any other way (no
torch.compile, a compile that gave up, a recompile limit that ran out, a nested FX trace with
`error_on_nested_fx_trace=False`) it silently runs a dense O(Q*KV) math path that ends in an out-of-memory
crash. And `torch.compile` is not thread-safe: a thread entering a compiled function while another
thread compiles can hit torch's process-global FX-tracing flag. The rules here:

1. `flex_attention_entry` is the only call site. It runs `_flex_or_die`, compiled once per process with
   `fullgraph=True`, which raises DenseFallbackError if it ever executes outside Dynamo (the sentinel
   `torch.compiler.is_dynamo_compiling()` is constant-folded to True in the compiled graph).
2. `warmup(shapes, devices)` compiles every (device, shape bucket, forward and backward where the device
   has a flex backward) serially under one process-wide lock, then sets the `fail_on_recompile` stance.
   After that, a call with a shape that was not warmed raises CompileAfterWarmupError naming device and
   shape, before anything compiles.
3. Shapes are bucketed: `pick_bucket`, `bucket_layout`/`pad_layout`, `pad_to` (queries) and `pad_keys`
   (keys/values) pad context length and anchor count to a small fixed set. The recompile limit is sized from devices x buckets and passed as
   the `torch.compile(recompile_limit=)` keyword, which reaches every thread (a module-level config
   assignment is thread-local from torch 2.12 on).
4. `preflight_dense` refuses any non-flex path whose score matrix would exceed a memory budget.
5. `save_compile_cache` / `load_compile_cache` move torch.compiler cache artifacts between machines,
   keyed by the environment fingerprint; a cache from another build is refused (`portable_cache` wraps a
   warm-up with them: `run.compile_cache`).
6. `CompiledRegion` compiles a larger function (a drafter layer, a loss chunk, a decode engine's fixed-shape
   step, the last as CUDA graphs on a GPU) by the same rules: under the lock before warm-up, frozen after
   it, torch's failures turned into one clear error. Flex attention inside a region is traced into the
   region's graph.

We never set `error_on_nested_fx_trace=False` or `suppress_errors`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils import _pytree as pytree

from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.masks import BlockLayout
from dflashkit.errors import DflashkitError

# --------------------------------------------------------------------------------------------------
# Errors


class DenseFallbackError(DflashkitError):
    """flex_attention would run (or ran) outside its compiled kernel, on the dense O(Q*KV) path."""


class DenseBudgetError(DflashkitError):
    """A dense (non-flex) attention path would need more memory than the configured budget."""


class CompileAfterWarmupError(DflashkitError):
    """A compile was requested after warm-up froze the set of compiled shapes."""


class ConcurrentTraceError(DflashkitError):
    """Another thread held torch's process-global FX-tracing flag for too long."""


class ShapeBucketError(DflashkitError):
    """A length is larger than every configured shape bucket."""


class CompileCacheError(DflashkitError):
    """A portable compile cache is unreadable or was built by another environment."""


# --------------------------------------------------------------------------------------------------
# The compiled entry


COMPILE_LOCK = threading.RLock()  # every compile through this module happens while holding it

DEFAULT_RECOMPILE_LIMIT = 32  # before warm-up sizes it from devices x buckets
FLEX_BACKWARD_DEVICES = ("cuda",)  # flex_attention has no backward on the CPU
FX_WAIT_S = 60.0  # how long a call waits for another thread's FX trace to finish


def _flex_or_die(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float, enable_gqa: bool
) -> Tensor:
    if not torch.compiler.is_dynamo_compiling():
        raise DenseFallbackError(
            "flex_attention ran outside torch.compile, on its dense O(Q*KV) path; something disabled the "
            "compiled kernel (a nested FX trace with error_on_nested_fx_trace=False, suppress_errors, a "
            "'force_eager' stance or torch.compiler.disable): remove it and run `dflashkit doctor --check`"
        )
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def recompile_limit_reaches_threads() -> bool:
    """True when torch.compile takes `recompile_limit=` (a per-function limit every thread sees)."""
    try:
        return "recompile_limit" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C-level signature
        return False


def _config_reaches_threads(name: str, value: int) -> bool:
    seen: list[Any] = []
    t = threading.Thread(target=lambda: seen.append(getattr(torch._dynamo.config, name)))
    t.start()
    t.join()
    return bool(seen) and seen[0] == value


def _compile(
    fn: Callable[..., Any], recompile_limit: int, mode: str | None = None
) -> tuple[Callable[..., Any], int]:
    """torch.compile(fn, fullgraph, static shapes, ``mode``) with the limit passed so that every thread
    sees it; returns the compiled function and the limit in effect."""
    if recompile_limit_reaches_threads():
        return torch.compile(
            fn, fullgraph=True, dynamic=False, mode=mode, recompile_limit=recompile_limit
        ), recompile_limit
    # torch <= 2.11 has no keyword, and there a module-level config assignment is still process-wide
    # (it is shared with every other compiled function: raise it, never lower it).
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, recompile_limit)
    if not _config_reaches_threads("recompile_limit", cfg.recompile_limit):
        raise DflashkitError(
            f"torch {torch.__version__} has neither torch.compile(recompile_limit=) nor process-wide dynamo "
            "config, so a recompile limit cannot reach worker threads; use torch 2.11 or >= 2.13"
        )
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode), cfg.recompile_limit


def _build_compiled(recompile_limit: int) -> tuple[Callable[..., Tensor], int]:
    return _compile(_flex_or_die, recompile_limit)


def _cache_entries(fn: Callable[..., Any]) -> int | None:
    """Compiled graphs (Dynamo cache entries) of a function's code object; None where torch hides them."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(fn.__code__))
    except (ImportError, AttributeError):  # pragma: no cover - torch moved it
        return None


@dataclass
class _Runtime:
    compiled: Callable[..., Tensor] | None = None
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT
    compiled_keys: set[tuple] = field(default_factory=set)  # every key compiled through our entry
    warm_keys: set[tuple] = field(default_factory=set)  # keys warmed by warmup() (all of them once frozen)
    frozen: bool = False
    fx_waits: int = 0  # calls that waited for another thread's FX trace


_RT = _Runtime()


def set_recompile_limit(limit: int) -> None:
    """Rebuild the compiled entry with this recompile limit (compiled graphs are kept: Dynamo caches
    them per code object, shared by every wrapper)."""
    with COMPILE_LOCK:
        _RT.compiled, _RT.recompile_limit = _build_compiled(limit)


def _compiled() -> Callable[..., Tensor]:
    fn = _RT.compiled
    if fn is None:
        with COMPILE_LOCK:
            if _RT.compiled is None:
                _RT.compiled, _RT.recompile_limit = _build_compiled(_RT.recompile_limit)
            fn = _RT.compiled
    assert fn is not None
    return fn


def shape_key(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float) -> tuple:
    """What decides which compiled graph a call needs: device, dtype, shapes, grad, mask kind, scale."""
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    if block_mask is None:
        mask: tuple = ("none",)
    else:
        mm = block_mask.mask_mod
        kind = getattr(mm, "kind", getattr(mm, "__qualname__", type(mm).__name__))
        mask = (
            kind,
            tuple(block_mask.seq_lengths),
            tuple(block_mask.kv_indices.shape),
            block_mask.BLOCK_SIZE,
        )
    return (
        str(q.device),
        str(q.dtype).removeprefix("torch."),
        tuple(q.shape),
        tuple(k.shape),
        tuple(v.shape),
        grad,
        mask,
        round(float(scale), 9),
    )


def describe_key(key: tuple) -> str:
    device, dtype, qs, ks, _vs, grad, mask, _scale = key
    lengths = f", q_len x kv_len {mask[1][0]} x {mask[1][1]}" if len(mask) > 1 else ""
    return (
        f"device {device}, {dtype}, q {list(qs)}, k/v {list(ks)}, mask {mask[0]}{lengths}, "
        f"{'forward+backward' if grad else 'forward'}"
    )


def _is_nested_fx_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "symbolically trace a dynamo-optimized function" in str(e)


def _is_stance_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "stance is 'fail_on_recompile'" in str(e)


def _first_guard_failure(message: str) -> str:
    """The first guard-failure reason in torch's recompile message ('- 0/0: <reason>'), if any."""
    for line in message.splitlines():
        line = line.strip()
        if line.startswith("- "):
            return line[2:].split(": ", 1)[-1][:160]
    return ""


def _fx_flag_held() -> bool:
    import torch.fx._symbolic_trace as st

    return bool(getattr(st, "_is_fx_tracing_flag", False))


def _run(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float, key: tuple) -> Tensor:
    """Call the compiled entry; turn torch's failures into ours (one line, what to do)."""
    from torch._dynamo import exc as dynamo_exc

    limit_hit = getattr(dynamo_exc, "FailOnRecompileLimitHit", None) or dynamo_exc.FailOnCacheLimitHit
    grad = key[5]
    gqa = q.shape[1] != k.shape[1]
    deadline = time.monotonic() + FX_WAIT_S
    while True:
        try:
            with contextlib.nullcontext() if grad else torch.no_grad():
                return _compiled()(q, k, v, block_mask, scale, gqa)
        except limit_hit:
            raise DenseFallbackError(
                f"the recompile limit ({_RT.recompile_limit}) of dflashkit's flex_attention is spent at "
                f"{describe_key(key)}; torch would now run the dense path: bucket shapes "
                "(dflashkit.runtime.compile.bucket_layout) and warm them all with warmup()"
            ) from None
        except RuntimeError as e:
            if _is_stance_error(e):
                reason = _first_guard_failure(str(e))
                raise CompileAfterWarmupError(
                    f"flex_attention would compile after warm-up for {describe_key(key)}"
                    + (f" (guard failed: {reason})" if reason else "")
                    + "; add this shape bucket to warmup() (or pad to a warmed bucket with bucket_layout), "
                    "and warm up after all imports"
                ) from None
            if not _is_nested_fx_error(e):
                raise
            # Another thread is inside an FX trace (a compile, torch.export, fx.symbolic_trace) and holds
            # torch's process-global flag; nothing ran yet. Wait for it to finish, then retry.
            _RT.fx_waits += 1
            time.sleep(0.001)
            while _fx_flag_held() and time.monotonic() < deadline:
                time.sleep(0.001)
            if time.monotonic() >= deadline:
                raise ConcurrentTraceError(
                    f"another thread held torch's process-global FX-tracing flag for over {FX_WAIT_S:.0f} s, "
                    f"so compiled flex_attention could not run ({describe_key(key)}); warm every shape with "
                    "warmup() before starting threads, or run one process per GPU (torchrun)"
                ) from None


def _check_backward_device(q: Tensor, key: tuple) -> None:
    if key[5] and q.device.type not in FLEX_BACKWARD_DEVICES:
        raise DflashkitError(
            f"flex_attention has no backward on {q.device.type} in this torch; train there with the "
            "'sdpa' attention backend (flex backward needs a CUDA GPU)"
        )


def flex_attention_entry(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None = None, *, scale: float | None = None
) -> Tensor:
    """flex_attention through the compiled, sentinel-guarded entry. q [b, Hq, Q, D], k/v [b, Hkv, KV, D].

    Inside an enclosing torch.compile region Dynamo traces flex_attention as part of that graph, so the
    call goes straight through. Otherwise: before warm-up, compiles happen under COMPILE_LOCK; after it,
    only warmed shapes run (anything else raises CompileAfterWarmupError)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if torch.compiler.is_dynamo_compiling():
        return flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    key = shape_key(q, k, v, block_mask, scale)
    _check_backward_device(q, key)
    if _RT.frozen:
        if key not in _RT.warm_keys:
            raise CompileAfterWarmupError(
                f"flex_attention shape not warmed: {describe_key(key)}; add its bucket to warmup() or pad "
                "it to a warmed bucket (bucket_layout); compiling now could race other threads"
            )
        return _run(q, k, v, block_mask, scale, key)
    with COMPILE_LOCK:  # before warm-up: any compile happens here, one thread at a time
        out = _run(q, k, v, block_mask, scale, key)
        _RT.compiled_keys.add(key)
    return out


# --------------------------------------------------------------------------------------------------
# Compiled regions: a whole function (a decoder layer, a loss chunk) compiled under the same rules

# Graphs per region: one per (device, shape, grad mode) of every drafter in the process. Generous: the freeze
# after warm-up is what stops late compiles; this only bounds a runaway before it.
REGION_RECOMPILE_LIMIT = 256


class CompiledRegion:
    """``fn`` compiled whole (fullgraph, static shapes), so that the pointwise work around its matmuls
    (norms, RoPE, SwiGLU, softmax) fuses into a few kernels. Same rules as the flex entry: before warm-up
    a call that may compile holds COMPILE_LOCK (the warm-up also runs the backward under it, where torch
    compiles the backward graph); after ``freeze()`` torch's ``fail_on_recompile`` stance turns a new
    shape into CompileAfterWarmupError. A flex_attention call inside ``fn`` is traced into the region's
    graph (``flex_attention_entry`` sees Dynamo compiling), so the region never takes a dense path: were
    the region ever to run eagerly, its attention would still go through the entry. Creating a region
    compiles nothing.

    ``mode`` is torch.compile's: None (the default inductor mode) or ``"reduce-overhead"``, which on a
    GPU records each shape's kernels once as a CUDA graph and replays it (one launch per call; use
    ``graph_mode(device)``). A CUDA graph's outputs live in memory the next replay overwrites, so such
    a region starts a new CUDA-graph step before each call and returns copies of its outputs; tensors
    it mutates in place must have fixed addresses (``torch._dynamo.mark_static_address``), and its
    warm-up calls each shape three times (warm, record, replay) before ``freeze()``. ``warm_with`` and
    ``off_switch`` say, in its errors, what warms a shape and what turns the region off."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        mode: str | None = None,
        warm_with: str = "one training step of this shape",
        off_switch: str = "train.compile=off: only the attention compiled",
    ):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
        self.fn = fn
        self.name = name
        self.mode = mode
        self.warm_with = warm_with
        self.off_switch = off_switch
        self._compiled: Callable[..., Any] | None = None

    @property
    def graphed(self) -> bool:
        """True when calls replay CUDA graphs (mode reduce-overhead)."""
        return self.mode == "reduce-overhead"

    def _build(self) -> Callable[..., Any]:
        with COMPILE_LOCK:
            if self._compiled is None:
                self._compiled, _ = _compile(self.fn, REGION_RECOMPILE_LIMIT, self.mode)
            return self._compiled

    def graphs(self) -> int:
        """Compiled graphs the region holds (-1 where torch hides them)."""
        n = _cache_entries(self.fn)
        return -1 if n is None else n

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # inside an enclosing compile: trace straight through
            return self.fn(*args)
        compiled = self._compiled or self._build()
        if _RT.frozen:
            return self._guarded(compiled, args)
        with COMPILE_LOCK:  # before warm-up: any compile happens here, one thread at a time
            return self._guarded(compiled, args)

    def _describe(self, args: tuple[Any, ...]) -> str:
        return ", ".join(str(list(a.shape)) for a in args if isinstance(a, Tensor))

    def _guarded(self, compiled: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Call the compiled region; turn torch's compile failures into one line that says what to do."""
        from torch._dynamo import exc as dynamo_exc

        limit_hit = getattr(dynamo_exc, "FailOnRecompileLimitHit", None) or dynamo_exc.FailOnCacheLimitHit
        try:
            return self._invoke(compiled, args)
        except limit_hit:
            raise DflashkitError(
                f"{self.name} reached its recompile limit ({REGION_RECOMPILE_LIMIT} graphs) at inputs "
                f"{self._describe(args)}: too many shapes or devices in one process; pad shapes to fewer "
                f"buckets, or turn compiling off ({self.off_switch})"
            ) from None
        except RuntimeError as e:
            if _is_stance_error(e):
                reason = _first_guard_failure(str(e))
                raise CompileAfterWarmupError(
                    f"{self.name} would compile after warm-up (inputs {self._describe(args)}"
                    + (f"; guard failed: {reason}" if reason else "")
                    + f"); run {self.warm_with} during warm-up, or pad it to a warmed shape"
                ) from None
            if not isinstance(e, dynamo_exc.TorchDynamoException):  # e.g. out of memory: not a compile's
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DflashkitError(  # Unsupported, BackendCompilerFailed, ...
                f"{self.name} failed to compile ({type(e).__name__}: {first}); turn compiling off "
                f"({self.off_switch}) and report the torch build (`dflashkit doctor`)"
            ) from e

    def _invoke(self, compiled: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if not self.graphed:
            return compiled(*args)
        torch.compiler.cudagraph_mark_step_begin()  # outputs of earlier replays may now be overwritten
        out = compiled(*args)
        return pytree.tree_map_only(Tensor, torch.clone, out)  # the caller's own copies


COMPILE_MODES: tuple[str | None, ...] = (None, "reduce-overhead")


def graph_mode(device: torch.device | str) -> str | None:
    """The compile mode of a fixed-shape step on ``device``: CUDA graphs on a GPU (one launch per step
    instead of one per kernel), the default mode elsewhere (CUDA graphs exist only on CUDA)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


# --------------------------------------------------------------------------------------------------
# Shape buckets

CONTEXT_BUCKETS: tuple[int, ...] = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
ANCHOR_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


def pick_bucket(n: int, buckets: Sequence[int], what: str = "length") -> int:
    """The smallest bucket >= n."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ShapeBucketError(
        f"{what} {n} is larger than the largest bucket ({max(buckets)}); add a bucket (and warm it) or "
        f"truncate the input"
    )


def pad_to(x: Tensor, dim: int, length: int, value: float | int | bool = 0) -> Tensor:
    """Pad dimension `dim` of x at the end with `value` up to `length`."""
    n = x.shape[dim]
    if n > length:
        raise ShapeBucketError(f"cannot pad dimension {dim} of size {n} down to {length}")
    if n == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - n
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def pad_keys(x: Tensor, context_len: int, bucket_context_len: int, bucket_q_len: int, dim: int = 2) -> Tensor:
    """Pad keys or values laid out [context | blocks] along `dim`: the context part to
    bucket_context_len, the block part to bucket_q_len (as pad_layout lays out the bucketed keys)."""
    ctx, blocks = x.split([context_len, x.shape[dim] - context_len], dim=dim)
    return torch.cat([pad_to(ctx, dim, bucket_context_len), pad_to(blocks, dim, bucket_q_len)], dim=dim)


def pad_layout(layout: BlockLayout, context_len: int, num_blocks: int) -> BlockLayout:
    """Pad the context with padding positions (doc id -1) and the blocks with invalid blocks. Keys and
    queries keep their indices: context s stays s, block j stays block j."""
    return BlockLayout(
        anchors=pad_to(layout.anchors, 1, num_blocks, 0),
        block_valid=pad_to(layout.block_valid, 1, num_blocks, False),
        doc_ids=pad_to(layout.doc_ids, 1, context_len, -1),
        block_size=layout.block_size,
    )


def bucket_layout(
    layout: BlockLayout,
    context_buckets: Sequence[int] = CONTEXT_BUCKETS,
    anchor_buckets: Sequence[int] = ANCHOR_BUCKETS,
) -> BlockLayout:
    """Pad a layout to its (context length, anchor count) bucket."""
    return pad_layout(
        layout,
        pick_bucket(layout.context_len, context_buckets, "context length"),
        pick_bucket(layout.num_blocks, anchor_buckets, "anchor count"),
    )


# --------------------------------------------------------------------------------------------------
# Warm-up


@dataclass(frozen=True)
class AttentionShape:
    """One shape bucket of one attention call: what warm-up compiles."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context_len: int
    num_blocks: int
    block_size: int
    window: int | None = None
    causal_in_block: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len


def example_layout(shape: AttentionShape, device: torch.device | str = "cpu", seed: int = 0) -> BlockLayout:
    """A layout of this shape: one document, sorted random anchors (for warm-up and self-tests)."""
    g = torch.Generator().manual_seed(seed)
    S, N, B = shape.context_len, shape.num_blocks, shape.block_size
    anchors = torch.randint(0, max(S - B, 1), (shape.batch, N), generator=g).sort(dim=1).values
    return BlockLayout(
        anchors=anchors.to(device),
        block_valid=torch.ones(shape.batch, N, dtype=torch.bool, device=device),
        doc_ids=torch.zeros(shape.batch, S, dtype=torch.long, device=device),
        block_size=B,
    )


def example_inputs(
    shape: AttentionShape, device: torch.device | str = "cpu", requires_grad: bool = False, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Random q [b, Hq, Q, D], k and v [b, Hkv, KV, D] of this shape."""
    g = torch.Generator().manual_seed(seed)

    def randn(heads: int, length: int) -> Tensor:
        x = torch.randn(shape.batch, heads, length, shape.head_dim, generator=g).to(device, shape.dtype)
        return x.requires_grad_(requires_grad)

    return (
        randn(shape.q_heads, shape.q_len),
        randn(shape.kv_heads, shape.kv_len),
        randn(shape.kv_heads, shape.kv_len),
    )


@dataclass
class WarmupRecord:
    device: str
    shape: AttentionShape
    backward: bool
    seconds: float


def backward_supported(device: torch.device | str) -> bool:
    return torch.device(device).type in FLEX_BACKWARD_DEVICES


def default_devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def warmup(
    shapes: Iterable[AttentionShape],
    devices: Iterable[torch.device | str] | None = None,
    *,
    backward: bool | None = None,
    slack: int = 2,
    freeze: bool = True,
) -> list[WarmupRecord]:
    """Compile every (device, shape, forward [+ backward]) serially under COMPILE_LOCK, then freeze.

    backward=None warms the backward wherever the device has one (CUDA). Afterwards the recompile limit
    is the number of compiled graphs plus `slack`. With freeze=True, `torch.compiler.set_stance(
    "fail_on_recompile")` is set afterwards (process-wide: warm every other compiled function before
    this) and only warmed shapes may run. Warm up after all imports: a library that registers pytree
    nodes later (transformers does) changes a global that Dynamo guards on, so every graph would
    recompile."""
    shapes = list(shapes)
    if devices is None:
        devices = default_devices()
    elif isinstance(devices, (str, torch.device)):
        devices = [devices]
    devs = [str(torch.device(d)) for d in devices]
    records: list[WarmupRecord] = []
    with COMPILE_LOCK:
        if _RT.frozen:
            unfreeze()
        plan = []
        for dev in devs:
            for shape in shapes:
                passes = [False]
                if backward_supported(dev) if backward is None else backward:
                    passes.append(True)
                for grad in passes:
                    q, k, v = example_inputs(shape, dev, requires_grad=grad)
                    bm = flex_block_mask(example_layout(shape, dev), shape.window, shape.causal_in_block)
                    plan.append((dev, shape, grad, q, k, v, bm))
        keys = {shape_key(q, k, v, bm, q.shape[-1] ** -0.5) for *_, q, k, v, bm in plan}
        set_recompile_limit(compiled_graphs() + len(keys) + slack)  # room for every planned compile
        for dev, shape, grad, q, k, v, bm in plan:
            t0 = time.perf_counter()
            out = flex_attention_entry(q, k, v, bm)
            if grad:
                out.float().square().mean().backward()  # compiles the backward now, not in a worker
            if q.device.type == "cuda":
                torch.cuda.synchronize(q.device)
            records.append(WarmupRecord(dev, shape, grad, time.perf_counter() - t0))
        _RT.warm_keys |= keys
        set_recompile_limit(compiled_graphs() + slack)  # then tight: what exists, plus the slack
        if freeze:
            _set_frozen()
    return records


def compiled_graphs() -> int:
    """How many compiled graphs (Dynamo cache entries) the entry holds; the recompile limit counts them."""
    n = _cache_entries(_flex_or_die)
    return len(_RT.compiled_keys) if n is None else n


def _set_frozen() -> None:
    with COMPILE_LOCK:
        _RT.warm_keys |= _RT.compiled_keys
        torch.compiler.set_stance("fail_on_recompile")
        _RT.frozen = True


def freeze() -> None:
    """End warm-up: every shape compiled so far is warm, any other raises CompileAfterWarmupError, and
    torch's process-wide stance turns any other compile into an error. Use it after several
    warmup(..., freeze=False) calls (e.g. one per device)."""
    _set_frozen()


def unfreeze() -> None:
    """Allow compiles again (the stance goes back to default). Compiled graphs are kept."""
    with COMPILE_LOCK:
        if _RT.frozen:
            torch.compiler.set_stance("default")
        _RT.frozen = False


def is_frozen() -> bool:
    return _RT.frozen


def reset_runtime() -> None:
    """Forget warm-up state (tests, the doctor): unfreeze, default recompile limit, new wrapper."""
    with COMPILE_LOCK:
        unfreeze()
        _RT.warm_keys.clear()
        _RT.fx_waits = 0
        set_recompile_limit(DEFAULT_RECOMPILE_LIMIT)


def runtime_state() -> dict[str, Any]:
    """A summary for logs and the doctor."""
    return {
        "frozen": _RT.frozen,
        "recompile_limit": _RT.recompile_limit,
        "limit_passed_as_keyword": recompile_limit_reaches_threads(),
        "compiled_shapes": len(_RT.compiled_keys),
        "compiled_graphs": compiled_graphs(),
        "warm_shapes": len(_RT.warm_keys),
        "fx_waits": _RT.fx_waits,
    }


# --------------------------------------------------------------------------------------------------
# Pre-flight check for dense paths

DEFAULT_DENSE_BUDGET_GIB = 4.0
DENSE_BUDGET_ENV = "DFLASHKIT_DENSE_BUDGET_GIB"


def dense_budget_gib(budget_gib: float | None = None) -> float:
    """The budget: the argument, else $DFLASHKIT_DENSE_BUDGET_GIB, else 4 GiB."""
    if budget_gib is not None:
        return float(budget_gib)
    raw = os.environ.get(DENSE_BUDGET_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_DENSE_BUDGET_GIB
    try:
        value = float(raw)
    except ValueError:
        raise DflashkitError(f"{DENSE_BUDGET_ENV}={raw!r} is not a number of GiB (e.g. 4 or 0.5)") from None
    if value <= 0:
        raise DflashkitError(f"{DENSE_BUDGET_ENV}={raw!r} must be positive")
    return value


def preflight_dense(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    *,
    what: str,
    dtype_bytes: int = 4,
    budget_gib: float | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Refuse a dense attention path whose [batch, heads, q_len, kv_len] score matrix would exceed the
    budget. Returns the estimate in bytes. ``device``: where it would run, for a hint that fits it (flex
    on a GPU; smaller shapes on the CPU, where flex does not train)."""
    need = batch * heads * q_len * kv_len * dtype_bytes
    budget = dense_budget_gib(budget_gib)
    if need > budget * 2**30:
        raise DenseBudgetError(
            f"{what} would materialise a {batch}x{heads}x{q_len}x{kv_len} score matrix "
            f"({need / 2**30:.1f} GiB > budget {budget:g} GiB); {dense_hint(device)}"
        )
    return need


def dense_hint(device: torch.device | str | None) -> str:
    """What to do about a dense score matrix over budget, on this kind of device."""
    smaller = "fewer anchors per row, shorter rows or fewer rows per batch (train.num_anchors, train.max_len, train.batch_size)"
    kind = torch.device(device).type if device is not None else None
    if kind == "cpu":
        return (
            f"the flex backend does not train on the CPU, so use smaller shapes: {smaller}; or raise "
            f"{DENSE_BUDGET_ENV} if this machine has the memory"
        )
    flex = "use the flex backend (attention.backend=flex: compiled, memory linear in sequence length)"
    if kind is None:
        return f"{flex} on a GPU, or smaller shapes ({smaller}), or raise {DENSE_BUDGET_ENV}"
    return f"{flex}, or smaller shapes ({smaller}), or raise {DENSE_BUDGET_ENV}"


# --------------------------------------------------------------------------------------------------
# Portable compile cache

CACHE_FORMAT = "dflashkit-compile-cache-1"


def cache_key(fp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fingerprint entries a compiled kernel depends on (torch build, CUDA, triton, GPU type)."""
    from dflashkit.runtime import fingerprint as fpmod

    flat = fpmod.flatten(fp if fp is not None else fpmod.collect())
    return {k: flat.get(k) for k in fpmod.CRITICAL_KEYS}


def save_compile_cache(path: str | os.PathLike[str]) -> Path:
    """Write this process's compile artifacts (everything compiled so far) to one file, keyed by the
    environment. Raises CompileCacheError when nothing was compiled."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise CompileCacheError("nothing to save: no compile has produced cache artifacts in this process")
    data, _info = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": CACHE_FORMAT, "key": cache_key(), "bytes": len(data)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # per writer
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_compile_cache(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    path = Path(path)
    if not path.is_file():
        raise CompileCacheError(f"{path} does not exist; write one with save_compile_cache()")
    with open(path, "rb") as f:
        first = f.readline()
        data = f.read()
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != CACHE_FORMAT:
        raise CompileCacheError(f"{path} is not a dflashkit compile cache")
    if header.get("bytes") != len(data):
        raise CompileCacheError(f"{path} is truncated ({len(data)} of {header.get('bytes')} bytes)")
    return header, data


def load_compile_cache(path: str | os.PathLike[str], fp: dict[str, Any] | None = None) -> Any:
    """Load a portable compile cache written by save_compile_cache, after checking that it was built by
    this environment (same torch build, CUDA, triton and GPU type). Returns torch's CacheInfo."""
    header, data = read_compile_cache(path)
    here = cache_key(fp)
    differ = [k for k in here if header["key"].get(k) != here[k]]
    if differ:
        first = differ[0]
        raise CompileCacheError(
            f"{path} was built by another environment ({', '.join(differ)} differ: {first} "
            f"{header['key'].get(first)!r} there, {here[first]!r} here); delete it and let this machine "
            f"compile (caches are for speed only)"
        )
    try:
        return torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a payload torch cannot read: the cache is only for speed
        raise CompileCacheError(f"{path} could not be loaded by torch ({type(e).__name__}: {e})") from None


def _fx_cache_misses() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


@contextlib.contextmanager
def portable_cache(path: str | os.PathLike[str] | None, console: Any = None, *, save: bool = True):
    """Around a warm-up: load the cache file first when it exists and fits this environment, and write it
    afterwards when the warm-up compiled anything the file did not hold (``save=False``: never write, e.g.
    ranks other than 0). A cache is for speed only: one that does not fit or cannot be read or written is
    reported, never fatal."""
    if path is None:
        yield
        return

    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    loaded = False
    if Path(path).is_file():
        t0 = time.perf_counter()
        try:
            load_compile_cache(path)
            loaded = True
            say(f"compile cache {path}: loaded in {time.perf_counter() - t0:.1f} s")
        except (CompileCacheError, OSError) as e:
            say(f"[yellow]compile cache not used: {e}[/]")
    misses = _fx_cache_misses()
    yield
    if save and (not loaded or _fx_cache_misses() > misses):
        try:
            save_compile_cache(path)
            say(f"compile cache written to {path} ({Path(path).stat().st_size / 2**20:.1f} MiB)")
        except (CompileCacheError, OSError) as e:
            say(f"[yellow]compile cache not written: {e}[/]")

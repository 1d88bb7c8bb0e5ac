"""The one way dflashkit runs flex_attention: a compiled, sentinel-guarded entry.

flex_attention is fast and memory-linear only when Dynamo traces it. Called any other way (no
torch.compile, a compile that gave up, a recompile limit that ran out, a nested FX trace with
`error_on_nested_fx_trace=False`) it silently runs a dense O(Q*KV) math path that ends in an out-of-memory
crash. So:

1. `flex_attention_entry` is the only call site. It runs `_flex_or_die`, compiled once per process with
   `fullgraph=True`, which raises DenseFallbackError if it ever executes outside Dynamo (the sentinel
   `torch.compiler.is_dynamo_compiling()` is constant-folded to True in the compiled graph).
2. Before warm-up a call that may compile holds COMPILE_LOCK; inside `frozen_compiles()` only shapes
   compiled before run, and any other raises CompileAfterWarmupError naming device and shape, before
   anything compiles (`dflashkit.attention.warm_up` compiles every shape a run needs).
3. A call that meets another thread's FX trace (the threaded compile race) waits for it to end, then runs
   compiled; a spent recompile limit is a DenseFallbackError, never a dense path.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashkit.errors import DflashkitError
from dflashkit.runtime import torch_errors
from dflashkit.runtime.compile import (
    COMPILE_LOCK,
    CompileAfterWarmupError,
    cache_entries,
    compile_fullgraph,
    is_frozen,
    recompile_limit_reaches_threads,
)


class DenseFallbackError(DflashkitError):
    """flex_attention would run (or ran) outside its compiled kernel, on the dense O(Q*KV) path."""


class ConcurrentTraceError(DflashkitError):
    """Another thread held torch's process-global FX-tracing flag for too long."""


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


@dataclass
class _Entry:
    compiled: Any = None  # the compiled _flex_or_die, built on first use
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT
    compiled_keys: set[tuple] = field(default_factory=set)  # every key compiled through the entry
    fx_waits: int = 0  # calls that waited for another thread's FX trace


_ENTRY = _Entry()


def set_recompile_limit(limit: int) -> None:
    """Rebuild the compiled entry with this recompile limit (compiled graphs are kept: Dynamo caches
    them per code object, shared by every wrapper)."""
    with COMPILE_LOCK:
        _ENTRY.compiled, _ENTRY.recompile_limit = compile_fullgraph(_flex_or_die, limit)


def recompile_limit() -> int:
    return _ENTRY.recompile_limit


def _compiled() -> Any:
    fn = _ENTRY.compiled
    if fn is None:
        with COMPILE_LOCK:
            if _ENTRY.compiled is None:
                set_recompile_limit(_ENTRY.recompile_limit)
            fn = _ENTRY.compiled
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


def _run(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float, key: tuple) -> Tensor:
    """Call the compiled entry; turn torch's failures into ours (one line, what to do)."""
    grad = key[5]
    gqa = q.shape[1] != k.shape[1]
    deadline = time.monotonic() + FX_WAIT_S
    while True:
        try:
            with contextlib.nullcontext() if grad else torch.no_grad():
                return _compiled()(q, k, v, block_mask, scale, gqa)
        except torch_errors.recompile_limit_errors():
            raise DenseFallbackError(
                f"the recompile limit ({_ENTRY.recompile_limit}) of dflashkit's flex_attention is spent at "
                f"{describe_key(key)}; torch would now run the dense path: bucket shapes "
                "(dflashkit.attention.buckets.bucket_layout) and warm them all with warm_up()"
            ) from None
        except RuntimeError as e:
            if torch_errors.is_frozen_compile(e):
                reason = torch_errors.first_guard_failure(str(e))
                raise CompileAfterWarmupError(
                    f"flex_attention would compile after warm-up for {describe_key(key)}"
                    + (f" (guard failed: {reason})" if reason else "")
                    + "; add this shape bucket to warm_up() (or pad to a warmed bucket with bucket_layout), "
                    "and warm up after all imports"
                ) from None
            if not torch_errors.is_nested_fx_trace(e):
                raise
            # Another thread is inside an FX trace (a compile, torch.export, fx.symbolic_trace) and holds
            # torch's process-global flag; nothing ran yet. Wait for it to finish, then retry.
            _ENTRY.fx_waits += 1
            time.sleep(0.001)
            while torch_errors.fx_flag_held() and time.monotonic() < deadline:
                time.sleep(0.001)
            if time.monotonic() >= deadline:
                raise ConcurrentTraceError(
                    f"another thread held torch's process-global FX-tracing flag for over {FX_WAIT_S:.0f} s, "
                    f"so compiled flex_attention could not run ({describe_key(key)}); warm every shape with "
                    "warm_up() before starting threads, or run one process per GPU (torchrun)"
                ) from None


def backward_supported(device: torch.device | str) -> bool:
    return torch.device(device).type in FLEX_BACKWARD_DEVICES


def _check_backward_device(q: Tensor, key: tuple) -> None:
    if key[5] and not backward_supported(q.device):
        raise DflashkitError(
            f"flex_attention has no backward on {q.device.type} in this torch; train there with the "
            "'sdpa' attention backend (flex backward needs a CUDA GPU)"
        )


def flex_attention_entry(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None = None, *, scale: float | None = None
) -> Tensor:
    """flex_attention through the compiled, sentinel-guarded entry. q [b, Hq, Q, D], k/v [b, Hkv, KV, D].

    Inside an enclosing torch.compile region Dynamo traces flex_attention as part of that graph, so the
    call goes straight through. Otherwise: before warm-up, compiles happen under COMPILE_LOCK; inside
    `frozen_compiles()`, only shapes compiled before it run (anything else raises CompileAfterWarmupError)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if torch.compiler.is_dynamo_compiling():
        return flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    key = shape_key(q, k, v, block_mask, scale)
    _check_backward_device(q, key)
    if is_frozen():
        if key not in _ENTRY.compiled_keys:
            raise CompileAfterWarmupError(
                f"flex_attention shape not warmed: {describe_key(key)}; add its bucket to warm_up() or pad "
                "it to a warmed bucket (bucket_layout); compiling now could race other threads"
            )
        return _run(q, k, v, block_mask, scale, key)
    with COMPILE_LOCK:  # before warm-up: any compile happens here, one thread at a time
        out = _run(q, k, v, block_mask, scale, key)
        _ENTRY.compiled_keys.add(key)
    return out


def compiled_graphs() -> int:
    """How many compiled graphs (Dynamo cache entries) the entry holds; the recompile limit counts them."""
    n = cache_entries(_flex_or_die)
    return len(_ENTRY.compiled_keys) if n is None else n


def entry_state() -> dict[str, Any]:
    """A summary for logs, tests and the doctor."""
    return {
        "frozen": is_frozen(),
        "recompile_limit": _ENTRY.recompile_limit,
        "limit_passed_as_keyword": recompile_limit_reaches_threads(),
        "compiled_shapes": len(_ENTRY.compiled_keys),
        "compiled_graphs": compiled_graphs(),
        "fx_waits": _ENTRY.fx_waits,
    }


def reset_recompile_limit() -> None:
    """Back to the default recompile limit (the doctor, after its checks; compiled graphs are kept)."""
    with COMPILE_LOCK:
        _ENTRY.fx_waits = 0
        set_recompile_limit(DEFAULT_RECOMPILE_LIMIT)

"""A compiled region: a whole function (a drafter layer, a loss chunk) compiled under the compile rules of `dflashkit.runtime.compile`.

Compiled whole (fullgraph, static shapes), the pointwise work around a region's matmuls (norms, RoPE,
SwiGLU, softmax) fuses into a few kernels. Before warm-up a call that may compile holds COMPILE_LOCK (the
warm-up also runs the backward under it, where torch compiles the backward graph); inside
`frozen_compiles()` a new shape is a CompileAfterWarmupError. A flex_attention call inside the function
is traced into the region's graph (the flex entry sees Dynamo compiling), so the region never takes a
dense path. Creating a region compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.runtime import torch_errors
from dflashkit.runtime.compile import (
    COMPILE_LOCK,
    CompileAfterWarmupError,
    cache_entries,
    compile_fullgraph,
    is_frozen,
)

# Graphs per region: one per (device, shape, grad mode) of every drafter in the process. Generous: the freeze
# after warm-up is what stops late compiles; this only bounds a runaway before it.
REGION_RECOMPILE_LIMIT = 256


class CompiledRegion:
    """``fn`` compiled whole under the compile rules (see the module docstring), in Inductor's default mode.
    ``warm_with`` and ``off_switch`` say, in its errors, what warms a shape and what turns the region off."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        warm_with: str = "one training step of this shape",
        off_switch: str = "train.compile=off: only the attention compiled",
    ):
        self.fn = fn
        self.name = name
        self.warm_with = warm_with
        self.off_switch = off_switch
        self._compiled: Callable[..., Any] | None = None

    def _build(self) -> Callable[..., Any]:
        with COMPILE_LOCK:
            if self._compiled is None:
                self._compiled, _ = compile_fullgraph(self.fn, REGION_RECOMPILE_LIMIT)
            return self._compiled

    def graphs(self) -> int:
        """Compiled graphs the region holds (-1 where torch hides them)."""
        n = cache_entries(self.fn)
        return -1 if n is None else n

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # inside an enclosing compile: trace straight through
            return self.fn(*args)
        compiled = self._compiled or self._build()
        if is_frozen():
            return self._guarded(compiled, args)
        with COMPILE_LOCK:  # before warm-up: any compile happens here, one thread at a time
            return self._guarded(compiled, args)

    def _describe(self, args: tuple[Any, ...]) -> str:
        return ", ".join(str(list(a.shape)) for a in args if isinstance(a, Tensor))

    def _guarded(self, compiled: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Call the compiled region; turn torch's compile failures into one line that says what to do."""
        try:
            return compiled(*args)
        except torch_errors.recompile_limit_errors():
            raise DflashkitError(
                f"{self.name} reached its recompile limit ({REGION_RECOMPILE_LIMIT} graphs) at inputs "
                f"{self._describe(args)}: too many shapes or devices in one process; pad shapes to fewer "
                f"buckets, or turn compiling off ({self.off_switch})"
            ) from None
        except RuntimeError as e:
            if torch_errors.is_frozen_compile(e):
                reason = torch_errors.first_guard_failure(str(e))
                raise CompileAfterWarmupError(
                    f"{self.name} would compile after warm-up (inputs {self._describe(args)}"
                    + (f"; guard failed: {reason}" if reason else "")
                    + f"); run {self.warm_with} during warm-up, or pad it to a warmed shape"
                ) from None
            if not torch_errors.is_compile_failure(e):  # e.g. out of memory: not a compile's
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DflashkitError(  # Unsupported, BackendCompilerFailed, ...
                f"{self.name} failed to compile ({type(e).__name__}: {first}); turn compiling off "
                f"({self.off_switch}) and report the torch build (`dflashkit doctor`)"
            ) from e

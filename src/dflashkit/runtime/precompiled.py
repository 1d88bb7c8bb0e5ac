"""Precompiled steps: a fixed-shape step compiled ahead of time and loaded by a later process as it is.

The portable compile cache (`dflashkit.runtime.compile_cache`) spares a second process Inductor's work, not
Dynamo's: every step is traced again (30 layers unrolled), its graph keyed and looked up, before the cached
kernels load. A precompiled step (torch's ``torch.compile(fn, fullgraph=True).aot_compile``) holds the traced
graph, its guards and its compiled code together, so loading it skips the trace too. The weights, caches and
buffers stay inputs (a step precompiled with one drafter runs another of the same shapes: tested).

One file per step, beside the engine's compile cache, behind the same header (the environment's key: torch
build, CUDA, triton, GPU type). Like the compile cache it is for speed only: a torch without the API, a file of
another environment, one that cannot be read, or a step whose guards refuse this engine's inputs is reported
and the step compiles as before (``compile_step`` returns None, never raises).
"""

from __future__ import annotations

import functools
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.runtime import torch_errors
from dflashkit.runtime.compile import CompileAfterWarmupError
from dflashkit.runtime.compile_cache import (
    CompileCacheError,
    check_environment,
    read_keyed,
    write_keyed,
)

STEP_FORMAT = "dflashkit-precompiled-step-1"


@functools.cache
def available() -> bool:
    """This torch can precompile a step and load one (the API is experimental: it came in torch 2.9-2.10)."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    probe = torch.compile(_probe, fullgraph=True)
    return callable(getattr(probe, "aot_compile", None))


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x


def step_path(compile_cache: str | os.PathLike[str], label: str) -> Path:
    """The file of one step beside its engine's compile cache: ``graphs-<digest>.cache`` ->
    ``graphs-<digest>.<label>.step`` (the digest holds the target, dtype, drafter shape and capacity)."""
    path = Path(compile_cache)
    return path.with_name(f"{path.stem}.{label}.step")


@dataclass
class Precompiled:
    """What ``compile_step`` did for one step: ``fn`` to call in its place (None: compile it as before),
    ``loaded`` from its file or ``built`` now (and written), the seconds that took, and why it was not used."""

    fn: Callable[..., Any] | None = None
    loaded: bool = False
    built: bool = False
    seconds: float = 0.0
    note: str = ""


def load_step(path: Path, fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """The step precompiled in ``path`` for ``fn``, checked against this environment and ``args``.
    CompileCacheError (one line) when it cannot serve here."""
    header, data = read_keyed(path, STEP_FORMAT, "a dflashkit precompiled step", "it is written by a warm-up")
    check_environment(path, header, None)
    try:
        loaded = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=fn.__globals__)
        check = getattr(loaded, "guard_check", None)
        accepted = not callable(check) or check(*args)
    except Exception as e:  # a payload this torch cannot read or check: for speed only
        raise CompileCacheError(f"{path} could not be loaded by torch ({type(e).__name__}: {e})") from None
    if not accepted:
        raise CompileCacheError(f"{path} was precompiled for other inputs (its guards refuse these)")
    return loaded


def build_step(path: Path, fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """Precompile ``fn`` for ``args`` (it traces and compiles; nothing runs) and write it to ``path``."""
    compiled = torch.compile(fn, fullgraph=True).aot_compile((args, {}))  # type: ignore[attr-defined]
    data = type(compiled).serialize(compiled).serialized_data
    write_keyed(path, STEP_FORMAT, data)
    return compiled


def compile_step(path: Path, fn: Callable[..., Any], args: tuple[Any, ...]) -> Precompiled:
    """Load the step from ``path``, else precompile it and write the file; never raises: a step that cannot
    be precompiled here comes back with ``fn`` None and a one-line ``note``."""
    t0 = time.perf_counter()
    out = Precompiled()
    if not available():
        out.note = f"this torch ({torch.__version__}) cannot precompile steps"
        return out
    if path.is_file():
        try:
            out.fn, out.loaded = load_step(path, fn, args), True
        except (CompileCacheError, OSError) as e:
            out.note = str(e)
    if out.fn is None:
        try:
            out.fn, out.built = build_step(path, fn, args), True
        except Exception as e:  # an experimental API: any failure falls back to the ordinary compile
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            out.note = f"{path.name}: not precompiled ({type(e).__name__}: {first})"
    out.seconds = time.perf_counter() - t0
    return out


def guarded(fn: Callable[..., Any], name: str, warm_with: str) -> Callable[..., Any]:
    """``fn`` (a loaded or built step) whose guard failure (inputs of another shape, e.g. a step never
    warmed) is a CompileAfterWarmupError in one line, as a compiled region's would be: a precompiled step
    never compiles again."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:
            if not torch_errors.is_guard_refusal(e):
                raise
            reason = torch_errors.guard_refusal_reason(str(e))
            raise CompileAfterWarmupError(
                f"{name} would compile after warm-up (it was precompiled for other inputs"
                + (f"; guard failed: {reason}" if reason else "")
                + f"); run {warm_with} with these shapes, or pad to a warmed shape"
            ) from None

    return call

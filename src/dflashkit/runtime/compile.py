"""The compile rules: one lock for every compile, a recompile limit that reaches every thread, and a
scoped freeze.

`torch.compile` is not thread-safe: a thread entering a compiled function while another thread compiles
can hit torch's process-global FX-tracing flag (the threaded compile race). So every compile dflashkit
starts happens while holding `COMPILE_LOCK` (warm-up compiles each shape serially, before any worker
thread runs), and afterwards compiles are frozen:

    warm_up(...)                       # compiles, one at a time, under COMPILE_LOCK
    with frozen_compiles():            # nothing compiles in this process until the block ends
        ... worker threads step the warm shapes ...

Inside the block torch's ``fail_on_recompile`` stance turns any compile into an error, and dflashkit's
compiled functions (the flex entry, `CompiledRegion`) raise `CompileAfterWarmupError` naming the shape.
The block nests (a drafter thread's training loop inside a fan-out's block) and, when the outermost one
ends, the stance goes back to what it was: a later run in the same process warms and compiles its own
shapes.

The recompile limit is passed as the `torch.compile(recompile_limit=)` keyword, which reaches every
thread (a module-level config assignment is thread-local from torch 2.12 on).

We never set `error_on_nested_fx_trace=False` or `suppress_errors`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dflashkit.errors import DflashkitError

COMPILE_LOCK = threading.RLock()  # every compile dflashkit starts happens while holding it


class CompileAfterWarmupError(DflashkitError):
    """A compile was requested while compiles are frozen (after warm-up)."""


# --------------------------------------------------------------------------------------------------
# torch.compile with a recompile limit every thread sees


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


def compile_fullgraph(
    fn: Callable[..., Any], recompile_limit: int, mode: str | None = None
) -> tuple[Callable[..., Any], int]:
    """torch.compile(fn, fullgraph, static shapes, ``mode``) with the limit passed so that every thread
    sees it; returns the compiled function and the limit in effect. Compiles nothing yet."""
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


def cache_entries(fn: Callable[..., Any]) -> int | None:
    """Compiled graphs (Dynamo cache entries) of a function's code object; None where torch hides them."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(fn.__code__))
    except (ImportError, AttributeError):  # pragma: no cover - torch moved it
        return None


# --------------------------------------------------------------------------------------------------
# The scoped freeze


class _Freeze:
    depth = 0  # open frozen_compiles() blocks, over all threads
    stance: Any = None  # torch's stance context while depth > 0


def is_frozen() -> bool:
    """True inside a `frozen_compiles()` block (of any thread)."""
    return _Freeze.depth > 0


@contextlib.contextmanager
def frozen_compiles() -> Iterator[None]:
    """No compile in this process while the block runs: torch's ``fail_on_recompile`` stance, and
    dflashkit's compiled functions run only shapes warmed before it. Blocks nest, also across threads;
    the outermost one's end restores torch's stance."""
    with COMPILE_LOCK:
        if _Freeze.depth == 0:
            stance = torch.compiler.set_stance("fail_on_recompile")
            stance.__enter__()  # idempotent: set_stance already set it; remembers the stance before
            _Freeze.stance = stance
        _Freeze.depth += 1
    try:
        yield
    finally:
        with COMPILE_LOCK:
            _Freeze.depth -= 1
            if _Freeze.depth == 0:
                _Freeze.stance.__exit__(None, None, None)
                _Freeze.stance = None


def check_not_frozen(what: str) -> None:
    """Refuse a warm-up inside a `frozen_compiles()` block: it would compile while other threads run."""
    if is_frozen():
        raise CompileAfterWarmupError(
            f"{what} was asked to compile inside a frozen_compiles() block; warm up every shape before "
            "the block starts (before any worker thread runs)"
        )

"""Recognising torch's compile failures, so that each becomes one clear dflashkit error.

By type where torch gives one: a spent recompile limit (`FailOnRecompileLimitHit`, `FailOnCacheLimitHit`
on older builds) and a failed compile (`TorchDynamoException`: Unsupported, BackendCompilerFailed, ...).
Two failures arrive as a plain `RuntimeError` with nothing else to tell them by; we take exactly that
type (never one of its subclasses, such as torch.OutOfMemoryError) together with what we know of the
process's state, and only then torch's wording:

- a compile while compiles are frozen: torch's ``fail_on_recompile`` stance fires, which dflashkit sets
  only inside `frozen_compiles()`;
- the threaded compile race: a call into a compiled function while another thread holds torch's
  process-global FX-tracing flag (a compile, torch.export, fx.symbolic_trace elsewhere).
"""

from __future__ import annotations

from typing import Any

from dflashkit.runtime.compile import is_frozen


def recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """What torch raises when a compiled function has spent its recompile limit."""
    from torch._dynamo import exc as dynamo_exc

    found = [getattr(dynamo_exc, name, None) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")]
    return tuple(t for t in found if isinstance(t, type))


def is_compile_failure(e: BaseException) -> bool:
    """A compile that failed (graph break under fullgraph, a backend error): not out-of-memory, not ours."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(e, TorchDynamoException)


def is_frozen_compile(e: BaseException) -> bool:
    """torch's ``fail_on_recompile`` stance refused a compile (inside `frozen_compiles()`)."""
    return type(e) is RuntimeError and is_frozen() and "stance is 'fail_on_recompile'" in str(e)


def is_nested_fx_trace(e: BaseException) -> bool:
    """A compiled function was entered while torch's process-global FX-tracing flag was set."""
    return type(e) is RuntimeError and "symbolically trace a dynamo-optimized function" in str(e)


def fx_flag_held() -> bool:
    """Whether some thread holds torch's process-global FX-tracing flag right now."""
    import torch.fx._symbolic_trace as symbolic_trace

    flag: Any = getattr(symbolic_trace, "_is_fx_tracing_flag", False)
    return bool(flag)


def first_guard_failure(message: str) -> str:
    """The first guard-failure reason in torch's recompile message ('- 0/0: <reason>'), if any."""
    for line in message.splitlines():
        line = line.strip()
        if line.startswith("- "):
            return line[2:].split(": ", 1)[-1][:160]
    return ""

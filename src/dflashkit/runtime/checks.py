"""`dflashkit doctor --check`: live self-tests, and the known-issues table read off the installed torch.

A self-test is a function returning a `CheckResult`; `register_check` adds one. Modules of higher
layers register theirs when imported (`dflashkit.attention.checks`: the compiled flex_attention and
thread-safety checks; the doctor command imports it), so this module depends on none of them. The known issues are read by *inspecting* torch
(the objects that decide the behaviour), not by trusting its version string.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    skipped: bool = False


CheckFn = Callable[[], CheckResult]
_CHECKS: list[tuple[str, CheckFn]] = []


def register_check(name: str) -> Callable[[CheckFn], CheckFn]:
    """Add a self-test under ``name`` (registering a name again replaces it)."""

    def deco(fn: CheckFn) -> CheckFn:
        _CHECKS[:] = [(n, f) for n, f in _CHECKS if n != name]
        _CHECKS.append((name, fn))
        return fn

    return deco


def run_checks() -> list[CheckResult]:
    """Run every registered self-test; a crashing test is a failed line, never a traceback."""
    results = []
    for name, fn in _CHECKS:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # a self-test must report, not crash the doctor
            r = CheckResult(name, False, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        r.seconds = time.perf_counter() - t0
        results.append(r)
    return results


@register_check("imports")
def _check_imports() -> CheckResult:
    import importlib
    from importlib import metadata

    versions = []
    for mod, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("safetensors", "safetensors"),
        ("pydantic", "pydantic"),
        ("yaml", "pyyaml"),
        ("rich", "rich"),
        ("matplotlib", "matplotlib"),
    ):
        importlib.import_module(mod)
        versions.append(f"{mod} {metadata.version(dist)}")
    return CheckResult("imports", True, ", ".join(versions))


@register_check("torch cpu math")
def _check_cpu_math() -> CheckResult:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g, dtype=torch.float64)
    err = (torch.linalg.inv(a) @ a - torch.eye(64, dtype=torch.float64)).abs().max().item()
    return CheckResult("torch cpu math", err < 1e-8, f"inv(A)@A - I max error {err:.1e}")


@register_check("cuda allocation")
def _check_cuda() -> CheckResult:
    import torch

    if not torch.cuda.is_available():
        return CheckResult("cuda allocation", True, "no CUDA GPU: skipped", skipped=True)
    lines = []
    for i in range(torch.cuda.device_count()):
        x = torch.ones(256, 1024, 1024, device=f"cuda:{i}", dtype=torch.float32)  # 1 GiB
        s = x.sum().item()
        del x
        torch.cuda.synchronize(i)
        if s != 256 * 1024 * 1024:
            return CheckResult("cuda allocation", False, f"cuda:{i} wrong sum {s}")
        lines.append(f"cuda:{i} 1 GiB ok")
    return CheckResult("cuda allocation", True, ", ".join(lines))


# --------------------------------------------------------------------------------------------------
# Known issues, read off the installed torch.


@dataclass
class KnownIssue:
    name: str
    present: bool | None  # None: could not tell
    detail: str
    advice: str


def known_issues() -> list[KnownIssue]:
    import torch

    out: list[KnownIssue] = []

    # 1. The threaded compile race: the FX-tracing flag is a process-global module variable.
    try:
        import torch.fx._symbolic_trace as symbolic_trace

        flag = getattr(symbolic_trace, "_is_fx_tracing_flag", None)
        if isinstance(flag, bool):
            session = hasattr(torch.compiler, "_compile_session_context")
            out.append(
                KnownIssue(
                    "FX-tracing flag is process-global",
                    True,
                    "torch.fx._symbolic_trace._is_fx_tracing_flag is a module bool"
                    + (
                        " (compile-session flag narrows the window)"
                        if session
                        else " (no compile-session flag: wide window, as in 2.11)"
                    ),
                    "a thread entering a compiled function while another compiles can fail; "
                    "dflashkit warms every shape serially and then forbids compiles",
                )
            )
        else:
            out.append(
                KnownIssue("FX-tracing flag is process-global", False, "flag is not a module bool", "-")
            )
    except Exception as e:  # pragma: no cover
        out.append(KnownIssue("FX-tracing flag is process-global", None, str(e), "-"))

    # 2. Nested-FX check can silently run the uncompiled (dense) function.
    cfg = torch._dynamo.config
    silent = not getattr(cfg, "error_on_nested_fx_trace", True) or getattr(cfg, "suppress_errors", False)
    out.append(
        KnownIssue(
            "silent fall-back settings",
            silent,
            f"error_on_nested_fx_trace={getattr(cfg, 'error_on_nested_fx_trace', '?')}, "
            f"suppress_errors={getattr(cfg, 'suppress_errors', '?')}",
            "never set error_on_nested_fx_trace=False or suppress_errors: both run dense attention silently",
        )
    )

    # 3. Module-level compile config is thread-local (torch >= 2.12): assignments do not reach threads.
    out.append(_config_thread_local_issue())

    # 4. Whether torch.compile takes recompile_limit= (the only way a limit reaches every thread).
    try:
        params = inspect.signature(torch.compile).parameters
        has_kw = "recompile_limit" in params
    except (TypeError, ValueError):  # pragma: no cover
        has_kw = False
    out.append(
        KnownIssue(
            "torch.compile(recompile_limit=) missing",
            not has_kw,
            "keyword present" if has_kw else "keyword absent",
            "set TORCHDYNAMO_RECOMPILE_LIMIT before importing torch" if not has_kw else "-",
        )
    )

    # 5. flex_attention backward on CPU (matters only where training runs on the CPU).
    cpu_only = not torch.cuda.is_available()
    out.append(
        KnownIssue(
            "flex_attention has no CPU backward",
            cpu_only,
            "no CUDA device: training attention runs on the CPU" if cpu_only else "CUDA present",
            "dflashkit trains on the CPU with the sdpa backend" if cpu_only else "-",
        )
    )
    return out


def _config_thread_local_issue() -> KnownIssue:
    import torch

    cfg = torch._dynamo.config
    seen: list[int] = []
    original = cfg.cache_size_limit
    with cfg.patch(cache_size_limit=original + 7):
        t = threading.Thread(target=lambda: seen.append(cfg.cache_size_limit))
        t.start()
        t.join()
    local = bool(seen) and seen[0] == original
    return KnownIssue(
        "dynamo config is thread-local",
        local,
        "a config value set in one thread is not seen by another"
        if local
        else "config assignments are process-wide",
        "pass limits as torch.compile keywords or environment variables, not module assignments"
        if local
        else "-",
    )

"""Peak memory of one call: how we show that attention memory stays linear (no dense score matrix).

On a GPU it is the CUDA allocator's peak. On the CPU (Linux) it is the process's peak resident set
(VmHWM), reset just before the call through /proc/self/clear_refs; large tensors are fresh pages there,
so a dense [B, H, Q, KV] score matrix shows up in full. Where neither is available the peak is None.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    except OSError:
        return False
    return True


def peak_memory(fn: Callable[[], T], device: torch.device | str) -> tuple[T, int | None]:
    """Run fn() and return (its result, peak bytes allocated above the level before the call)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    if device.type == "cpu" and _reset_cpu_peak():
        base = _proc_status_bytes("VmHWM")
        out = fn()
        peak = _proc_status_bytes("VmHWM")
        if base is not None and peak is not None:
            return out, max(peak - base, 0)
        return out, None
    return fn(), None

"""The pre-flight check of dense attention paths: a [batch, heads, q_len, kv_len] score matrix over the
memory budget is refused before anything runs, with a hint that fits the device (flex on a GPU, smaller
shapes on the CPU). No silent 50 GiB matrices: the eager backend and sdpa with a mask pass it first.
"""

from __future__ import annotations

import os

import torch

from dflashkit.errors import DflashkitError


class DenseBudgetError(DflashkitError):
    """A dense (non-flex) attention path would need more memory than the configured budget."""


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

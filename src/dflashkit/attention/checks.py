"""`dflashkit doctor --check` self-tests for attention (`register()` adds them; the doctor command calls it).

- dflash block mask: the tile-level BlockMask built from the anchors equals create_block_mask's, and the
  mask_mod equals the dense reference, on a packed layout with padding, close anchors and a window.
- flex attention (compiled): one compile of the sentinel-guarded entry; the sentinel proves the compiled
  kernel ran, the output matches the eager reference, peak memory stays far below the dense score
  matrix, and (on CUDA) the backward matches too.
- compile runtime (threads): after warm-up, several threads step the warm shape with fresh anchors while
  one asks for an unwarmed shape: zero errors, zero compiles, and a clear CompileAfterWarmupError.

Everything runs at one small shape (DOCTOR_SHAPE): one compile on the CPU (~20 s on 2 cores).
"""

from __future__ import annotations

import threading

import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflashkit.attention.backends import attention, build_mask
from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.flex import backward_supported, flex_attention_entry, reset_recompile_limit
from dflashkit.attention.masks import BlockLayout, dense_mask, dflash_mask_mod
from dflashkit.attention.memory import peak_memory
from dflashkit.attention.warm_up import (
    AttentionShape,
    default_devices,
    example_inputs,
    example_layout,
    warm_up,
)
from dflashkit.runtime.checks import CheckResult, register_check
from dflashkit.runtime.compile import CompileAfterWarmupError, frozen_compiles

# Large enough that a dense score matrix (4 x 1024 x 4096 fp32 = 64 MiB) stands out, small enough to
# run in milliseconds once compiled.
DOCTOR_SHAPE = AttentionShape(
    batch=1,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    context_len=3072,
    num_blocks=64,
    block_size=16,
    dtype=torch.float32,
)


def packed_layout(seed: int = 0) -> BlockLayout:
    """Two packed rows: three documents and tail padding each, sorted anchors some closer than B apart,
    and a few invalid blocks."""
    g = torch.Generator().manual_seed(seed)
    S, N, B = 300, 24, 16
    docs = torch.full((2, S), -1, dtype=torch.long)
    docs[0, :90], docs[0, 90:200], docs[0, 200:270] = 0, 1, 2
    docs[1, :40], docs[1, 40:230], docs[1, 230:290] = 5, 6, 7
    anchors = torch.randint(0, S - 4, (2, N), generator=g)
    anchors[:, :4] = torch.tensor([100, 101, 103, 110])  # adjacent and overlapping blocks
    anchors = anchors.sort(dim=1).values
    valid = torch.rand(2, N, generator=g) > 0.15
    return BlockLayout(anchors, valid, docs, B)


def check_block_mask() -> CheckResult:
    layout = packed_layout()
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    for window, causal in ((None, False), (64, True)):
        mm = dflash_mask_mod(layout, window=window, causal_in_block=causal)
        ours = flex_block_mask(layout, window=window, causal_in_block=causal)
        ref = create_block_mask(mm, layout.batch, None, layout.q_len, layout.kv_len, device="cpu")
        for n in names:
            if not torch.equal(getattr(ours, n), getattr(ref, n)):
                return CheckResult(
                    "dflash block mask", False, f"{n} differs from create_block_mask (window={window})"
                )
        vm = create_mask(mm, layout.batch, None, layout.q_len, layout.kv_len, device="cpu")
        if not torch.equal(vm, dense_mask(layout, window=window, causal_in_block=causal)):
            return CheckResult(
                "dflash block mask", False, f"mask_mod differs from the dense reference (window={window})"
            )
    return CheckResult(
        "dflash block mask",
        True,
        "tile BlockMask == create_block_mask, mask_mod == dense reference (full, sliding)",
    )


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_flex_compiled() -> CheckResult:
    shape = DOCTOR_SHAPE
    device = default_devices()[0]
    warm_up([shape], [device])
    try:
        layout = example_layout(shape, device, seed=1)
        q, k, v = example_inputs(shape, device, seed=1)
        bm = flex_block_mask(layout)
        out, peak = peak_memory(lambda: flex_attention_entry(q, k, v, bm), device)  # sentinel: compiled
        ref = attention(q, k, v, build_mask(layout, "eager"), backend="eager")
        err = _relative_error(out, ref)
        dense = shape.batch * shape.q_heads * shape.q_len * shape.kv_len * 4
        parts = [f"{device}: compiled kernel ran (sentinel), rel. error vs eager {err:.1e}"]
        ok = err < 1e-3
        if peak is None:
            parts.append("peak memory not measurable here")
        else:
            parts.append(f"peak {peak / 2**20:.1f} MiB vs dense scores {dense / 2**20:.0f} MiB")
            ok = ok and peak < dense / 8
        if backward_supported(device):
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
            flex_attention_entry(qg, kg, vg, bm).square().mean().backward()
            qe, ke, ve = (x.detach().requires_grad_(True) for x in (q, k, v))
            attention(qe, ke, ve, build_mask(layout, "eager"), backend="eager").square().mean().backward()
            gerr = max(_relative_error(a.grad, b.grad) for a, b in ((qg, qe), (kg, ke), (vg, ve)))
            parts.append(f"backward rel. error {gerr:.1e}")
            ok = ok and gerr < 1e-3
        else:
            parts.append("no flex backward on this device (trains with sdpa)")
        return CheckResult("flex attention (compiled)", ok, "; ".join(parts))
    finally:
        reset_recompile_limit()


def check_runtime_threads(threads: int = 3, steps: int = 4) -> CheckResult:
    from torch._dynamo.utils import counters

    shape = DOCTOR_SHAPE
    device = default_devices()[0]
    warm_up([shape], [device], backward=False)  # already compiled by the previous check: no compile
    graphs_before = counters["stats"]["unique_graphs"]
    errors: list[str] = []
    refused: list[str] = []

    def step(i: int) -> None:
        try:
            for s in range(steps):
                layout = example_layout(shape, device, seed=100 * i + s)
                q, k, v = example_inputs(shape, device, seed=s)
                out = flex_attention_entry(q, k, v, flex_block_mask(layout))
                if not torch.isfinite(out).all():
                    errors.append(f"thread {i}: non-finite output")
        except Exception as e:  # collected and reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    def new_shape() -> None:
        q, k, v = example_inputs(shape, device)
        try:
            flex_attention_entry(q[:, :2], k[:, :1], v[:, :1], flex_block_mask(example_layout(shape, device)))
            errors.append("an unwarmed shape ran after warm-up")
        except CompileAfterWarmupError as e:
            refused.append(str(e))
        except Exception as e:
            errors.append(f"new shape: {type(e).__name__}: {e}")

    try:
        with frozen_compiles():
            workers = [threading.Thread(target=step, args=(i,)) for i in range(threads)]
            workers.append(threading.Thread(target=new_shape))
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        compiled = counters["stats"]["unique_graphs"] - graphs_before
    finally:
        reset_recompile_limit()
    ok = not errors and compiled == 0 and len(refused) == 1
    detail = (
        f"{threads} threads x {steps} warm steps: {len(errors)} errors, {compiled} compiles after warm-up; "
        f"unwarmed shape refused: {'yes' if refused else 'no'}"
    )
    if errors:
        detail += f"; first error: {errors[0][:200]}"
    return CheckResult("compile runtime (threads)", ok, detail)


def register() -> None:
    """Add these self-tests to `dflashkit doctor --check` (the doctor command calls this)."""
    register_check("dflash block mask")(check_block_mask)
    register_check("flex attention (compiled)")(check_flex_compiled)
    register_check("compile runtime (threads)")(check_runtime_threads)

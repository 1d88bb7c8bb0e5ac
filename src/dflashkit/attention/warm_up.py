"""Warm-up of the flex entry: every (device, shape bucket, forward and backward where the device has a
flex backward) compiled serially under COMPILE_LOCK, before any worker thread starts.

    warm_up(shapes, devices)          # compiles each shape once, sizes the recompile limit
    with frozen_compiles():           # then: only these shapes run; any other is an error naming it
        ...

Warm up after all imports: a library that registers pytree nodes later (transformers does) changes a
global that Dynamo guards on, so every graph would recompile.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.flex import (
    backward_supported,
    compiled_graphs,
    flex_attention_entry,
    set_recompile_limit,
    shape_key,
)
from dflashkit.attention.masks import BlockLayout
from dflashkit.runtime.compile import COMPILE_LOCK, check_not_frozen


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


def default_devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def warm_up(
    shapes: Iterable[AttentionShape],
    devices: Iterable[torch.device | str] | torch.device | str | None = None,
    *,
    backward: bool | None = None,
    slack: int = 2,
) -> list[WarmupRecord]:
    """Compile every (device, shape, forward [+ backward]) serially under COMPILE_LOCK.

    backward=None warms the backward wherever the device has one (CUDA). Afterwards the recompile limit
    is the number of compiled graphs plus `slack`. Freeze compiles afterwards with `frozen_compiles()`:
    inside it only warmed shapes run."""
    shapes = list(shapes)
    if devices is None:
        devices = default_devices()
    elif isinstance(devices, (str, torch.device)):
        devices = [devices]
    devs = [str(torch.device(d)) for d in devices]
    records: list[WarmupRecord] = []
    with COMPILE_LOCK:
        check_not_frozen("flex attention warm-up")
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
        set_recompile_limit(compiled_graphs() + slack)  # then tight: what exists, plus the slack
    return records

"""The three attention backends agree (forward, and backward where the device has one), with GQA,
padding blocks give zeros and finite gradients, and dense paths pass the pre-flight memory check."""

import pytest
import torch

from dflashkit.attention.backends import attention, build_mask
from dflashkit.attention.checks import DOCTOR_SHAPE
from dflashkit.attention.dense_budget import DENSE_BUDGET_ENV, DenseBudgetError
from dflashkit.attention.masks import BlockLayout
from dflashkit.attention.warm_up import AttentionShape, example_inputs, example_layout
from dflashkit.errors import DflashkitError


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layout_with_padding(g, batch=2, S=48, N=6, Bs=4) -> BlockLayout:
    docs = torch.zeros(batch, S, dtype=torch.long)
    docs[:, S // 2 :] = 1
    docs[:, S - 5 :] = -1
    anchors = torch.randint(1, S - Bs, (batch, N), generator=g).sort(dim=1).values
    anchors[0, :3] = torch.tensor([10, 11, 13])  # overlapping blocks
    valid = torch.ones(batch, N, dtype=torch.bool)
    valid[0, -1] = False
    valid[1, 2] = False
    return BlockLayout(anchors, valid, docs, Bs)


def qkv(g, layout, hq=4, hkv=2, d=8, dtype=torch.float32, grad=False):
    def t(h, n):
        return torch.randn(layout.batch, h, n, d, generator=g).to(dtype).requires_grad_(grad)

    return t(hq, layout.q_len), t(hkv, layout.kv_len), t(hkv, layout.kv_len)


@pytest.mark.parametrize("window,causal", [(None, False), (12, False), (12, True)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_matches_eager_forward_and_backward_fp32(window, causal, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    layout = layout_with_padding(g)
    grads = {}
    outs = {}
    for backend in ("eager", "sdpa"):
        g2 = torch.Generator().manual_seed(0)
        q, k, v = qkv(g2, layout, hq, hkv, grad=True)
        mask = build_mask(layout, backend, window=window, causal_in_block=causal)
        out = attention(q, k, v, mask, backend=backend)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs[backend] = out.detach()
        grads[backend] = (q.grad, k.grad, v.grad)
    assert rel_err(outs["sdpa"], outs["eager"]) < 1e-5
    for a, b in zip(grads["sdpa"], grads["eager"], strict=True):
        assert rel_err(a, b) < 1e-5


def test_sdpa_bf16_is_within_bf16_tolerance_of_fp32_eager():
    g = torch.Generator().manual_seed(1)
    layout = layout_with_padding(g)
    q, k, v = qkv(g, layout, 4, 2)
    ref = attention(q, k, v, build_mask(layout, "eager"), backend="eager")
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), build_mask(layout, "sdpa"), backend="sdpa")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_padding_blocks_give_zeros_and_finite_grads(backend):
    g = torch.Generator().manual_seed(2)
    layout = layout_with_padding(g)
    layout = BlockLayout(
        layout.anchors, torch.zeros_like(layout.block_valid), layout.doc_ids, layout.block_size
    )
    layout.block_valid[0, 0] = True  # one real block among padding
    q, k, v = qkv(g, layout, 4, 2, grad=True)
    out = attention(q, k, v, build_mask(layout, backend), backend=backend)
    out.sum().backward()
    Bs = layout.block_size
    assert torch.all(out[0, :, Bs:] == 0) and torch.all(out[1] == 0)
    assert out[0, :, :Bs].abs().sum() > 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[0, :, Bs:] == 0)


def test_no_mask_means_every_key_and_flex_uses_the_fused_path():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 16, 8, generator=g),
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 2, 40, 8, generator=g),
    )
    ref = attention(q, k, v, None, backend="eager")
    for backend in ("sdpa", "flex"):
        assert rel_err(attention(q, k, v, None, backend=backend), ref) < 1e-5


def test_preflight_refuses_large_dense_paths(monkeypatch):
    g = torch.Generator().manual_seed(4)
    layout = layout_with_padding(g)
    q, k, v = qkv(g, layout)
    monkeypatch.setenv(DENSE_BUDGET_ENV, "0.00001")  # about 10 KiB
    with pytest.raises(DenseBudgetError, match="score matrix .* GiB > budget"):
        build_mask(layout, "sdpa")
    with pytest.raises(DenseBudgetError, match="eager attention"):
        attention(q, k, v, None, backend="eager")


def test_mask_and_backend_must_match():
    g = torch.Generator().manual_seed(5)
    layout = layout_with_padding(g)
    q, k, v = qkv(g, layout)
    with pytest.raises(ValueError, match="built for backend 'sdpa'"):
        attention(q, k, v, build_mask(layout, "sdpa"), backend="eager")
    with pytest.raises(ValueError, match="unknown attention backend"):
        build_mask(layout, "xformers")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :3], k, v, None, backend="sdpa")


# flex on the CPU: forward only, compiled once at the doctor's shape (shared with the other tests).


@pytest.fixture(scope="module")
def flex_cpu():
    return DOCTOR_SHAPE


def test_flex_forward_matches_eager_on_cpu(flex_cpu):
    shape = flex_cpu
    layout = example_layout(shape, seed=3)
    layout.block_valid[0, 5:9] = False  # padding blocks inside the compiled shape
    layout.doc_ids[0, 1500:] = 1
    layout.doc_ids[0, 3000:] = -1
    q, k, v = example_inputs(shape, seed=3)
    out = attention(q, k, v, build_mask(layout, "flex"), backend="flex")
    ref = attention(q, k, v, build_mask(layout, "eager"), backend="eager")
    assert rel_err(out, ref) < 1e-5
    Bs = shape.block_size
    assert torch.all(out[0, :, 5 * Bs : 9 * Bs] == 0) and torch.isfinite(out).all()


def test_flex_backward_on_cpu_is_refused_clearly(flex_cpu):
    q, k, v = example_inputs(flex_cpu, requires_grad=True)
    mask = build_mask(example_layout(flex_cpu), "flex")
    with pytest.raises(DflashkitError, match="no backward on cpu .* 'sdpa'"):
        attention(q, k, v, mask, backend="flex")


# GPU: flex forward and backward against eager, fp32 and bf16, all mask variants.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window,causal", [(None, False), (256, True)])
def test_flex_matches_eager_forward_and_backward_on_gpu(dtype, tol, window, causal):
    shape = AttentionShape(2, 8, 2, 64, 1024, 64, 16, window=window, causal_in_block=causal, dtype=dtype)
    layout = example_layout(shape, "cuda", seed=7)
    layout.block_valid[1, :4] = False
    layout.doc_ids[0, 600:] = 1
    outs, grads = {}, {}
    for backend in ("flex", "eager"):
        q, k, v = example_inputs(shape, "cuda", requires_grad=True, seed=7)
        mask = build_mask(layout, backend, window=window, causal_in_block=causal)
        out = attention(q, k, v, mask, backend=backend)
        out.float().square().sum().backward()
        outs[backend], grads[backend] = out.detach(), (q.grad, k.grad, v.grad)
    assert rel_err(outs["flex"], outs["eager"]) < tol
    for a, b in zip(grads["flex"], grads["eager"], strict=True):
        assert torch.isfinite(a).all() and rel_err(a, b) < tol
    assert torch.all(outs["flex"][1, :, : 4 * 16] == 0)
    assert torch.all(grads["flex"][0][1, :, : 4 * 16] == 0)

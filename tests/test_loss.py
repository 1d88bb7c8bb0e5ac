"""The weighted block loss: against a naive unchunked reference, D-PACE by hand, and memory evidence."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflashkit.train import loss as loss_mod
from dflashkit.train.loss import LK_ETA, LossMix, decay_weights, dflash_loss, dpace_weights

b, N, B, H, V = 2, 7, 4, 8, 100


def _inputs(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, N * B, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (b, N * B), generator=g)
    mask = torch.rand(b, N * B, generator=g) > 0.3
    mask.view(b, N, B)[:, :, 0] = False  # slot 0 is never trained
    return hidden, weight, labels, mask


def _reference(hidden, weight, labels, mask, weighting, gamma=7.0, alpha=0.5):
    """Naive: full logits at once, weights from explicit loops over slots."""
    logits = (hidden @ weight.T).float()
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(b, N, B)
    m = mask.view(b, N, B).float()
    w = torch.zeros(b, N, B)
    for r in range(b):
        for j in range(N):
            if weighting == "decay":
                for k in range(1, B):
                    w[r, j, k] = math.exp(-(k - 1) / gamma)
            else:
                q = torch.exp(-ce[r, j].detach())
                s = [float((1 - alpha) * q[k] + alpha) if m[r, j, k] else 1.0 for k in range(B)]
                P = [math.prod(s[: k + 1]) for k in range(B)]
                for k in range(B):
                    w[r, j, k] = sum(P[mm] * float(m[r, j, mm]) for mm in range(k, B))
    w = w * m
    return (w * ce).sum() / w.sum(), logits.argmax(-1)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("chunk_blocks", [1, 3, N])
def test_chunked_loss_matches_the_naive_reference(weighting, chunk_blocks):
    hidden, weight, labels, mask = _inputs()
    out = dflash_loss(hidden, weight, labels, mask, B, weighting=weighting, chunk_blocks=chunk_blocks)
    (g_out,) = torch.autograd.grad(out.loss, hidden)
    ref, ref_pred = _reference(hidden, weight, labels, mask, weighting)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(out.loss, ref.to(out.loss.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-4, atol=1e-7)
    assert torch.equal(out.predictions, ref_pred)
    assert torch.allclose(out.loss, out.weighted_sum / out.weight_sum)


def test_gradients_reach_an_unfrozen_head_equally_chunked_or_not():
    hidden, weight, labels, mask = _inputs(1)
    weight.requires_grad_()
    grads = []
    for chunk in (2, N):
        out = dflash_loss(hidden, weight, labels, mask, B, weighting="dpace", chunk_blocks=chunk)
        grads.append(torch.autograd.grad(out.loss, (hidden, weight)))
    for a, c in zip(*grads, strict=True):
        torch.testing.assert_close(a, c)


def test_frozen_head_gets_no_gradient():
    hidden, weight, labels, mask = _inputs(2, dtype=torch.float32)
    dflash_loss(hidden, weight, labels, mask, B, chunk_blocks=2).loss.backward()
    assert weight.grad is None and hidden.grad is not None
    # untrained slots get exactly zero gradient
    assert torch.all(hidden.grad[~mask] == 0) and hidden.grad[mask].abs().sum() > 0


def test_decay_weights_by_hand():
    w = decay_weights(4, gamma=7.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


def test_dpace_weights_by_hand():
    ce = torch.tensor([[5.0, math.log(2), math.log(4), 0.0]])  # q = [., 1/2, 1/4, 1]
    mask = torch.tensor([[False, True, True, True]])
    # s = [1, 0.75, 0.625, 1]; P = [1, 0.75, 0.46875, 0.46875]
    # w_k = sum_{m >= k} P_m mask_m = [1.6875, 1.6875, 0.9375, 0.46875]
    torch.testing.assert_close(
        dpace_weights(ce, mask, alpha=0.5), torch.tensor([[1.6875, 1.6875, 0.9375, 0.46875]])
    )
    # an untrained slot in the middle neither counts nor breaks the chain
    mask = torch.tensor([[False, True, False, True]])
    # s = [1, 0.75, 1, 1]; P = [1, .75, .75, .75]; w = [1.5, 1.5, .75, .75]
    torch.testing.assert_close(dpace_weights(ce, mask, alpha=0.5), torch.tensor([[1.5, 1.5, 0.75, 0.75]]))


def test_empty_mask_gives_zero_loss_and_zero_gradient():
    hidden, weight, labels, _ = _inputs(3)
    out = dflash_loss(hidden, weight, labels, torch.zeros(b, N * B, dtype=torch.bool), B, chunk_blocks=2)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.all(hidden.grad == 0)
    assert out.per_position_count.sum() == 0


def test_per_position_counts_and_ce():
    hidden, weight, labels, mask = _inputs(4)
    out = dflash_loss(hidden, weight, labels, mask, B, chunk_blocks=3)
    hits = ((out.predictions == labels) & mask).view(b, N, B)
    assert out.per_position_correct.tolist() == hits.sum((0, 1)).tolist()
    assert out.per_position_count.tolist() == mask.view(b, N, B).sum((0, 1)).tolist()
    ref_ce = F.cross_entropy((hidden @ weight.T).float().reshape(-1, V), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(out.ce, ref_ce.view(b, -1).detach())
    assert out.ce.dtype == torch.float32 and not out.ce.requires_grad


def test_bf16_head_computes_the_ce_in_fp32():
    hidden, weight, labels, mask = _inputs(5, dtype=torch.float32)
    out = dflash_loss(hidden, weight.bfloat16(), labels, mask, B, chunk_blocks=2)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    ref, _ = _reference(hidden.detach().bfloat16(), weight.bfloat16(), labels, mask, "decay")
    torch.testing.assert_close(out.loss, ref, rtol=1e-3, atol=1e-3)


def test_rejects_bad_arguments():
    hidden, weight, labels, mask = _inputs()
    with pytest.raises(ValueError, match="multiple of block_size"):
        dflash_loss(hidden, weight, labels, mask, 5)
    with pytest.raises(ValueError, match="weighting"):
        dflash_loss(hidden, weight, labels, mask, B, weighting="flat")


# ------------------------------------------------------------------------------------------ memory evidence


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward), ignoring views of `skip`."""

    def __init__(self, skip: torch.Tensor):
        super().__init__()
        self.skip_ptr = skip.untyped_storage().data_ptr()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.skip_ptr:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor(chunk_blocks: int) -> int:
    hidden, weight, labels, mask = _inputs(6, dtype=torch.float32)
    with LargestOutput(weight) as probe:
        out = dflash_loss(hidden, weight, labels, mask, B, weighting="dpace", chunk_blocks=chunk_blocks)
        out.loss.backward()
    return probe.largest


def test_no_op_ever_makes_more_than_one_chunk_of_logits():
    full = b * N * B * V
    assert _largest_tensor(chunk_blocks=2) == b * 2 * B * V  # forward, recompute and backward alike
    assert _largest_tensor(chunk_blocks=N) == full  # the probe does see full logits when they exist


def _saved_for_backward(weight: torch.Tensor, run) -> int:
    """Elements autograd keeps for the backward pass (distinct storages, the head itself excluded)."""
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr != weight.untyped_storage().data_ptr():
            storages[ptr] = max(storages.get(ptr, 0), t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.loss.backward()
    return sum(storages.values())


def test_forward_keeps_no_logits_for_the_backward():
    hidden, weight, labels, mask = _inputs(7, dtype=torch.float32)
    full = b * N * B * V

    def run():
        return dflash_loss(hidden, weight, labels, mask, B, weighting="dpace", chunk_blocks=2)

    kept = _saved_for_backward(weight, run)
    assert kept < full / 4  # hidden slices, labels, weights: no [*, V] tensor
    # Plain autograd through the chunks would keep every chunk's log-softmax alive until the backward.
    plain = lambda h, w, y, th, a, _compiled: loss_mod._chunk_ce(h, w, y, th, a)  # noqa: E731
    with mock.patch.object(loss_mod._FrozenHeadCE, "apply", plain):
        assert _saved_for_backward(weight, run) >= full
    # A trainable head takes the checkpointed path, which keeps no logits either.
    weight.requires_grad_()
    assert _saved_for_backward(weight, run) < full / 4


@pytest.mark.gpu
def test_gpu_peak_memory_stays_below_full_logits():
    dev = torch.device("cuda")
    bb, NN, BB, HH, VV = 1, 512, 16, 1024, 151936  # full fp32 logits: 5.0 GB
    hidden = torch.randn(bb, NN * BB, HH, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(VV, HH, device=dev, dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, VV, (bb, NN * BB), device=dev)
    mask = torch.ones(bb, NN * BB, dtype=torch.bool, device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = dflash_loss(hidden, weight, labels, mask, BB, weighting="dpace", chunk_blocks=8)
    out.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits = bb * NN * BB * VV * 4
    assert peak < full_logits / 4, f"peak {peak / 2**30:.2f} GiB vs full logits {full_logits / 2**30:.2f} GiB"


def _distill_reference(hidden, weight, labels, mask, target_hidden, a, gamma=7.0):
    """Naive distillation: full logits at once, (1 - a) CE + a KL(p_t || p_d) per slot, decay weights."""
    logits = (hidden @ weight.T).reshape(-1, V).double()
    target_logp = (target_hidden @ weight.T).reshape(-1, V).double().log_softmax(-1)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    kl = F.kl_div(logits.log_softmax(-1), target_logp, log_target=True, reduction="none").sum(-1)
    w = decay_weights(B, gamma).double().repeat(N).expand(b, -1) * mask
    per_slot = ((1 - a) * ce + a * kl).view(b, -1)
    return (w * per_slot).sum() / w.sum()


@pytest.mark.parametrize("a", [0.5, 1.0])
@pytest.mark.parametrize("head", ["frozen", "trainable"])
@pytest.mark.parametrize("chunk_blocks", [1, 3, N])
def test_distillation_matches_the_naive_reference(a, head, chunk_blocks):
    """(1 - a) CE + a KL through the frozen head's own gradient, and through autograd for a trainable head."""
    hidden, weight, labels, mask = _inputs()
    target_hidden = torch.randn(b, N * B, H, generator=torch.Generator().manual_seed(3), dtype=hidden.dtype)
    if head == "trainable":
        weight.requires_grad_()
    out = dflash_loss(
        hidden,
        weight,
        labels,
        mask,
        B,
        chunk_blocks=chunk_blocks,
        target_hidden=target_hidden,
        mix=LossMix(ce=1 - a, kl=a),
    )
    (g_out,) = torch.autograd.grad(out.loss, hidden)
    ref = _distill_reference(hidden, weight, labels, mask, target_hidden, a)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out.double(), g_ref, rtol=1e-4, atol=1e-7)
    # the CE reported beside it (metrics, D-PACE) stays the label's
    plain = dflash_loss(hidden, weight, labels, mask, B, chunk_blocks=chunk_blocks)
    torch.testing.assert_close(out.ce, plain.ce)
    assert torch.equal(out.predictions, plain.predictions)
    with torch.no_grad():  # held-out evaluation: the same objective without a gradient
        evaluated = dflash_loss(
            hidden,
            weight,
            labels,
            mask,
            B,
            chunk_blocks=chunk_blocks,
            target_hidden=target_hidden,
            mix=LossMix(ce=1 - a, kl=a),
        )
    torch.testing.assert_close(evaluated.loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_pure_distillation_has_no_gradient_where_the_drafter_is_the_target():
    """distill=1: the objective is KL(p_t || p_d), zero with a zero gradient when the drafter's state is the
    target's, whatever the labels; a label term would still pull (softmax - onehot)."""
    hidden, weight, labels, mask = _inputs()
    same = hidden.detach().clone()
    out = dflash_loss(hidden, weight, labels, mask, B, target_hidden=same, mix=LossMix(ce=0.0, kl=1.0))
    (g,) = torch.autograd.grad(out.loss, hidden)
    assert abs(float(out.loss.detach())) < 1e-6 and float(g.abs().max()) < 1e-6  # the logits are fp32
    half = dflash_loss(hidden, weight, labels, mask, B, target_hidden=same, mix=LossMix(ce=0.5, kl=0.5))
    (g,) = torch.autograd.grad(half.loss, hidden)
    assert float(g.abs().max()) > 1e-3


def test_distillation_needs_the_target_hidden_state():
    hidden, weight, labels, mask = _inputs()
    with pytest.raises(ValueError, match="target_hidden"):
        dflash_loss(hidden, weight, labels, mask, B, mix=LossMix(ce=0.5, kl=0.5))
    # a CE-only mix ignores a target state: the plain loss, bit for bit
    plain = dflash_loss(hidden, weight, labels, mask, B)
    given = dflash_loss(hidden, weight, labels, mask, B, target_hidden=hidden.detach())
    assert torch.equal(plain.loss, given.loss)


@pytest.mark.slow
@pytest.mark.parametrize("a", [0.0, 0.5])
def test_compiled_loss_chunk_matches_the_eager_one(a):
    """train.compile runs each frozen-head chunk as one compiled region: same loss, gradient and argmax,
    distilling or not."""
    hidden, weight, labels, mask = _inputs(dtype=torch.float32)
    target_hidden = torch.randn_like(hidden).detach() if a else None
    outs, grads = {}, {}
    for compiled in (False, True):
        outs[compiled] = dflash_loss(
            hidden,
            weight,
            labels,
            mask,
            B,
            chunk_blocks=3,
            compiled=compiled,
            target_hidden=target_hidden,
            mix=LossMix(ce=1 - a, kl=a),
        )
        (grads[compiled],) = torch.autograd.grad(outs[compiled].loss, hidden)
    torch.testing.assert_close(outs[True].loss, outs[False].loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[True].ce, outs[False].ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-6)
    assert torch.equal(outs[True].predictions, outs[False].predictions)
    assert loss_mod.CHUNK_REGION is not None and loss_mod.CHUNK_REGION.graphs() >= 2  # full and last chunk


MIXES = {
    "ce": LossMix(),
    "kl": LossMix(ce=0.0, kl=1.0),
    "tv": LossMix(ce=0.0, tv=1.0),
    "lk": LossMix(ce=0.0, lk=1.0),
    "ce0.1+tv0.9": LossMix(ce=0.1, tv=0.9),
    "ce0.5+kl0.3+lk0.2": LossMix(ce=0.5, kl=0.3, lk=0.2),
}


def _mix_reference(hidden, weight, labels, mask, target_hidden, mix, weighting, gamma=7.0, alpha=0.5):
    """Naive, in float64: full logits at once, each part written from its definition, autograd's gradient.
    KL(p_T || q_T), TV = 0.5 sum |p_T - q_T|, LK = lambda KL + (1 - lambda) TV with lambda = exp(-3 sg[1 - TV])."""
    logits = (hidden @ weight.T).reshape(-1, V).double()
    t = mix.temperature
    q = (logits / t).softmax(-1)
    p = ((target_hidden @ weight.T).reshape(-1, V).double() / t).softmax(-1)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    kl = (p * (p.log() - q.log())).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    lam = torch.exp(-LK_ETA * (1 - tv.detach()))
    term = mix.ce * ce + mix.kl * kl + mix.tv * tv + mix.lk * (lam * kl + (1 - lam) * tv)
    m = mask.view(b, N, B)
    if weighting == "decay":
        w = decay_weights(B, gamma).double().expand(b, N, B) * m
    else:
        w = dpace_weights(ce.view(b, N, B), m, alpha).double() * m
    w = w.reshape(b, -1)
    return (w * term.view(b, -1)).sum() / w.sum()


@pytest.mark.parametrize("name", list(MIXES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("head", ["frozen", "trainable"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("chunk_blocks", [1, N])
def test_every_loss_and_mix_matches_its_definition_value_and_gradient(
    name, temperature, head, weighting, chunk_blocks
):
    """Each part's value and its gradient with respect to the drafter's state: the frozen head's analytic
    gradient (TV's sign-based one included) and the trainable head's autograd, chunked or not, with the
    slot weights on top, against the naive definition."""
    mix = MIXES[name]._replace(temperature=temperature)
    hidden, weight, labels, mask = _inputs(7)
    # a target near the drafter, as after some training: q - p changes sign within each row
    target_hidden = hidden.detach() + 0.7 * torch.randn(
        b, N * B, H, generator=torch.Generator().manual_seed(8), dtype=hidden.dtype
    )
    if head == "trainable":
        weight.requires_grad_()
    out = dflash_loss(
        hidden,
        weight,
        labels,
        mask,
        B,
        weighting=weighting,
        chunk_blocks=chunk_blocks,
        target_hidden=target_hidden,
        mix=mix,
    )
    (g_out,) = torch.autograd.grad(out.loss, hidden)
    ref = _mix_reference(hidden, weight, labels, mask, target_hidden, mix, weighting)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out.double(), g_ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["tv", "lk", "ce0.1+tv0.9"])
def test_the_frozen_head_path_is_the_autograd_path(name):
    """The same loss and gradient whether the frozen head's own gradient or autograd through checkpointed
    chunks computes it (the trainable-head path, with the head's gradient dropped)."""
    mix = MIXES[name]._replace(temperature=0.8)
    hidden, weight, labels, mask = _inputs(9)
    g = torch.Generator().manual_seed(10)
    target_hidden = hidden.detach() + torch.randn(b, N * B, H, generator=g, dtype=hidden.dtype)
    frozen = dflash_loss(
        hidden, weight, labels, mask, B, chunk_blocks=3, target_hidden=target_hidden, mix=mix
    )
    (g_frozen,) = torch.autograd.grad(frozen.loss, hidden)
    trainable = dflash_loss(
        hidden,
        weight.clone().requires_grad_(),
        labels,
        mask,
        B,
        chunk_blocks=3,
        target_hidden=target_hidden,
        mix=mix,
    )
    (g_auto,) = torch.autograd.grad(trainable.loss, hidden)
    torch.testing.assert_close(frozen.loss, trainable.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_frozen, g_auto, rtol=1e-4, atol=1e-7)  # fp32 logits either way
    torch.testing.assert_close(frozen.ce, trainable.ce)


def test_tv_and_lk_vanish_where_the_drafter_is_the_target():
    """TV(p, p) = 0 at every temperature; a CE part still pulls towards the label."""
    hidden, weight, labels, mask = _inputs()
    same = hidden.detach().clone()
    for mix in (LossMix(ce=0.0, tv=1.0, temperature=0.6), LossMix(ce=0.0, lk=1.0, temperature=1.3)):
        out = dflash_loss(hidden, weight, labels, mask, B, target_hidden=same, mix=mix)
        (g,) = torch.autograd.grad(out.loss, hidden)
        assert abs(float(out.loss.detach())) < 1e-6 and float(g.abs().max()) < 1e-6


def test_a_mix_of_unknown_parts_is_refused():
    with pytest.raises(ValueError, match="unknown loss terms"):
        LossMix.of({"ce": 0.5, "rkl": 0.5})
    assert LossMix.of({"ce": 0.1, "tv": 0.9}, 0.7) == LossMix(ce=0.1, tv=0.9, temperature=0.7)
    assert not LossMix().needs_target and LossMix.of({"lk": 1.0}).needs_target

"""The DFlash training loss: per block slot 1..B-1, a weighted mix of terms through the frozen target lm_head.

Each slot's term is a `LossMix` (train.loss) of

- "ce": -log softmax(z)[label], z = hidden_k @ W^T the drafter's logits, the label the target's argmax (or
  the dataset token): today's DFlash loss;
- "kl": forward KL(p_T || q_T), p_T = softmax(z_target / T) the target's whole distribution for that token
  (its normed last hidden state through the same head) and q_T = softmax(z / T) the drafter's, at the
  training temperature T (train.loss_temperature);
- "tv": total variation TV(p_T, q_T) = 0.5 sum |p_T - q_T|: at serving temperature T, 1 - TV is the chance
  that a token drafted from q_T passes the rejection rule, so TV is the loss of that acceptance;
- "lk": the LK loss (Samarin et al., arXiv 2602.23881), lambda KL + (1 - lambda) TV with
  lambda = exp(-eta sg[alpha]), alpha = 1 - TV the slot's acceptance (no gradient through lambda), eta = 3:
  KL's smooth gradient where the drafter is far from the target, TV's where it is close.

The temperature divides both the target's and the drafter's logits: serving at temperature T drafts from
q_T, so TV(p_T, q_T) is exactly what a round at T loses. CE keeps the raw logits: its label is a point
mass, and its argmax does not depend on T. `train.distill = a` (the older key) is the mix
{ce: 1 - a, kl: a}.

Slot weights on top (train.loss_weighting):

- "decay" (the paper's): w_k = exp(-(k - 1) / gamma); gamma = 7 for B = 16 (5 for B = 10, 4 for B = 8).
- "dpace": weights from the chance of reaching each later slot. q_k = exp(-CE_k) (detached);
  s_k = (1 - alpha) q_k + alpha on trained slots and 1 elsewhere; P_k = prod_{i <= k} s_i;
  w_k = sum_{m >= k} P_m mask_m.

loss = sum(mask * w * term) / sum(mask * w).

Gradients with respect to the drafter's logits z (per slot; u = z / T, q = q_T, p = p_T):
CE: softmax(z) - onehot; KL: (q - p) / T; TV: q (g - <g, q>) / T with g = 0.5 sign(q - p) (d TV / d u);
LK: lambda dKL + (1 - lambda) dTV. A mix adds its terms' gradients with their weights.

Memory and time: full-vocabulary logits for every slot ([b * N * B, V], several GB at the paper's shapes)
never exist at once. The slots are processed in chunks of `chunk_blocks` blocks. With the lm_head frozen (the
normal case), each chunk computes its logits once and, in the same pass, the gradient of each slot's term
with respect to its hidden state, d term / d z @ W, which is [n, H] and independent of the slot weights;
the backward only scales it by d loss / d term. That is two vocabulary-sized matmuls per chunk instead of
the three that activation checkpointing costs (forward, recompute, backward), one more with a distribution
term (the target's logits). With a trainable head, the chunks run under activation checkpointing instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflashkit.config import LOSS_NAMES
from dflashkit.model.acceptance import per_position_counts, slot_acceptance
from dflashkit.runtime.compiled_region import CompiledRegion

Weighting = Literal["decay", "dpace"]

# Auto chunk size: at most this many logits (fp32: 256 MiB) per chunk.
LOGITS_PER_CHUNK = 1 << 26


@dataclass(frozen=True)
class LossOutput:
    """What one loss call returns.

    loss:                 scalar, weighted_sum / weight_sum (differentiable).
    weighted_sum:         scalar, sum(mask * w * CE) (differentiable), for normalising across ranks.
    weight_sum:           scalar, sum(mask * w) (no gradient).
    ce:                   [b, N*B] float32, per-slot cross-entropy (detached).
    predictions:          [b, N*B] long, argmax of the drafter's logits per slot.
    per_position_correct: [B] long, slots with prediction == label among trained ones, per slot index.
    per_position_count:   [B] long, trained slots per slot index.
    """

    loss: Tensor
    weighted_sum: Tensor
    weight_sum: Tensor
    ce: Tensor
    predictions: Tensor
    per_position_correct: Tensor
    per_position_count: Tensor


def decay_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """Slot weights [B]: exp(-(k - 1) / gamma) for k >= 1, and 0 for slot 0."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(ce: Tensor, mask: Tensor, alpha: float) -> Tensor:
    """D-PACE slot weights [..., B] from per-slot CE [..., B] and mask [..., B] (no gradient)."""
    q = torch.exp(-ce.detach().float())
    s = torch.where(mask, (1 - alpha) * q + alpha, torch.ones_like(q))
    reach = torch.cumprod(s, dim=-1)  # P_k
    tail = reach * mask  # P_m * mask_m
    return tail.flip(-1).cumsum(-1).flip(-1)  # w_k = sum_{m >= k}


def slot_logits(hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
    """Logits [..., V] in fp32 for hidden [..., H]: hidden @ W^T in the head's dtype, then upcast for the CE."""
    return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight).float()


class LossMix(NamedTuple):
    """Each slot's term: the weights of its parts (see the module docstring) and the temperature of the
    distribution parts. A plain tuple of floats, so that a compiled chunk guards on its values."""

    ce: float = 1.0
    kl: float = 0.0
    tv: float = 0.0
    lk: float = 0.0
    temperature: float = 1.0

    @classmethod
    def of(cls, weights: Mapping[str, float], temperature: float = 1.0) -> LossMix:
        """A mix from {name: weight} (names of `LOSS_NAMES`; the config validated them)."""
        unknown = sorted(set(weights) - set(LOSS_NAMES))
        if unknown:
            raise ValueError(f"unknown loss terms {unknown}; choose among {', '.join(LOSS_NAMES)}")
        return cls(**{n: float(weights.get(n, 0.0)) for n in LOSS_NAMES}, temperature=float(temperature))

    @property
    def needs_target(self) -> bool:
        """Whether a part needs the target's whole distribution (kl, tv, lk)."""
        return self.kl > 0 or self.tv > 0 or self.lk > 0


CE_LOSS = LossMix()
LK_ETA = 3.0  # lambda = exp(-eta alpha) in the LK loss (the paper's eta)


def distribution_terms(logits: Tensor, target_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """KL(p_T || q_T) and TV(p_T, q_T) per slot, differentiable in ``logits`` [n, V] (autograd's way)."""
    logq = (logits / temperature).log_softmax(-1)
    logp = (target_logits / temperature).log_softmax(-1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (logq.exp() - p).abs().sum(-1)
    return kl, tv


def mix_objective(ce: Tensor, kl: Tensor | None, tv: Tensor | None, mix: LossMix) -> Tensor:
    """Each slot's term from its parts [n] (kl, tv None when the mix has no distribution part)."""
    objective = mix.ce * ce
    if kl is None or tv is None:
        return objective
    lam = torch.exp(-LK_ETA * (1 - tv.detach()))  # LK: lambda = exp(-eta sg[alpha]), alpha = 1 - TV
    return objective + (mix.kl + mix.lk * lam) * kl + (mix.tv + mix.lk * (1 - lam)) * tv


def _chunk_ce(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, target_hidden: Tensor | None, mix: LossMix
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot term, CE and argmax for one chunk (autograd's way: a trainable head, or no gradient):
    hidden [n, H], labels [n] -> ([n] float32, [n] float32, [n] long). ``target_hidden`` [n, H] (the
    target's normed last hidden state per slot) when the mix has a distribution part."""
    logits = slot_logits(hidden, lm_head_weight)
    ce = F.cross_entropy(logits, labels, reduction="none")
    kl = tv = None
    if target_hidden is not None and mix.needs_target:
        target_logits = slot_logits(target_hidden, lm_head_weight).detach()
        kl, tv = distribution_terms(logits, target_logits, mix.temperature)
    return mix_objective(ce, kl, tv, mix), ce.detach(), logits.argmax(-1)


def frozen_head_chunk(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    target_hidden: Tensor | None = None,
    mix: LossMix = CE_LOSS,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk through a frozen head: per-slot term [n], CE [n], argmax [n] and d term/d hidden [n, H]
    (see the module docstring for each part's gradient with respect to the logits). Eager, a CE-only
    chunk holds one fp32 logits buffer (the softmax is taken in place), a distribution part up to four
    (the target's logits, p_T, q_T, and softmax(z) when T != 1); as ``CHUNK_REGION`` (train.compile) the
    softmax, gather and argmax fuse into a few passes over the logits."""
    logits = slot_logits(hidden, weight)  # [n, V] fp32
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(-1, labels[:, None]).squeeze(-1)
    pred = logits.argmax(-1)
    rows = torch.arange(labels.numel(), device=labels.device)
    if target_hidden is None or not mix.needs_target:
        probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place: the logits are not needed again
        probs[rows, labels] -= 1.0  # softmax - onehot
        grad = probs.mul_(mix.ce) if mix.ce != 1.0 else probs
        return mix.ce * ce, ce, pred, (grad.to(weight.dtype) @ weight).to(hidden.dtype)
    t = mix.temperature
    logp = slot_logits(target_hidden, weight).div_(t).log_softmax(-1)
    p = logp.exp()
    logq = (logits / t).log_softmax(-1) if t != 1.0 else logits - lse[:, None]
    kl = torch.einsum("nv,nv->n", p, logp.sub_(logq))  # sum p (log p - log q), in log p's buffer
    q = logq.exp_()
    diff = logp.copy_(q).sub_(p)  # q - p: dKL/du
    tv = 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)
    lam = torch.exp(-LK_ETA * (1 - tv))  # LK's lambda, alpha = 1 - TV
    c_kl = mix.kl + mix.lk * lam  # [n]: each slot's weight of KL and of TV
    c_tv = mix.tv + mix.lk * (1 - lam)
    objective = mix.ce * ce + c_kl * kl + c_tv * tv
    g = p.copy_(diff).sign_().mul_(0.5)  # dTV/dq = 0.5 sign(q - p), in p's buffer
    dtv = g.sub_(torch.einsum("nv,nv->n", g, q)[:, None]).mul_(q)  # q (g - <g, q>): dTV/du
    grad = diff.mul_(c_kl[:, None]).add_(dtv.mul_(c_tv[:, None])).div_(t)  # d/dz = d/du / T
    if mix.ce:
        soft = q.copy_(logits).sub_(lse[:, None]).exp_()  # softmax(z), in q's buffer (q is spent)
        soft[rows, labels] -= 1.0
        grad.add_(soft, alpha=mix.ce)
    return objective, ce, pred, (grad.to(weight.dtype) @ weight).to(hidden.dtype)


CHUNK_REGION = CompiledRegion(frozen_head_chunk, "the compiled loss chunk")


class _FrozenHeadCE(torch.autograd.Function):
    """Per-slot term, CE and argmax of hidden [n, H] through a frozen head W [V, H]; the gradient with
    respect to hidden is computed in the forward pass (see the module docstring) and scaled in the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        target_hidden: Tensor | None,
        mix: LossMix,
        compiled: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        chunk = CHUNK_REGION if compiled else frozen_head_chunk
        objective, ce, pred, dobj_dh = chunk(hidden, weight, labels, target_hidden, mix)
        ctx.save_for_backward(dobj_dh)
        ctx.mark_non_differentiable(ce, pred)
        # A CE-only term of weight 1 is the CE itself: a copy, so the two outputs stay apart.
        return (objective.clone() if objective is ce else objective), ce, pred

    @staticmethod
    def backward(ctx, grad_objective: Tensor, _grad_ce: Tensor, _grad_pred: Tensor):  # type: ignore[override]
        (dobj_dh,) = ctx.saved_tensors
        return dobj_dh * grad_objective[:, None].to(dobj_dh.dtype), None, None, None, None, None


def auto_chunk_blocks(batch: int, block_size: int, vocab: int) -> int:
    """Blocks per chunk so that one chunk's logits hold at most LOGITS_PER_CHUNK values."""
    return max(1, LOGITS_PER_CHUNK // (batch * block_size * vocab))


def chunked_ce(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    block_size: int,
    chunk_blocks: int,
    compiled: bool = False,
    target_hidden: Tensor | None = None,
    mix: LossMix = CE_LOSS,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot term [b, N*B] float32, CE [b, N*B] float32 (detached) and argmax [b, N*B] long,
    computed `chunk_blocks` blocks at a time.

    hidden: [b, N*B, H]; lm_head_weight: [V, H]; labels: [b, N*B] long (in range everywhere).
    target_hidden: [b, N*B, H], the target's normed last hidden state for each slot's token, when ``mix``
    has a distribution part (see `frozen_head_chunk`).
    Neither pass holds more than one chunk's logits (see the module docstring). ``compiled`` runs the
    frozen-head chunk as a compiled region (the trainer's choice on a GPU, train.compile).
    """
    b, q_len, H = hidden.shape
    step = chunk_blocks * block_size
    objectives, ces, preds = [], [], []
    for start in range(0, q_len, step):
        h = hidden[:, start : start + step].reshape(-1, H)
        y = labels[:, start : start + step].reshape(-1)
        th = None if target_hidden is None else target_hidden[:, start : start + step].reshape(-1, H)
        if torch.is_grad_enabled() and hidden.requires_grad and not lm_head_weight.requires_grad:
            objective, ce, pred = _FrozenHeadCE.apply(h, lm_head_weight, y, th, mix, compiled)
        elif torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
            objective, ce, pred = checkpoint(
                _chunk_ce, h, lm_head_weight, y, th, mix, use_reentrant=False, preserve_rng_state=False
            )
        else:
            objective, ce, pred = _chunk_ce(h, lm_head_weight, y, th, mix)
        objectives.append(objective.view(b, -1))
        ces.append(ce.view(b, -1))
        preds.append(pred.view(b, -1))
    return torch.cat(objectives, dim=1), torch.cat(ces, dim=1), torch.cat(preds, dim=1)


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    mask: Tensor,
    block_size: int,
    gamma: float = 7.0,
    weighting: Weighting = "decay",
    dpace_alpha: float = 0.5,
    chunk_blocks: int | None = None,
    compiled: bool = False,
    target_hidden: Tensor | None = None,
    mix: LossMix = CE_LOSS,
) -> LossOutput:
    """The weighted block loss (see the module docstring).

    hidden:         [b, N*B, H], the drafter's output (after its final norm) for every block slot.
    lm_head_weight: [V, H], the frozen target lm_head.
    labels, mask:   [b, N*B] from `block_labels` (slot 0 is never trained).
    chunk_blocks:   blocks per chunk of logits; None picks it from LOGITS_PER_CHUNK.
    compiled:       run each frozen-head chunk as one compiled region (fused softmax/CE/argmax).
    target_hidden:  [b, N*B, H], the target's normed last hidden state for each slot's token: needed
                    when ``mix`` (each slot's term) has a distribution part (kl, tv, lk).
    mix:            the term's parts and their temperature (train.loss, train.loss_temperature).
    """
    b, q_len, _ = hidden.shape
    if q_len % block_size:
        raise ValueError(f"hidden has {q_len} slots, not a multiple of block_size {block_size}")
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"unknown loss weighting {weighting!r}; choose 'decay' or 'dpace'")
    if chunk_blocks is None:
        chunk_blocks = auto_chunk_blocks(b, block_size, lm_head_weight.shape[0])
    if mix.needs_target and target_hidden is None:
        raise ValueError(f"{mix} needs target_hidden, the target's normed last hidden state per slot")
    objective, ce, predictions = chunked_ce(
        hidden,
        lm_head_weight,
        labels,
        block_size,
        chunk_blocks,
        compiled,
        target_hidden if mix.needs_target else None,
        mix,
    )

    mask = mask.bool()
    blocks = (b, q_len // block_size, block_size)
    if weighting == "decay":
        w = decay_weights(block_size, gamma, hidden.device).expand(blocks)
    else:
        w = dpace_weights(ce.view(blocks), mask.reshape(blocks), dpace_alpha)
    w = (w * mask.reshape(blocks)).reshape(b, q_len)
    weighted_sum = (w * objective).sum()
    weight_sum = w.sum()
    loss = weighted_sum / weight_sum.clamp_min(math.ulp(1.0))
    correct, count = per_position_counts(predictions, labels, mask, block_size)
    return LossOutput(loss, weighted_sum, weight_sum, ce, predictions, correct, count)


@torch.no_grad()
def serving_acceptance(
    hidden: Tensor,
    target_hidden: Tensor,
    lm_head_weight: Tensor,
    block_size: int,
    chunk_blocks: int,
    temperature: float,
    proposal: str,
) -> tuple[Tensor, Tensor]:
    """Each slot's acceptance probability at a serving temperature and the target's top probability there
    (`model.acceptance.slot_acceptance`), [b, N*B] float32 each, ``chunk_blocks`` blocks of logits at a time.
    hidden, target_hidden: [b, N*B, H], the drafter's output and the target's normed last hidden state."""
    b, q_len, H = hidden.shape
    step = chunk_blocks * block_size
    accepts, tops = [], []
    for start in range(0, q_len, step):
        h = hidden[:, start : start + step].reshape(-1, H)
        th = target_hidden[:, start : start + step].reshape(-1, H)
        accept, top = slot_acceptance(
            slot_logits(th, lm_head_weight), slot_logits(h, lm_head_weight), temperature, proposal
        )
        accepts.append(accept.view(b, -1))
        tops.append(top.view(b, -1))
    return torch.cat(accepts, dim=1), torch.cat(tops, dim=1)

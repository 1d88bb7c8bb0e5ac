"""The DFlash training loss: cross-entropy through the frozen target lm_head on block slots 1..B-1.

Per slot k of a block, the loss is CE_k = -log softmax(hidden_k @ W^T)[label_k], weighted per slot:

- "decay" (the paper's): w_k = exp(-(k - 1) / gamma); gamma = 7 for B = 16 (5 for B = 10, 4 for B = 8).
- "dpace": weights from the chance of reaching each later slot. q_k = exp(-CE_k) (detached);
  s_k = (1 - alpha) q_k + alpha on trained slots and 1 elsewhere; P_k = prod_{i <= k} s_i;
  w_k = sum_{m >= k} P_m mask_m.

loss = sum(mask * w * CE) / sum(mask * w).

Distillation (train.distill = a > 0): each slot's CE is replaced by (1 - a) CE + a KL(p_t || p_d), p_t the
target's whole distribution for that token (its normed last hidden state through the same head), p_d the
drafter's. The label says which token the target picks; p_t also says how close the others were, what a
sampled round (T > 0) accepts by. Its gradient with respect to the drafter's logits is
softmax - (1 - a) onehot - a p_t: one more vocabulary-sized matmul per chunk (the target's logits).

Memory and time: full-vocabulary logits for every slot ([b * N * B, V], several GB at the paper's shapes)
never exist at once. The slots are processed in chunks of `chunk_blocks` blocks. With the lm_head frozen (the
normal case), each chunk computes its logits once and, in the same pass, the gradient of each slot's CE with
respect to its hidden state, (softmax - onehot) @ W, which is [n, H] and independent of the slot weights; the
backward only scales it by dCE. That is two vocabulary-sized matmuls per chunk instead of the three that
activation checkpointing costs (forward, recompute, backward). With a trainable head, the chunks run under
activation checkpointing instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflashkit.model.acceptance import per_position_counts
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


def _chunk_ce(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, target_hidden: Tensor | None, distill: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot objective, CE and argmax for one chunk (autograd's way: a trainable head, or no gradient):
    hidden [n, H], labels [n] -> ([n] float32, [n] float32, [n] long). The objective is the CE, or with
    ``target_hidden`` [n, H] (the target's normed last hidden state per slot) (1 - distill) CE + distill KL."""
    logits = slot_logits(hidden, lm_head_weight)
    ce = F.cross_entropy(logits, labels, reduction="none")
    objective = ce
    if target_hidden is not None:
        target_logp = slot_logits(target_hidden, lm_head_weight).log_softmax(-1)
        kl = (target_logp.exp() * (target_logp - logits.log_softmax(-1))).sum(-1)
        objective = (1 - distill) * ce + distill * kl
    return objective, ce.detach(), logits.argmax(-1)


def frozen_head_chunk(
    hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None = None, distill: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk through a frozen head: per-slot objective [n], CE [n], argmax [n] and d objective/d hidden
    [n, H] (see the module docstring). Eager, it holds one fp32 logits buffer (the softmax is taken in place),
    two more when it distils; as ``CHUNK_REGION`` (train.compile) the softmax, gather and argmax fuse into a
    few passes over the logits.

    With ``target_hidden`` [n, H] (the target's normed last hidden state, whose logits give the target's
    distribution p_t), the objective is (1 - a) CE + a KL(p_t || p_d) with a = ``distill``, and its
    gradient with respect to the drafter's logits is softmax - (1 - a) onehot - a p_t."""
    logits = slot_logits(hidden, weight)  # [n, V] fp32
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(-1, labels[:, None]).squeeze(-1)
    pred = logits.argmax(-1)
    rows = torch.arange(labels.numel(), device=labels.device)
    if target_hidden is None:
        objective = ce
        probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place: the logits are not needed again
        probs[rows, labels] -= 1.0  # softmax - onehot
    else:
        target_logp = slot_logits(target_hidden, weight).log_softmax(-1)
        target_p = target_logp.exp()
        logp = logits.sub_(lse[:, None])  # log softmax, in place
        kl = (target_p * (target_logp - logp)).sum(-1)
        objective = (1 - distill) * ce + distill * kl
        probs = logp.exp_().sub_(target_p.mul_(distill))  # softmax - a p_t
        probs[rows, labels] -= 1.0 - distill  # ... - (1 - a) onehot
    return objective, ce, pred, (probs.to(weight.dtype) @ weight).to(hidden.dtype)


CHUNK_REGION = CompiledRegion(frozen_head_chunk, "the compiled loss chunk")


class _FrozenHeadCE(torch.autograd.Function):
    """Per-slot objective, CE and argmax of hidden [n, H] through a frozen head W [V, H]; the gradient with
    respect to hidden is computed in the forward pass (see the module docstring) and scaled in the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        target_hidden: Tensor | None,
        distill: float,
        compiled: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        chunk = CHUNK_REGION if compiled else frozen_head_chunk
        objective, ce, pred, dobj_dh = chunk(hidden, weight, labels, target_hidden, distill)
        ctx.save_for_backward(dobj_dh)
        ctx.mark_non_differentiable(ce, pred)
        # The objective of a chunk without distillation is its CE: a copy, so the two outputs stay apart.
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
    distill: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot objective [b, N*B] float32, CE [b, N*B] float32 (detached) and argmax [b, N*B] long,
    computed `chunk_blocks` blocks at a time.

    hidden: [b, N*B, H]; lm_head_weight: [V, H]; labels: [b, N*B] long (in range everywhere).
    target_hidden: [b, N*B, H], the target's normed last hidden state for each slot's token, when the
    objective distils (``distill`` > 0; see `frozen_head_chunk`); else the objective is the CE.
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
            objective, ce, pred = _FrozenHeadCE.apply(h, lm_head_weight, y, th, distill, compiled)
        elif torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
            objective, ce, pred = checkpoint(
                _chunk_ce, h, lm_head_weight, y, th, distill, use_reentrant=False, preserve_rng_state=False
            )
        else:
            objective, ce, pred = _chunk_ce(h, lm_head_weight, y, th, distill)
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
    distill: float = 0.0,
) -> LossOutput:
    """The weighted block cross-entropy (see the module docstring).

    hidden:         [b, N*B, H], the drafter's output (after its final norm) for every block slot.
    lm_head_weight: [V, H], the frozen target lm_head.
    labels, mask:   [b, N*B] from `block_labels` (slot 0 is never trained).
    chunk_blocks:   blocks per chunk of logits; None picks it from LOGITS_PER_CHUNK.
    compiled:       run each frozen-head chunk as one compiled region (fused softmax/CE/argmax).
    target_hidden:  [b, N*B, H], the target's normed last hidden state for each slot's token: with
                    ``distill`` = a > 0 each slot's term is (1 - a) CE + a KL(p_target || p_drafter).
    """
    b, q_len, _ = hidden.shape
    if q_len % block_size:
        raise ValueError(f"hidden has {q_len} slots, not a multiple of block_size {block_size}")
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"unknown loss weighting {weighting!r}; choose 'decay' or 'dpace'")
    if chunk_blocks is None:
        chunk_blocks = auto_chunk_blocks(b, block_size, lm_head_weight.shape[0])
    if distill > 0 and target_hidden is None:
        raise ValueError("distill > 0 needs target_hidden, the target's normed last hidden state per slot")
    objective, ce, predictions = chunked_ce(
        hidden,
        lm_head_weight,
        labels,
        block_size,
        chunk_blocks,
        compiled,
        target_hidden if distill > 0 else None,
        distill,
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

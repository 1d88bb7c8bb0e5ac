"""Acceptance metrics that predict serving: per-position accuracy and the exact block acceptance length.

At serving, a block drafted from anchor a is accepted slot by slot from slot 1 while each draft token equals
the target's token; the first mismatch ends it, and the target adds one bonus token. The acceptance length of
a block is therefore tau = 1 + (number of leading correct slots from slot 1). `acceptance_stats` measures this
exactly on training blocks (a block also stops at its first untrained slot, e.g. past the end of the
response). The "product of marginals" estimate 1 + sum_k prod_{i <= k} acc_i, which assumes slots fail
independently, is reported beside it for comparison; it is not what serving measures.

The mean over anchors is not the served mean either: serving drafts the next block from where the last one
stopped, so it spends more rounds where the drafter is weak. `served_order_walk` replays that order on held-out
rows measured at every anchor; its tokens / rounds is the served-order acceptance length, the one evaluation
reports as the number to expect at serving and the one the best checkpoint is chosen by.

At a serving temperature T > 0 a slot is accepted by chance, and the metric is an expectation, computed
exactly from the two distributions per slot (no sampling noise): `slot_acceptance` gives each slot's
acceptance probability under the proposal and rule, sum_x min(p_T(x), q_T(x)) = 1 - TV(p_T, q_T) for the
marginal proposal (draft x ~ q_T, accept with min(1, p_T(x) / q_T(x))) and p_T(argmax q) for the argmax
proposal (a one-hot q); a block's expected acceptance length is 1 + sum_k prod_{i <= k} a_i
(`expected_block_lengths`), and `served_order_expectation` takes the served-order walk's expectation over
the chance of each round's length. The approximation: the target's distribution at slot k is the one given
the data's tokens before it (the held-out reply, as the T=0 figure reads the target's argmax there), where
serving conditions on the tokens the round accepted (the drafter's argmaxes, or its accepted draws); the
drafter's q does not depend on them (its block holds mask tokens after the anchor). So the figure is exact
where the accepted tokens are the data's, and an estimate elsewhere; on held-out replies sampled from the
target at T it weighs each prefix as serving would meet it.

Stats are sums and counts (long tensors) so that they add across batches (`add_stats`) and ranks
(`train.distributed.reduce_stats`); `finalize_stats` turns a sum into plain numbers. Training measures
them; `dflashkit eval` reads the served-order figure of a trained drafter (`served_tau`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_position_counts(
    predictions: Tensor, labels: Tensor, mask: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Correct and trained slot counts per slot index: [b, N*B] x3 -> ([B] long, [B] long)."""
    b = predictions.shape[0]
    mask = mask.bool().reshape(b, -1, block_size)
    hits = (predictions == labels).reshape(b, -1, block_size) & mask
    return hits.sum((0, 1)), mask.sum((0, 1))


def block_lengths(predictions: Tensor, labels: Tensor, mask: Tensor, block_size: int) -> Tensor:
    """The exact acceptance length of every block: [b, N*B] x3 -> [b, N] long, 1 + correct slots before the
    first miss or the first untrained slot."""
    b = predictions.shape[0]
    hits = ((predictions == labels) & mask.bool()).reshape(b, -1, block_size)[:, :, 1:]
    return 1 + torch.cumprod(hits.long(), dim=-1).sum(-1)


def served_order_walk(anchors: Tensor, lengths: Tensor, valid: Tensor) -> list[int]:
    """The acceptance length of each round serving would make on one row whose every valid anchor has a measured
    block, in order (tokens = their sum, rounds = their count).

    anchors, lengths, valid: [M] (the blocks of `anchors.covering_layouts`, all layouts of the row). Serving
    drafts its first block from the first token of a response, accepts tau tokens and drafts the next block from
    position anchor + tau: it visits the positions where it does poorly more often than those where it does well,
    so its mean tau (tokens / rounds) is below the mean over all anchors, and this walk is what it measures.
    Each response is a run of consecutive valid anchors; a walk starts at the first anchor of each run and ends
    when it steps past the run."""
    tau = {
        int(a): int(n)
        for a, n, v in zip(anchors.tolist(), lengths.tolist(), valid.tolist(), strict=True)
        if v
    }
    rounds = []
    for start in sorted(a for a in tau if a - 1 not in tau):
        p = start
        while p in tau:
            rounds.append(tau[p])
            p += tau[p]
    return rounds


def served_order_expectation(anchors: Tensor, accept: Tensor, valid: Tensor) -> tuple[float, float]:
    """Expected tokens and rounds of the served-order walk on one row when each round's length is random:
    the walk of `served_order_walk`, with the block at anchor a accepting slot k (given slots 1..k-1) with
    probability accept[., k - 1].

    anchors, valid: [M]; accept: [M, B - 1], the acceptance probability of slots 1..B-1 of each block (0 from
    its first untrained slot on). The walk visits anchor a with probability v(a): 1 at the first anchor of
    each response, and v(a + l) += v(a) P(L_a = l) with P(L = l) = prod_{i < l} a_i (1 - a_l). Expected
    tokens = sum_a v(a) E[L_a], expected rounds = sum_a v(a): serving many rows measures tokens / rounds
    of their sums. With probabilities 0 and 1 it is `served_order_walk`."""
    reach = torch.cumprod(accept.double().cpu(), dim=-1)  # [M, B - 1]: P(L >= k + 1), k = 1..B-1
    ones = torch.ones(reach.shape[0], 1, dtype=reach.dtype)
    at_least = torch.cat([ones, reach], dim=-1)  # [M, B]: P(L >= l), l = 1..B
    exactly = at_least - torch.cat([reach, torch.zeros_like(ones)], dim=-1)  # P(L = l), l = 1..B
    row = {int(a): i for i, (a, v) in enumerate(zip(anchors.tolist(), valid.tolist(), strict=True)) if v}
    visit = {a: 1.0 for a in row if a - 1 not in row}
    tokens = rounds = 0.0
    for a in sorted(row):
        v = visit.get(a, 0.0)
        if v == 0.0:
            continue
        i = row[a]
        rounds += v
        tokens += v * float(at_least[i].sum())  # E[L] = sum_l P(L >= l)
        for n, pn in enumerate(exactly[i].tolist(), start=1):
            if pn > 0 and a + n in row:
                visit[a + n] = visit.get(a + n, 0.0) + v * pn
    return tokens, rounds


def slot_acceptance(
    target_logits: Tensor, drafter_logits: Tensor, temperature: float, proposal: str
) -> tuple[Tensor, Tensor]:
    """Each slot's acceptance probability at a serving temperature, and the target's top probability:
    [n, V] x2 -> ([n], [n]) float32. ``proposal`` "marginal": sum_x min(p_T(x), q_T(x)) (a draft from q_T
    through the rejection rule); "argmax": p_T(argmax q) (the drafter's argmax, accepted with p_T of it).
    The second is max_x p_T(x), the argmax chain's per-slot ceiling."""
    if temperature <= 0:
        raise ValueError(f"slot_acceptance is for a temperature above 0, not {temperature}")
    p = (target_logits.float() / temperature).softmax(-1)
    if proposal == "marginal":
        accept = torch.minimum(p, (drafter_logits.float() / temperature).softmax(-1)).sum(-1)
    elif proposal == "argmax":
        accept = p.gather(-1, drafter_logits.argmax(-1, keepdim=True)).squeeze(-1)
    else:
        raise ValueError(f"unknown proposal {proposal!r}; choose 'marginal' or 'argmax'")
    return accept, p.amax(-1)


def block_slot_acceptance(accept: Tensor, mask: Tensor, block_size: int) -> Tensor:
    """Slot acceptance probabilities [b, N*B] and the trained mask [b, N*B] -> [b, N, B - 1] for slots
    1..B-1, 0 from each block's first untrained slot on (a block stops there, as in `block_lengths`)."""
    b = accept.shape[0]
    a = (accept.float() * mask.bool()).reshape(b, -1, block_size)[:, :, 1:]
    return a * torch.cumprod(mask.bool().reshape(b, -1, block_size)[:, :, 1:].long(), dim=-1)


def expected_block_lengths(slot_accept: Tensor) -> Tensor:
    """Expected acceptance length of each block, 1 + sum_k prod_{i <= k} a_i: [..., B - 1] -> [...]."""
    return 1 + torch.cumprod(slot_accept, dim=-1).sum(-1)


def served_tau(val: dict) -> float:
    """The number to expect at serving from an evaluation result: its served-order acceptance length, or,
    in results written before that existed, the mean over anchors."""
    served = val.get("served_acceptance_length")
    return float(served if served is not None else val.get("acceptance_length", float("nan")))


def acceptance_stats(
    predictions: Tensor,
    labels: Tensor,
    mask: Tensor,
    block_valid: Tensor,
    block_size: int,
    lengths: Tensor | None = None,
) -> dict[str, Tensor]:
    """Summable acceptance statistics of one batch.

    predictions, labels, mask: [b, N*B] (mask from `block_labels`); block_valid: [b, N] bool; lengths: their
    `block_lengths` when the caller has them already.
    Returns long tensors:
      per_position_correct [B], per_position_count [B]: per slot index (slot 0 is always 0);
      blocks []: valid blocks; accept_length_sum []: sum of their acceptance lengths;
      accept_length_hist [B + 1]: number of valid blocks per acceptance length (index = length, 1..B).
    """
    correct, count = per_position_counts(predictions, labels, mask, block_size)
    if lengths is None:
        lengths = block_lengths(predictions, labels, mask, block_size)
    lengths = lengths[block_valid.bool()]
    hist = torch.bincount(lengths, minlength=block_size + 1)
    return {
        "per_position_correct": correct,
        "per_position_count": count,
        "blocks": torch.tensor(lengths.numel(), device=predictions.device),
        "accept_length_sum": lengths.sum(),
        "accept_length_hist": hist,
    }


def add_stats(total: dict[str, Tensor] | None, new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum of two stats dicts (`total` may be None for the first batch). Returns a new dict."""
    if total is None:
        return {k: v.clone() for k, v in new.items()}
    return {k: total[k] + new[k] for k in total}


def finalize_stats(stats: dict[str, Tensor]) -> dict[str, float | list[float]]:
    """Plain numbers from summed stats.

    per_position_accuracy: list over slots 1..B-1 (nan where a slot was never trained);
    acceptance_length:     exact mean tau over valid blocks (nan with no blocks);
    marginal_acceptance_length: 1 + sum_k prod_{i <= k} acc_i (the independence estimate);
    accept_length_fraction: list over lengths 1..B, the fraction of blocks that accepted exactly that many.
    """
    correct = stats["per_position_correct"][1:].double()
    count = stats["per_position_count"][1:].double()
    acc = correct / count  # nan where count == 0
    blocks = int(stats["blocks"])
    hist = stats["accept_length_hist"][1:].double()
    return {
        "per_position_accuracy": acc.tolist(),
        "acceptance_length": float(stats["accept_length_sum"]) / blocks if blocks else float("nan"),
        "marginal_acceptance_length": 1.0 + float(torch.cumprod(acc.nan_to_num(0.0), 0).sum()),
        "accept_length_fraction": (hist / blocks).tolist() if blocks else [float("nan")] * hist.numel(),
    }

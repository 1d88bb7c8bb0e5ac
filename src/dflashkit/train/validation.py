"""The held-out measurement a run is judged by (`validate`): a block at every anchor of every validation
row, the exact acceptance length averaged over them, and the served-order acceptance length: the walk
serving makes over those blocks (`model.acceptance.served_order_walk`), which picks the best checkpoint.

At a serving temperature (train.serve_temperature > 0) it also reports the expected acceptance lengths under
train.serve_draft_sampling, exact from the target's and the drafter's distributions at each slot
(`model.acceptance.served_order_expectation`), each slot's acceptance probability, and the target's top
probability per slot (E[max p_T], the argmax chain's ceiling); best/ is then chosen by the served-order
expected figure (`checkpoints.best_metric`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.data.rows import Rows
from dflashkit.model.acceptance import (
    add_stats,
    block_slot_acceptance,
    expected_block_lengths,
    finalize_stats,
    served_order_expectation,
    served_order_walk,
)
from dflashkit.runtime.devices import autocast_context
from dflashkit.train.anchors import covering_layouts
from dflashkit.train.distributed import lockstep_rows, reduce_stats, sum_over_ranks, unwrap
from dflashkit.train.setup import Run
from dflashkit.train.sources import FeatureSource, feature_source
from dflashkit.train.step import StepOutput, block_step


@torch.no_grad()
def blocks_at_every_anchor(
    run: Run, rows: Rows, feats: Tensor, argmax: Tensor, *, skip_empty: bool = True
) -> list[StepOutput]:
    """A block at each valid anchor of `rows` (`covering_layouts`, in passes of the warmed shape [b, N]).
    ``skip_empty=False`` runs every pass, also those without a valid anchor (ranks that must stay in step)."""
    cfg = run.cfg
    B = unwrap(run.drafter).config.block_size
    g = torch.Generator(device="cpu")  # unused: the layouts give the anchors
    return [
        block_step(
            run.drafter,
            run.target,
            rows,
            feats,
            argmax,
            cfg,
            run.backend,
            g,
            autocast_context(cfg, run.device),
            layout=layout,
            serving=True,
        )
        for layout in covering_layouts(rows.loss_mask, rows.doc_ids, cfg.train.num_anchors, B)
        if not skip_empty or bool(layout.block_valid.any())
    ]


def served_rounds(outs: list[StepOutput], row: int = 0) -> list[int]:
    """The rounds serving would make on row ``row`` of `blocks_at_every_anchor`'s blocks (`served_order_walk`)."""
    if not outs:  # no valid anchor in the row
        return []
    anchors, lengths, valid = (
        torch.cat([o.layout.anchors[row] for o in outs]).cpu(),
        torch.cat([o.lengths[row] for o in outs]).cpu(),
        torch.cat([o.layout.block_valid[row] for o in outs]).cpu(),
    )
    return served_order_walk(anchors, lengths, valid)


def served_expectation(outs: list[StepOutput], row: int = 0) -> tuple[float, float]:
    """Expected tokens and rounds of serving row ``row`` at train.serve_temperature
    (`served_order_expectation` over `blocks_at_every_anchor`'s blocks, measured with their acceptance)."""
    if not outs or outs[0].accept is None:  # no valid anchor, or no serving temperature
        return 0.0, 0.0
    B = outs[0].mask.shape[1] // outs[0].lengths.shape[1]
    accept = torch.cat(
        [
            block_slot_acceptance(o.accept[row : row + 1], o.mask[row : row + 1], B)[0]
            for o in outs
            if o.accept is not None
        ]
    )
    anchors = torch.cat([o.layout.anchors[row] for o in outs]).cpu()
    valid = torch.cat([o.layout.block_valid[row] for o in outs]).cpu()
    return served_order_expectation(anchors, accept.cpu(), valid)


def serving_sums(outs: list[StepOutput], block_size: int) -> list[float]:
    """Summable serving-temperature figures of a group's blocks: the sum of valid blocks' expected lengths,
    then per slot 1..B-1 the sums of the acceptance probability and of the target's top probability over
    trained slots (2 B - 1 floats)."""
    sums = [0.0] * (2 * block_size - 1)
    for o in outs:
        if o.accept is None or o.top_probability is None:
            continue
        b = o.mask.shape[0]
        mask = o.mask.bool().reshape(b, -1, block_size)[:, :, 1:]
        expected = expected_block_lengths(block_slot_acceptance(o.accept, o.mask, block_size))
        sums[0] += float(expected[o.layout.block_valid.bool()].sum())
        accept = (o.accept.float().reshape(b, -1, block_size)[:, :, 1:] * mask).sum((0, 1))
        top = (o.top_probability.float().reshape(b, -1, block_size)[:, :, 1:] * mask).sum((0, 1))
        for k in range(block_size - 1):
            sums[1 + k] += float(accept[k])
            sums[block_size + k] += float(top[k])
    return sums


def validate(
    run: Run,
    source: FeatureSource | None = None,
    *,
    max_rows: int | None = None,
    on_row: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Acceptance on the validation rows, measured at every anchor: the mean over all blocks
    (`acceptance_length`) and the served-order acceptance length (`served_acceptance_length`: what serving
    these rows would measure); at train.serve_temperature > 0 also their expectations at that temperature
    (`expected_acceptance_length`, `served_expected_acceptance_length`), `slot_acceptance` and
    `target_top_probability` per slot 1..B-1. Features from ``source`` (None: the run's config decides). Under torchrun the
    rows are dealt over the ranks and the sums reduced: every rank gets the result. ``on_row(done, total)``
    follows the rows this process measures.

    Rows go through in groups of train.batch_size, the training micro-batch's shape (one warmed evaluation
    shape: `eval_groups`); a row that only fills a group (or keeps a rank in step) has its loss mask cleared,
    so it holds no valid anchor and counts nothing."""
    source = source if source is not None else feature_source(run)
    d = run.dist
    drafter = run.drafter
    was_training = drafter.training
    drafter.eval()
    n = len(run.val_rows) if max_rows is None else min(max_rows, len(run.val_rows))
    total: dict[str, Tensor] | None = None
    B = unwrap(drafter).config.block_size
    # loss, loss weight, served tokens, served rounds, expected served tokens, expected served rounds, then
    # `serving_sums`
    sums = [0.0] * (6 + 2 * B - 1)
    groups = eval_groups(lockstep_rows(n, d), run.cfg.train.batch_size)
    done, here = 0, sum(c for group in groups for _, c in group)  # rows this process counts
    for group in groups:
        if on_row is not None:
            on_row(done, here)
        idx = [i for i, _ in group]
        rows = run.val_rows.take(idx, run.device)
        counted = torch.tensor([c for _, c in group], device=run.device)
        rows.loss_mask &= counted[:, None]  # rows that count nothing have no valid anchor
        feats, argmax = source.features("validation", idx, rows)
        outs = blocks_at_every_anchor(run, rows, feats, argmax, skip_empty=not d.parallel)
        for out in outs:
            total = add_stats(total, {k: v.cpu() for k, v in out.stats.items()})
            sums[0] += float(out.loss.weighted_sum)
            sums[1] += float(out.loss.weight_sum)
        for r in range(len(group)):
            rounds = served_rounds(outs, row=r)
            sums[2] += sum(rounds)
            sums[3] += len(rounds)
            tokens, expected_rounds = served_expectation(outs, row=r)
            sums[4] += tokens
            sums[5] += expected_rounds
        for k, v in enumerate(serving_sums(outs, B)):
            sums[6 + k] += v
        done += sum(c for _, c in group)
    if on_row is not None:
        on_row(here, here)
    drafter.train(was_training)
    if total is not None:
        total = reduce_stats(total, d)
    loss_sum, weight_sum, tokens_sum, rounds_sum, e_tokens, e_rounds, *serving = sum_over_ranks(sums, d)
    result: dict[str, Any] = finalize_stats(total) if total is not None else {}
    result["served_acceptance_length"] = tokens_sum / rounds_sum if rounds_sum else float("nan")
    result["loss"] = loss_sum / weight_sum if weight_sum else float("nan")
    result["blocks"] = int(total["blocks"]) if total is not None else 0
    t = run.cfg.train
    if t.serve_temperature > 0:
        nan = float("nan")
        count = total["per_position_count"][1:].tolist() if total is not None else [0] * (B - 1)
        result["serve_temperature"] = t.serve_temperature
        result["serve_draft_sampling"] = t.serve_draft_sampling
        result["served_expected_acceptance_length"] = e_tokens / e_rounds if e_rounds else nan
        result["expected_acceptance_length"] = serving[0] / result["blocks"] if result["blocks"] else nan
        result["slot_acceptance"] = [a / c if c else nan for a, c in zip(serving[1:B], count, strict=True)]
        result["target_top_probability"] = [
            p / c if c else nan for p, c in zip(serving[B:], count, strict=True)
        ]
    return result


def eval_groups(rows: list[tuple[int, bool]], size: int) -> list[list[tuple[int, bool]]]:
    """(row, counted) pairs in groups of ``size``, the last one filled up with its last row, not counted."""
    groups = [rows[k : k + size] for k in range(0, len(rows), size)]
    if groups and len(groups[-1]) < size:
        groups[-1] = groups[-1] + [(groups[-1][-1][0], False)] * (size - len(groups[-1]))
    return groups

"""The held-out measurement a run is judged by (`validate`): a block at every anchor of every validation
row, the exact acceptance length averaged over them, and the served-order acceptance length: the walk
serving makes over those blocks (`model.acceptance.served_order_walk`), which picks the best checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.data.rows import Rows
from dflashkit.model.acceptance import add_stats, finalize_stats, served_order_walk
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


def validate(
    run: Run,
    source: FeatureSource | None = None,
    *,
    max_rows: int | None = None,
    on_row: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Acceptance on the validation rows, measured at every anchor: the mean over all blocks
    (`acceptance_length`) and the served-order acceptance length (`served_acceptance_length`: what serving
    these rows would measure). Features from ``source`` (None: the run's config decides). Under torchrun the
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
    sums = [0.0, 0.0, 0.0, 0.0]  # loss, loss weight, served tokens, served rounds
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
        done += sum(c for _, c in group)
    if on_row is not None:
        on_row(here, here)
    drafter.train(was_training)
    if total is not None:
        total = reduce_stats(total, d)
    loss_sum, weight_sum, tokens_sum, rounds_sum = sum_over_ranks(sums, d)
    result: dict[str, Any] = finalize_stats(total) if total is not None else {}
    result["served_acceptance_length"] = tokens_sum / rounds_sum if rounds_sum else float("nan")
    result["loss"] = loss_sum / weight_sum if weight_sum else float("nan")
    result["blocks"] = int(total["blocks"]) if total is not None else 0
    return result


def eval_groups(rows: list[tuple[int, bool]], size: int) -> list[list[tuple[int, bool]]]:
    """(row, counted) pairs in groups of ``size``, the last one filled up with its last row, not counted."""
    groups = [rows[k : k + size] for k in range(0, len(rows), size)]
    if groups and len(groups[-1]) < size:
        groups[-1] = groups[-1] + [(groups[-1][-1][0], False)] * (size - len(groups[-1]))
    return groups

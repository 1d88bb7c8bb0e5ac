"""Acceptance metrics: exact block acceptance length, histogram, marginals, summing across batches and ranks."""

from __future__ import annotations

import math
import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist

from dflashkit.model.acceptance import acceptance_stats, add_stats, finalize_stats
from dflashkit.train.distributed import all_reduce_stats


def _batch(hits_rows, mask_rows, block_valid):
    """Predictions/labels/mask [1, N*B] from per-block lists of hits (1 = correct) and mask flags."""
    hits = torch.tensor(hits_rows).flatten()[None].bool()
    mask = torch.tensor(mask_rows).flatten()[None].bool()
    labels = torch.arange(hits.shape[1])[None]
    predictions = torch.where(hits, labels, labels + 1000)
    return predictions, labels, mask, torch.tensor([block_valid])


def test_acceptance_length_stops_at_first_miss_or_untrained_slot():
    B = 5
    predictions, labels, mask, valid = _batch(
        hits_rows=[
            [0, 1, 1, 0, 1],  # 2 accepted, then a miss: tau 3 (slot 4's hit does not count)
            [0, 1, 1, 1, 1],  # all accepted: tau 5
            [0, 0, 1, 1, 1],  # slot 1 wrong: tau 1
            [0, 1, 1, 1, 1],  # slot 3 is past the response (untrained): tau 3
            [1, 1, 1, 1, 1],  # padding block: not counted
        ],
        mask_rows=[[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]],
        block_valid=[True, True, True, True, False],
    )
    s = acceptance_stats(predictions, labels, mask, valid, B)
    assert int(s["blocks"]) == 4 and int(s["accept_length_sum"]) == 3 + 5 + 1 + 3
    assert s["accept_length_hist"].tolist() == [0, 1, 0, 2, 0, 1]
    assert s["per_position_count"].tolist() == [0, 4, 4, 3, 3]
    assert s["per_position_correct"].tolist() == [0, 3, 4, 2, 3]
    f = finalize_stats(s)
    assert f["acceptance_length"] == pytest.approx(3.0)
    assert f["per_position_accuracy"] == pytest.approx([3 / 4, 1.0, 2 / 3, 1.0])
    marginal = 1 + 3 / 4 + 3 / 4 + (3 / 4) * (2 / 3) + (3 / 4) * (2 / 3)
    assert f["marginal_acceptance_length"] == pytest.approx(marginal)
    assert f["accept_length_fraction"] == pytest.approx([0.25, 0.0, 0.5, 0.0, 0.25])


def test_exact_length_differs_from_the_product_of_marginals():
    """Correlated errors: half the blocks all right, half all wrong. Per slot accuracy is 1/2 everywhere."""
    B = 4
    predictions, labels, mask, valid = _batch(
        hits_rows=[[0, 1, 1, 1], [0, 0, 0, 0]] * 2, mask_rows=[[0, 1, 1, 1]] * 4, block_valid=[True] * 4
    )
    f = finalize_stats(acceptance_stats(predictions, labels, mask, valid, B))
    assert f["acceptance_length"] == pytest.approx((4 + 1) / 2)
    assert f["marginal_acceptance_length"] == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_stats_add_up_across_batches():
    g = torch.Generator().manual_seed(0)
    b, N, B = 3, 6, 4
    predictions = torch.randint(0, 3, (b, N * B), generator=g)
    labels = torch.randint(0, 3, (b, N * B), generator=g)
    mask = torch.rand(b, N * B, generator=g) > 0.2
    mask.view(b, N, B)[:, :, 0] = False
    valid = torch.rand(b, N, generator=g) > 0.2
    whole = acceptance_stats(predictions, labels, mask, valid, B)
    total = None
    for r in range(b):
        total = add_stats(
            total,
            acceptance_stats(predictions[r : r + 1], labels[r : r + 1], mask[r : r + 1], valid[r : r + 1], B),
        )
    assert total.keys() == whole.keys()
    for k in whole:
        assert torch.equal(total[k], whole[k]), k
    assert all(v.dtype == torch.long for v in whole.values())


def test_finalize_without_blocks_is_nan_not_an_error():
    B = 3
    s = acceptance_stats(
        torch.zeros(1, 6, dtype=torch.long),
        torch.zeros(1, 6, dtype=torch.long),
        torch.zeros(1, 6, dtype=torch.bool),
        torch.zeros(1, 2, dtype=torch.bool),
        B,
    )
    f = finalize_stats(s)
    assert math.isnan(f["acceptance_length"]) and all(math.isnan(x) for x in f["per_position_accuracy"])
    assert f["marginal_acceptance_length"] == 1.0


def test_all_reduce_without_a_process_group_changes_nothing():
    predictions, labels, mask, valid = _batch([[0, 1, 0]], [[0, 1, 1]], [True])
    s = acceptance_stats(predictions, labels, mask, valid, 3)
    before = {k: v.clone() for k, v in s.items()}
    assert all_reduce_stats(s) is s
    assert all(torch.equal(s[k], before[k]) for k in s)


def _random_stats_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, N, B = 2, 5, 4
    predictions = torch.randint(0, 2, (b, N * B), generator=g)
    labels = torch.randint(0, 2, (b, N * B), generator=g)
    mask = torch.rand(b, N * B, generator=g) > 0.2
    return predictions, labels, mask, torch.rand(b, N, generator=g) > 0.2, B


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        stats = all_reduce_stats(acceptance_stats(*_random_stats_batch(rank)))
        torch.save(stats, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_all_reduce_sums_over_two_ranks(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    reduced = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = add_stats(acceptance_stats(*_random_stats_batch(0)), acceptance_stats(*_random_stats_batch(1)))
    for rank in (0, 1):
        for k in want:
            assert torch.equal(reduced[rank][k], want[k]), (rank, k)


def test_served_order_walk_replays_serving():
    """Serving drafts from the first response token, then from anchor + tau: the walk takes exactly those
    blocks, per run of consecutive anchors (one response each), and skips the anchors it jumps over."""
    from dflashkit.model.acceptance import served_order_walk

    anchors = torch.tensor([*range(10, 20), *range(30, 34), 40])
    lengths = torch.tensor([3, 9, 9, 2, 9, 1, 1, 4, 9, 9, 1, 2, 9, 1, 5])
    valid = torch.ones(15, dtype=torch.bool)
    valid[-1] = False  # a padding block is never a place to draft from
    rounds = served_order_walk(anchors, lengths, valid)
    # response 1: 10 (+3) -> 13 (+2) -> 15 (+1) -> 16 (+1) -> 17 (+4) -> 21, past its end
    # response 2: 30 (+1) -> 31 (+2) -> 33 (+1) -> 34, past its end
    assert rounds == [3, 2, 1, 1, 4, 1, 2, 1]
    # the mean over anchors counts the 9s it never serves from: not what serving measures
    assert sum(rounds) / len(rounds) == 15 / 8
    assert lengths[valid].float().mean().item() == pytest.approx(69 / 14)
    assert served_order_walk(anchors[:0], lengths[:0], valid[:0]) == []


def test_served_tau_prefers_the_served_order_and_reads_older_results():
    from dflashkit.model.acceptance import served_tau

    assert served_tau({"acceptance_length": 2.0, "served_acceptance_length": 1.7}) == 1.7
    assert served_tau({"acceptance_length": 2.0}) == 2.0
    assert math.isnan(served_tau({}))

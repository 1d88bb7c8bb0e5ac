"""Acceptance metrics: exact block acceptance length, histogram, marginals, summing across batches and ranks."""

from __future__ import annotations

import json
import math
import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflashkit.model.acceptance import acceptance_stats, add_stats, finalize_stats
from dflashkit.train.distributed import all_reduce_stats
from test_train import TINY


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


def test_the_expected_walk_with_certain_rounds_is_the_walk():
    """Acceptance probabilities of 0 and 1: the expectation is the walk itself, rounds and tokens."""
    from dflashkit.model.acceptance import expected_block_lengths, served_order_expectation, served_order_walk

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        M, B = 30, 5
        anchors = torch.arange(M) + 3 * (torch.arange(M) >= 17)  # two responses
        valid = torch.rand(M, generator=g) > 0.1
        accept = (torch.rand(M, B - 1, generator=g) > 0.4).float()
        lengths = expected_block_lengths(accept).round().long()
        rounds = served_order_walk(anchors, lengths, valid)
        tokens, expected_rounds = served_order_expectation(anchors, accept, valid)
        assert expected_rounds == pytest.approx(len(rounds)) and tokens == pytest.approx(sum(rounds))


def _sampled_rounds(p, q, proposal, walks, g):
    """Monte-Carlo serving of one response whose block at anchor i has per-slot distributions p[i, k], q[i, k]
    ([M, B - 1, V]): every walk starts at anchor 0, drafts each slot (from q, or q's argmax), accepts it by
    the rule (min(1, p(x) / q(x)), or a draw from p equal to the draft) and stops at the first rejection;
    returns (tokens, rounds) summed over the walks and the mean length of a block drafted at anchor 0."""
    M, S, V = p.shape
    pos = torch.zeros(walks, dtype=torch.long)
    tokens = rounds = 0
    first = None
    while bool((pos < M).any()):
        live = pos < M
        i = pos[live]
        length = torch.ones(i.numel(), dtype=torch.long)
        going = torch.ones(i.numel(), dtype=torch.bool)
        for k in range(S):
            if proposal == "marginal":
                x = torch.multinomial(q[i, k], 1, generator=g).squeeze(1)
                ratio = p[i, k].gather(1, x[:, None]).squeeze(1) / q[i, k].gather(1, x[:, None]).squeeze(1)
                ok = torch.rand(i.numel(), generator=g) < ratio.clamp(max=1)
            else:
                y = torch.multinomial(p[i, k], 1, generator=g).squeeze(1)
                ok = y == q[i, k].argmax(-1)
            going &= ok
            length += going.long()
        if first is None:
            first = float(length.float().mean())
        tokens += int(length.sum())
        rounds += i.numel()
        pos[live] = i + length
    return tokens, rounds, first


@pytest.mark.parametrize("proposal", ["marginal", "argmax"])
def test_the_expected_acceptance_length_matches_sampled_rounds(proposal):
    """The exact expectation from the two distributions against rounds sampled by the proposal and its
    rule, on a tiny vocabulary (fixed seed, 20000 walks, loose tolerance)."""
    from dflashkit.model.acceptance import expected_block_lengths, served_order_expectation, slot_acceptance

    g = torch.Generator().manual_seed(1)
    M, B, V, T = 16, 5, 6, 0.8
    target_logits = 2 * torch.randn(M, B - 1, V, generator=g, dtype=torch.float64)
    # every third block drafted far from the target: serving visits those more often than the others
    noise = (0.2 + 3 * (torch.arange(M) % 3 == 0)).double()[:, None, None]
    drafter_logits = target_logits + noise * torch.randn(M, B - 1, V, generator=g, dtype=torch.float64)
    accept, top = slot_acceptance(target_logits, drafter_logits, T, proposal)
    tokens, rounds = served_order_expectation(torch.arange(M), accept, torch.ones(M, dtype=torch.bool))
    p = (target_logits / T).softmax(-1)
    q = (drafter_logits / T).softmax(-1)
    mc_tokens, mc_rounds, mc_first = _sampled_rounds(p, q, proposal, 20000, g)
    assert tokens / rounds == pytest.approx(mc_tokens / mc_rounds, rel=0.01)
    assert float(expected_block_lengths(accept[0])) == pytest.approx(mc_first, rel=0.02)
    # the served order is not the mean over anchors (> 5% apart here), which the tolerance tells apart
    assert float(expected_block_lengths(accept).mean()) > 1.05 * tokens / rounds
    assert 1.3 < tokens / rounds < B - 0.5  # not a trivial case
    assert torch.all(top >= accept - 1e-6) if proposal == "argmax" else torch.all(accept <= 1 + 1e-6)


def test_slot_acceptance_of_each_proposal_by_hand():
    from dflashkit.model.acceptance import slot_acceptance

    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.7, 0.1]])
    accept, top = slot_acceptance(p.log(), q.log(), 1.0, "marginal")
    assert float(accept) == pytest.approx(0.2 + 0.3 + 0.1) and float(top) == pytest.approx(0.5)
    accept, _ = slot_acceptance(p.log(), q.log(), 1.0, "argmax")
    assert float(accept) == pytest.approx(0.3)  # p of q's argmax
    with pytest.raises(ValueError, match="above 0"):
        slot_acceptance(p.log(), q.log(), 0.0, "marginal")


TINY_RUN = TINY  # a few steps on the embedded target in float32, evaluated at steps 3 and 6


DRAFTER_IN_GIT = Path(__file__).resolve().parents[1] / "benchmarks" / "drafters" / "embedded-gpu-more"


def _tiny_run_config(data_dir, out_dir, **over):
    from dflashkit.config import load_config

    values = {**TINY_RUN, "data.dir": str(data_dir), "run.out_dir": str(out_dir), **over}
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


def test_near_zero_temperature_the_expectation_is_the_greedy_measurement(tiny_dataset, tmp_path):
    """At T -> 0 both proposals accept a slot exactly when the drafter's argmax is the target's: the expected
    figures of validation equal its exact greedy ones, per slot and in served order."""
    from dflashkit.config import apply_overrides, load_config
    from dflashkit.train import trainer
    from dflashkit.train.validation import validate

    # the embedded drafter in git (block 16): it gets some slots right and some wrong
    values = {k: v for k, v in TINY_RUN.items() if not k.startswith("drafter.")} | {
        "drafter.init": str(DRAFTER_IN_GIT),
        "data.dir": str(tiny_dataset),
        "run.out_dir": str(tmp_path / "run"),
        "train.serve_temperature": 1e-4,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in values.items()])
    run = trainer.setup_run(cfg)
    for proposal in ("argmax", "marginal"):
        run.cfg = apply_overrides(cfg, {"train.serve_draft_sampling": proposal}, "test")
        val = validate(run, max_rows=3)
        assert val["serve_temperature"] == 1e-4 and val["serve_draft_sampling"] == proposal
        assert val["served_expected_acceptance_length"] == pytest.approx(
            val["served_acceptance_length"], abs=1e-4
        )
        assert val["expected_acceptance_length"] == pytest.approx(val["acceptance_length"], abs=1e-4)
        assert val["slot_acceptance"] == pytest.approx(val["per_position_accuracy"], abs=1e-4)
        assert 0.1 < max(val["per_position_accuracy"]) < 1  # some slots right, some wrong
        assert all(0.99 < p <= 1.0 + 1e-6 for p in val["target_top_probability"])


def test_validation_at_a_serving_temperature_and_best_chosen_by_it(tiny_dataset, tmp_path, monkeypatch):
    """At T = 1 validation reports the expected figures beside the greedy ones, and best/ is the checkpoint
    with the best served-order expected acceptance length, not the best greedy one."""
    from dflashkit.train import trainer

    figures = iter([(2.0, 1.2), (1.0, 1.5)])  # (greedy, expected at T): the two disagree
    seen = []

    def validate(*args, **kwargs):
        val = real_validate(*args, **kwargs)
        seen.append(dict(val))
        greedy, expected = next(figures)
        return val | {"served_acceptance_length": greedy, "served_expected_acceptance_length": expected}

    real_validate = trainer.validate
    monkeypatch.setattr(trainer, "validate", validate)
    over = {
        "train.serve_temperature": 1.0,
        "train.max_steps": 2,
        "train.eval_every": 1,
        "train.save_every": 2,
    }
    cfg = _tiny_run_config(tiny_dataset, tmp_path / "t1", **over)
    result = trainer.train(cfg, console=_quiet())
    best = json.loads((result.out_dir / "best" / "metrics.json").read_text())
    assert best["step"] == 2 and result.best_served_acceptance_length == 1.5  # greedily, step 1 was better
    val = seen[-1]
    B = 4
    assert (
        1.0 <= val["served_expected_acceptance_length"] <= B and 1.0 <= val["expected_acceptance_length"] <= B
    )
    assert len(val["slot_acceptance"]) == len(val["target_top_probability"]) == B - 1
    assert all(0.0 < a < 1.0 for a in val["slot_acceptance"])
    assert all(0.0 < p <= 1.0 for p in val["target_top_probability"])

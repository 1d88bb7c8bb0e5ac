"""Anchors, block inputs/positions/labels and sequence packing."""

from __future__ import annotations

import random

import pytest
import torch

from dflashkit.attention.masks import BlockLayout, dense_mask
from dflashkit.data.rows import pack_sequences
from dflashkit.train.anchors import (
    block_inputs,
    block_labels,
    block_positions,
    covering_layouts,
    sample_anchors,
    valid_anchor_positions,
)

MASK = 99


def _layout(anchors, valid, doc_ids, B):
    return BlockLayout(
        anchors=torch.tensor(anchors),
        block_valid=torch.tensor(valid),
        doc_ids=torch.tensor(doc_ids),
        block_size=B,
    )


# ----------------------------------------------------------------------------------------------- the rule


def test_valid_anchor_rule_by_hand():
    # positions:          0  1  2  3  4  5  6  7  8  9
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]]).bool()
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, -1, -1]])
    # 1,2: a and a+1 supervised, same doc.  3: a+1 unsupervised.  5: a+1 in another document.
    # 6: ok.  7: a+1 is padding.  8: padding.  9: last position (no a+1).
    got = valid_anchor_positions(loss, docs)[0].nonzero().flatten().tolist()
    assert got == [1, 2, 6]


def test_valid_anchor_rule_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(4, 40, generator=g) > 0.3
    docs = torch.cumsum(torch.rand(4, 40, generator=g) > 0.85, dim=1)
    docs[:, 33:] = -1
    got = valid_anchor_positions(loss, docs)
    for r in range(4):
        for a in range(40):
            want = a + 1 < 40 and bool(loss[r, a] and loss[r, a + 1]) and docs[r, a] == docs[r, a + 1] >= 0
            assert bool(got[r, a]) == want, (r, a)


# --------------------------------------------------------------------------------------------- sampling


def _random_batch(seed: int, b: int = 3, T: int = 64):
    g = torch.Generator().manual_seed(seed)
    loss = torch.rand(b, T, generator=g) > 0.25
    docs = torch.cumsum(torch.rand(b, T, generator=g) > 0.9, dim=1)
    docs[:, T - 5 :] = -1
    return loss, docs


def test_anchors_are_sorted_distinct_and_valid():
    loss, docs = _random_batch(1)
    valid = valid_anchor_positions(loss, docs)
    lay = sample_anchors(loss, docs, num_anchors=8, block_size=4, generator=torch.Generator().manual_seed(3))
    assert lay.anchors.shape == (3, 8) and lay.block_valid.shape == (3, 8) and lay.block_size == 4
    assert lay.doc_ids is docs
    for r in range(3):
        a = lay.anchors[r][lay.block_valid[r]]
        assert a.numel() == min(8, int(valid[r].sum()))
        assert torch.all(a[1:] > a[:-1])  # sorted and distinct
        assert valid[r, a].all()
    assert torch.all(lay.anchors[:, 1:] >= lay.anchors[:, :-1])


def test_short_rows_get_padding_blocks_last_and_in_range():
    loss = torch.zeros(3, 10, dtype=torch.bool)
    loss[0, 2:5] = True  # valid anchors 2, 3
    loss[2, :] = True  # 9 valid anchors (0..8)
    docs = torch.zeros(3, 10, dtype=torch.long)
    lay = sample_anchors(loss, docs, num_anchors=5, block_size=4, generator=torch.Generator().manual_seed(0))
    assert lay.anchors[0].tolist() == [2, 3, 9, 9, 9]
    assert lay.block_valid[0].tolist() == [True, True, False, False, False]
    assert not lay.block_valid[1].any() and lay.anchors[1].eq(9).all()  # no valid position at all
    assert lay.block_valid[2].all()
    # more anchors asked for than positions in the row
    lay = sample_anchors(loss, docs, num_anchors=14, block_size=4, generator=torch.Generator().manual_seed(0))
    assert lay.anchors.shape == (3, 14) and int(lay.block_valid[2].sum()) == 9
    assert lay.anchors.max() <= 9


def test_sampling_is_deterministic_given_the_generator_and_redrawn_each_call():
    loss, docs = _random_batch(2)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first = sample_anchors(loss, docs, 6, 4, generator=g1)
    assert torch.equal(first.anchors, sample_anchors(loss, docs, 6, 4, generator=g2).anchors)
    second = sample_anchors(loss, docs, 6, 4, generator=g1)
    assert not torch.equal(first.anchors, second.anchors)


def test_sampling_is_uniform_over_valid_positions():
    rows, T, N = 4000, 16, 3
    loss = torch.zeros(rows, T, dtype=torch.bool)
    loss[:, 2:14] = True  # valid anchors 2..12 (13 needs 14 supervised)
    docs = torch.zeros(rows, T, dtype=torch.long)
    lay = sample_anchors(loss, docs, N, 4, generator=torch.Generator().manual_seed(11))
    assert lay.block_valid.all()
    counts = torch.bincount(lay.anchors.flatten(), minlength=T).float()
    assert counts[:2].sum() == 0 and counts[13:].sum() == 0
    expected = rows * N / 11
    assert torch.all((counts[2:13] - expected).abs() < 0.1 * expected), counts


# ------------------------------------------------------------------------------------ inputs and positions


def test_block_inputs_and_positions():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    lay = _layout([[1, 5, 7]], [[True, True, False]], [[0] * 8], 3)
    assert block_inputs(input_ids, lay, MASK).tolist() == [[11, MASK, MASK, 15, MASK, MASK, MASK, MASK, MASK]]
    # packed row: two documents with their own positions
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    assert block_positions(position_ids, lay).tolist() == [[1, 2, 3, 1, 2, 3, 3, 4, 5]]


# --------------------------------------------------------------------------------------------------- labels


def _labels_by_loop(lay, target_argmax, input_ids, loss_mask, use_dataset_tokens):
    b, T = input_ids.shape
    B = lay.block_size
    labels = torch.zeros(b, lay.q_len, dtype=torch.long)
    mask = torch.zeros(b, lay.q_len, dtype=torch.bool)
    for r in range(b):
        for j in range(lay.num_blocks):
            a = int(lay.anchors[r, j])
            for k in range(1, B):
                p = a + k
                if not lay.block_valid[r, j] or p >= T or not loss_mask[r, p]:
                    continue
                if lay.doc_ids[r, p] != lay.doc_ids[r, a]:
                    continue
                mask[r, j * B + k] = True
                labels[r, j * B + k] = input_ids[r, p] if use_dataset_tokens else target_argmax[r, p - 1]
    return labels, mask


def test_slot_k_learns_position_anchor_plus_k():
    """Regression: the label of slot k is the token at anchor + k (once shifted to anchor + k + 1)."""
    input_ids = torch.arange(100, 112)[None]
    loss = torch.ones(1, 12, dtype=torch.bool)
    lay = _layout([[2]], [[True]], [[0] * 12], 4)
    labels, mask = block_labels(lay, torch.zeros_like(input_ids), input_ids, loss, use_dataset_tokens=True)
    assert labels.tolist() == [[0, 103, 104, 105]]  # slot k -> input_ids[2 + k]; slot 0 untrained
    assert mask.tolist() == [[False, True, True, True]]
    # A perfect target predicts input_ids[p + 1] at p, so its labels are the same tokens.
    perfect = torch.roll(input_ids, -1, dims=1)
    assert torch.equal(block_labels(lay, perfect, input_ids, loss)[0], labels)
    # With distinct target predictions, slot k reads target_argmax[anchor + k - 1].
    target_argmax = torch.arange(500, 512)[None]
    assert block_labels(lay, target_argmax, input_ids, loss)[0].tolist() == [[0, 502, 503, 504]]


def test_label_mask_edges():
    # positions 0..9; doc 0 = 0..5, doc 1 = 6..7, padding 8..9; position 3 unsupervised
    docs = [[0, 0, 0, 0, 0, 0, 1, 1, -1, -1]]
    loss = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1, 0, 0]]).bool()
    input_ids = torch.arange(10)[None]
    lay = _layout([[1, 4, 6, 9]], [[True, True, True, False]], docs, 4)
    labels, mask = block_labels(lay, input_ids, input_ids, loss, use_dataset_tokens=True)
    assert mask.view(4, 4).tolist() == [
        [False, True, False, True],  # anchor 1: pos 2 ok, pos 3 unsupervised, pos 4 ok
        [False, True, False, False],  # anchor 4: pos 5 ok, 6 and 7 are another document
        [False, True, False, False],  # anchor 6: pos 7 ok, 8 padding, 9 padding
        [False, False, False, False],  # padding block (and past the end of the row)
    ]
    assert labels.view(4, 4)[0].tolist() == [0, 2, 0, 4]


@pytest.mark.parametrize("use_dataset_tokens", [False, True])
def test_block_labels_match_a_loop(use_dataset_tokens):
    loss, docs = _random_batch(5, b=2, T=48)
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 1000, (2, 48), generator=g)
    target_argmax = torch.randint(0, 1000, (2, 48), generator=g)
    lay = sample_anchors(loss, docs, 12, 5, generator=g)
    got = block_labels(lay, target_argmax, input_ids, loss, use_dataset_tokens)
    want = _labels_by_loop(lay, target_argmax, input_ids, loss, use_dataset_tokens)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_no_trained_label_is_visible_as_context():
    """Every trained slot's position lies at or after its anchor, which the block's context never includes."""
    loss, docs = _random_batch(8, b=2, T=40)
    lay = sample_anchors(loss, docs, 10, 4, generator=torch.Generator().manual_seed(8))
    _, mask = block_labels(
        lay, torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long), loss
    )
    ctx = dense_mask(lay)[:, 0, :, : lay.context_len]  # [b, N*B, T]
    pos = (lay.anchors[:, :, None] + torch.arange(4)).reshape(2, -1)
    for r in range(2):
        for q in mask[r].nonzero().flatten().tolist():
            seen = ctx[r, q].nonzero().flatten()
            assert seen.numel() == 0 or int(seen.max()) < int(pos[r, q]) - (q % 4)


# -------------------------------------------------------------------------------------------------- packing


def test_pack_sequences_first_fit_with_docs_positions_and_truncation():
    recs = [
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [6, 7, 8, 9], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [10, 11], "loss_mask": [1, 1]},
        {"input_ids": list(range(20, 30)), "loss_mask": [1] * 10},  # longer than max_len: truncated
        {"input_ids": torch.tensor([40]), "loss_mask": torch.tensor([True])},
    ]
    ids, loss, docs, pos = pack_sequences(recs, max_len=8, pad_token_id=0)
    assert ids.tolist() == [
        [1, 2, 3, 4, 5, 10, 11, 40],
        [6, 7, 8, 9, 0, 0, 0, 0],
        [20, 21, 22, 23, 24, 25, 26, 27],
    ]
    assert docs.tolist() == [[0, 0, 0, 0, 0, 2, 2, 4], [1, 1, 1, 1, -1, -1, -1, -1], [3] * 8]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0], [0, 1, 2, 3, 0, 0, 0, 0], list(range(8))]
    assert loss.int().tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0], [1] * 8]
    assert ids.dtype == docs.dtype == pos.dtype == torch.long and loss.dtype == torch.bool


def test_pack_sequences_places_every_record_in_the_first_row_with_room():
    """The max-tree's choice equals scanning every row (the definition of first fit), on random records
    (empty ones and ones longer than a row among them)."""
    rng = random.Random(0)
    for max_len in (4, 16, 64):
        records = [rng.randint(0, 2 * max_len) for _ in range(400)]
        recs = [{"input_ids": [7] * n, "loss_mask": [1] * n} for n in records]
        docs = pack_sequences(recs, max_len=max_len)[2]
        free: list[int] = []
        expected: list[list[int]] = []
        for i, n in enumerate(min(n, max_len) for n in records):
            row = next((r for r, room in enumerate(free) if room >= n), None)
            if row is None:
                free.append(max_len)
                expected.append([])
                row = len(free) - 1
            free[row] -= n
            expected[row].extend([i] * n)
        assert [[d for d in row if d >= 0] for row in docs.tolist()] == expected


def test_pack_sequences_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="record 0"):
        pack_sequences([{"input_ids": [1, 2], "loss_mask": [1]}], max_len=4)


def test_packed_rows_feed_the_sampler():
    recs = [{"input_ids": list(range(n)), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in (9, 5, 7, 12)]
    ids, loss, docs, pos = pack_sequences(recs, max_len=16)
    lay = sample_anchors(loss, docs, 6, 4, generator=torch.Generator().manual_seed(0))
    a = lay.anchors[lay.block_valid]
    rows = lay.block_valid.nonzero()[:, 0]
    # every anchor and its next position are supervised and in one document
    assert loss[rows, a].all() and loss[rows, a + 1].all() and torch.equal(docs[rows, a], docs[rows, a + 1])
    assert block_positions(pos, lay).shape == (ids.shape[0], 24)


def test_covering_layouts_hold_every_valid_anchor_once_in_a_fixed_number_of_passes():
    T, N, B = 23, 4, 3
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[0, 3:9] = True  # row 0: a 6-token response (5 anchors) ...
    loss_mask[0, 12:20] = True  # ... and an 8-token one (7 anchors)
    doc_ids = torch.zeros(2, T, dtype=torch.long)
    doc_ids[0, 10:] = 1  # row 0: two documents
    doc_ids[1, 15:] = -1  # row 1: padding after 15; no response at all
    layouts = covering_layouts(loss_mask, doc_ids, N, B)
    assert len(layouts) == -(-T // N)  # fixed by T and N alone, whatever the rows hold
    valid = valid_anchor_positions(loss_mask, doc_ids)
    for r in range(2):
        got = torch.cat([lay.anchors[r][lay.block_valid[r]] for lay in layouts])
        assert got.tolist() == valid[r].nonzero().flatten().tolist()
    assert all(lay.anchors.shape == (2, N) and lay.block_size == B for lay in layouts)
    assert not any(lay.block_valid[1].any() for lay in layouts)
    assert all(int(lay.anchors.max()) <= T - 1 for lay in layouts)
    with pytest.raises(ValueError):
        covering_layouts(loss_mask, doc_ids, 0, B)

"""The DFlash training mask: dense reference vs mask_mod vs a brute-force loop, the two historical bugs,
and the tile-level BlockMask vs create_block_mask (plus its memory at the paper's shapes)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflashkit.attention.block_mask import document_starts, flex_block_mask, tile_masks
from dflashkit.attention.masks import BlockLayout, dense_mask, dflash_mask_mod
from dflashkit.attention.memory import peak_memory

VARIANTS = [(None, False), (None, True), (40, False), (40, True), (7, False), (3, True), (2, False)]


def brute_force_mask(layout: BlockLayout, window=None, causal_in_block=False) -> torch.Tensor:
    """The rule written as plainly as possible, one (query, key) pair at a time."""
    Bs, S, N = layout.block_size, layout.context_len, layout.num_blocks
    out = torch.zeros(layout.batch, 1, N * Bs, S + N * Bs, dtype=torch.bool)
    for b in range(layout.batch):
        docs = layout.doc_ids[b].tolist()
        for j in range(N):
            if not layout.block_valid[b, j]:
                continue
            a = int(layout.anchors[b, j])
            for k in range(Bs):
                q = j * Bs + k
                for s in range(S):
                    same_doc = docs[s] == docs[a] and docs[s] >= 0
                    in_window = window is None or (a + k) - s < window
                    out[b, 0, q, s] = s < a and same_doc and in_window
                for k2 in range(Bs):
                    in_window = window is None or k - k2 < window  # slot k2 is at position a + k2
                    out[b, 0, q, S + j * Bs + k2] = (k2 <= k or not causal_in_block) and in_window
    return out


def random_layout(g, batch, S, N, Bs, *, close=False, docs=3, pad=True, noncontiguous=False) -> BlockLayout:
    doc_ids = torch.empty(batch, S, dtype=torch.long)
    for b in range(batch):
        cuts = sorted(torch.randint(1, S, (docs - 1,), generator=g).tolist())
        bounds = [0, *cuts, S]
        for d in range(docs):
            doc_ids[b, bounds[d] : bounds[d + 1]] = d
        if pad:
            doc_ids[b, S - int(torch.randint(0, S // 4 + 1, (1,), generator=g)) :] = -1
        if noncontiguous:
            doc_ids[b] = torch.randint(-1, docs, (S,), generator=g)
    if close:  # runs of anchors closer than B apart, overlapping blocks
        start = torch.randint(0, max(S - 3 * N, 1), (batch, 1), generator=g)
        steps = torch.randint(0, 3, (batch, N), generator=g)
        anchors = (start + steps.cumsum(dim=1)).clamp(max=S - 1)
    else:
        anchors = torch.randint(0, S, (batch, N), generator=g).sort(dim=1).values
    valid = torch.rand(batch, N, generator=g) > 0.2
    return BlockLayout(anchors, valid, doc_ids, Bs)


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("window,causal", VARIANTS)
def test_dense_reference_and_mask_mod_match_brute_force(close, window, causal):
    g = torch.Generator().manual_seed(7 + close)
    for _ in range(3):
        layout = random_layout(g, 2, 37, 5, 4, close=close)
        want = brute_force_mask(layout, window, causal)
        assert torch.equal(dense_mask(layout, window, causal), want)
        mm = dflash_mask_mod(layout, window=window, causal_in_block=causal)
        got = create_mask(mm, layout.batch, None, layout.q_len, layout.kv_len, device="cpu")
        assert torch.equal(got, want)


def test_context_is_strictly_before_the_anchor():
    """Regression: context had been visible up to and including the anchor (it must be < anchor)."""
    layout = BlockLayout(
        anchors=torch.tensor([[5, 9]]),
        block_valid=torch.ones(1, 2, dtype=torch.bool),
        doc_ids=torch.zeros(1, 12, dtype=torch.long),
        block_size=4,
    )
    m = dense_mask(layout)[0, 0]
    for j, a in enumerate((5, 9)):
        rows = m[j * 4 : (j + 1) * 4]
        assert rows[:, :a].all()  # everything before the anchor
        assert not rows[:, a:12].any()  # not the anchor itself (its token is slot 0), nothing after


def test_close_anchors_do_not_leak_future_context():
    """Regression: visibility keyed on block index leaked context when anchors were closer than B.
    Every visible key must sit before the query's anchor or in the query's own block."""
    Bs, S = 8, 40
    layout = BlockLayout(
        anchors=torch.tensor([[20, 21, 23, 24]]),  # 1-3 apart, B = 8: blocks overlap in position
        block_valid=torch.ones(1, 4, dtype=torch.bool),
        doc_ids=torch.zeros(1, S, dtype=torch.long),
        block_size=Bs,
    )
    for m in (
        dense_mask(layout)[0, 0],
        create_mask(dflash_mask_mod(layout), 1, None, 32, S + 32, "cpu")[0, 0],
    ):
        for q, kv in m.nonzero().tolist():
            j, a = q // Bs, int(layout.anchors[0, q // Bs])
            if kv < S:
                assert kv < a, (q, kv)
            else:
                assert (kv - S) // Bs == j, (q, kv)
        # Each block sees exactly the context before its own anchor, however close the next one is.
        assert m[:, :S].sum(dim=1).view(4, Bs)[:, 0].tolist() == [20, 21, 23, 24]


def test_documents_padding_and_invalid_blocks():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1, -1, -1]])
    layout = BlockLayout(
        anchors=torch.tensor([[2, 5, 8, 4]]),
        block_valid=torch.tensor([[True, True, True, False]]),
        doc_ids=docs,
        block_size=2,
    )
    m = dense_mask(layout)[0, 0]
    S = 10
    assert m[0:2, :S].nonzero()[:, 1].unique().tolist() == [0, 1]  # doc 0 before anchor 2
    assert m[2:4, :S].nonzero()[:, 1].unique().tolist() == [3, 4]  # doc 1 only: not doc 0
    assert not m[4:6, :S].any()  # anchor in padding: no context
    assert m[4:6, S + 4 : S + 6].all()  # ...but its own block (bidirectional)
    assert not m[6:8].any()  # invalid block sees nothing
    assert not m[:, 7:S].any()  # padding is never visible
    assert not m[0:2, S + 2 :].any() and not m[2:4, S : S + 2].any()  # no other block


def test_sliding_window_is_measured_from_the_query_position():
    layout = BlockLayout(
        anchors=torch.tensor([[30]]),
        block_valid=torch.ones(1, 1, dtype=torch.bool),
        doc_ids=torch.zeros(1, 40, dtype=torch.long),
        block_size=4,
    )
    m = dense_mask(layout, window=10)[0, 0]
    for k in range(4):  # query position 30 + k sees context (30 + k - 10, 30)
        assert m[k, :40].nonzero()[:, 0].tolist() == list(range(21 + k, 30))
    assert m[:, 40:].all()  # bidirectional inside the block by default
    causal = dense_mask(layout, window=10, causal_in_block=True)[0, 0, :, 40:]
    assert torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).tril())


def test_document_starts():
    docs = torch.tensor([[3, 3, 1, 1, 1, -1, 3, 3, 2]])
    run_start, first = document_starts(docs)
    assert run_start.tolist() == [[0, 0, 2, 2, 2, 5, 6, 6, 8]]
    assert first.tolist() == [[0, 0, 2, 2, 2, 5, 0, 0, 8]]


BLOCK_MASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _assert_same_block_mask(ours, ref):
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in BLOCK_MASK_FIELDS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize(
    "S,N,Bs,close", [(300, 24, 16, False), (256, 16, 16, True), (333, 40, 5, True), (640, 96, 8, False)]
)
@pytest.mark.parametrize("window,causal", [(None, False), (100, True), (200, False), (5, True)])
def test_tile_block_mask_equals_create_block_mask(S, N, Bs, close, window, causal):
    g = torch.Generator().manual_seed(S + N)
    layout = random_layout(g, 2, S, N, Bs, close=close)
    ref = create_block_mask(
        dflash_mask_mod(layout, window=window, causal_in_block=causal),
        2,
        None,
        layout.q_len,
        layout.kv_len,
        "cpu",
    )
    _assert_same_block_mask(flex_block_mask(layout, window=window, causal_in_block=causal), ref)


def test_tile_block_mask_has_full_tiles_for_one_long_document():
    g = torch.Generator().manual_seed(3)
    S, N, Bs = 1024, 128, 16
    anchors = torch.randperm(S - Bs, generator=g)[:N].sort().values[None]
    layout = BlockLayout(anchors, torch.ones(1, N, dtype=torch.bool), torch.zeros(1, S, dtype=torch.long), Bs)
    ours = flex_block_mask(layout)
    _assert_same_block_mask(
        ours, create_block_mask(dflash_mask_mod(layout), 1, None, layout.q_len, layout.kv_len, "cpu")
    )
    assert ours.full_kv_num_blocks.sum() > 0  # full tiles skip the mask_mod in the kernel


def test_tile_block_mask_is_safe_for_noncontiguous_documents():
    """Doc ids that come back later in the row: tiles may be listed as partial needlessly (the mask_mod
    decides), but never missed and never wrongly full."""
    g = torch.Generator().manual_seed(11)
    layout = random_layout(g, 2, 500, 30, 16, noncontiguous=True)
    partial, full = tile_masks(layout)
    ref = create_block_mask(dflash_mask_mod(layout), 2, None, layout.q_len, layout.kv_len, "cpu")
    dense = ref.to_dense()[:, 0].bool()  # every listed tile
    ref_full = create_block_mask(
        dflash_mask_mod(layout), 2, None, layout.q_len, layout.kv_len, "cpu", separate_full_blocks=True
    )
    from torch.nn.attention.flex_attention import _ordered_to_dense

    rf = _ordered_to_dense(ref_full.full_kv_num_blocks, ref_full.full_kv_indices, dense.shape[-1])[
        :, 0
    ].bool()
    assert not (dense & ~(partial | full)).any()  # nothing missed
    assert not (full & ~rf).any()  # full only where truly full


def test_tile_block_mask_memory_stays_linear():
    """S=3072/N=512/B=16 and S=16384/N=1024/B=16: the tile maps cost megabytes where the dense
    [Q, KV] mask would be 92 MB and 537 MB."""
    g = torch.Generator().manual_seed(0)
    peaks = {}
    for S, N in ((3072, 512), (16384, 1024)):
        anchors = torch.randint(0, S - 16, (1, N), generator=g).sort(dim=1).values
        layout = BlockLayout(
            anchors, torch.ones(1, N, dtype=torch.bool), torch.zeros(1, S, dtype=torch.long), 16
        )
        bm, peak = peak_memory(lambda layout=layout: flex_block_mask(layout), "cpu")
        assert bm.kv_indices.shape == (1, 1, layout.q_len // 128, -(-layout.kv_len // 128))
        dense_bytes = layout.q_len * layout.kv_len
        if peak is not None:
            assert peak < dense_bytes / 16, (S, peak, dense_bytes)
        peaks[S] = peak
    if peaks[3072] is not None:
        assert peaks[16384] < 64 * 2**20

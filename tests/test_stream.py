"""The micro-batch stream: the one data order of training and the fan-out."""

import pytest

from dflashkit.data.stream import MicroBatchStream, anchor_seed, epoch_order


def take(it, n):
    return [next(it) for _ in range(n)]


def test_full_micro_batches_of_each_epoch_order_epoch_after_epoch():
    stream = MicroBatchStream(13, 2, seed=5)  # 6 full micro-batches per epoch, one row left over
    batches = take(stream.from_cursor(), 14)
    assert [mb.n for mb in batches] == list(range(14))
    assert [mb.epoch for mb in batches] == [0] * 6 + [1] * 6 + [2] * 2
    for e in (0, 1):
        order = epoch_order(13, 5, e)
        assert sum((mb.rows for mb in batches[6 * e : 6 * e + 6]), []) == order[:12]
    assert batches[3].seeds == [anchor_seed(5, 0, 6), anchor_seed(5, 0, 7)]
    assert [stream.at(n) for n in range(14)] == batches  # by number: what a fan-out's target reads


def test_a_cursor_resumes_the_stream_and_names_its_position():
    stream = MicroBatchStream(13, 2, seed=5)
    batches = take(stream.from_cursor(), 9)
    for k in (0, 5, 6, 8):  # k micro-batches trained; the cursor after the last one (lazy epoch roll-over)
        cursor = batches[k - 1].cursor_after if k else None
        assert stream.position(cursor) == k
        assert take(stream.from_cursor(cursor), 9 - k) == batches[k:]
    assert batches[5].cursor_after == {"epoch": 0, "index": 12}  # the next one rolls over to epoch 1


def test_ranks_of_another_world_size_continue_the_same_rows():
    """A cursor counts global rows: 2 ranks x 2 rows continue where 1 process x 4 rows stopped."""
    one = MicroBatchStream(20, 4, seed=1)
    cursor = take(one.from_cursor(), 2)[-1].cursor_after
    after = next(one.from_cursor(cursor))
    ranks = [next(MicroBatchStream(20, 2, 1, world_size=2, rank=r).from_cursor(cursor)) for r in (0, 1)]
    assert ranks[0].rows + ranks[1].rows == after.rows and ranks[0].seeds + ranks[1].seeds == after.seeds


def test_a_stream_needs_one_full_micro_batch():
    with pytest.raises(ValueError, match="cannot fill one micro-batch"):
        MicroBatchStream(3, 2, 0, world_size=2)

"""Shape buckets: context length and anchor count padded to a small fixed set, so that the set of compiled
shapes is known and small (each bucket is compiled once, at warm-up).

`pick_bucket` chooses a bucket, `bucket_layout`/`pad_layout` pad a block layout into it, `pad_to` pads
queries and `pad_keys` keys/values laid out [context | blocks]. Padding changes no visibility of the real
rows: padded context positions belong to no document (doc id -1) and padded blocks are invalid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dflashkit.attention.masks import BlockLayout
from dflashkit.errors import DflashkitError


class ShapeBucketError(DflashkitError):
    """A length is larger than every configured shape bucket."""


CONTEXT_BUCKETS: tuple[int, ...] = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
ANCHOR_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


def pick_bucket(n: int, buckets: Sequence[int], what: str = "length") -> int:
    """The smallest bucket >= n."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ShapeBucketError(
        f"{what} {n} is larger than the largest bucket ({max(buckets)}); add a bucket (and warm it) or "
        f"truncate the input"
    )


def pad_to(x: Tensor, dim: int, length: int, value: float | int | bool = 0) -> Tensor:
    """Pad dimension `dim` of x at the end with `value` up to `length`."""
    n = x.shape[dim]
    if n > length:
        raise ShapeBucketError(f"cannot pad dimension {dim} of size {n} down to {length}")
    if n == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - n
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def pad_keys(x: Tensor, context_len: int, bucket_context_len: int, bucket_q_len: int, dim: int = 2) -> Tensor:
    """Pad keys or values laid out [context | blocks] along `dim`: the context part to
    bucket_context_len, the block part to bucket_q_len (as pad_layout lays out the bucketed keys)."""
    ctx, blocks = x.split([context_len, x.shape[dim] - context_len], dim=dim)
    return torch.cat([pad_to(ctx, dim, bucket_context_len), pad_to(blocks, dim, bucket_q_len)], dim=dim)


def pad_layout(layout: BlockLayout, context_len: int, num_blocks: int) -> BlockLayout:
    """Pad the context with padding positions (doc id -1) and the blocks with invalid blocks. Keys and
    queries keep their indices: context s stays s, block j stays block j."""
    return BlockLayout(
        anchors=pad_to(layout.anchors, 1, num_blocks, 0),
        block_valid=pad_to(layout.block_valid, 1, num_blocks, False),
        doc_ids=pad_to(layout.doc_ids, 1, context_len, -1),
        block_size=layout.block_size,
    )


def bucket_layout(
    layout: BlockLayout,
    context_buckets: Sequence[int] = CONTEXT_BUCKETS,
    anchor_buckets: Sequence[int] = ANCHOR_BUCKETS,
) -> BlockLayout:
    """Pad a layout to its (context length, anchor count) bucket."""
    return pad_layout(
        layout,
        pick_bucket(layout.context_len, context_buckets, "context length"),
        pick_bucket(layout.num_blocks, anchor_buckets, "anchor count"),
    )

"""The target's pass over packed rows: context features and argmax labels, documents kept apart.

Rows pack several documents (`dflashkit.data.rows`); a document must not see the ones packed before it,
so the target runs with per-document positions and a block-diagonal causal mask. Training (online or
cached features), the fan-out's target workers and `dflashkit capture` all call `target_pass`, so their
features are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor


class PackedRows(Protocol):
    """What the target reads of packed rows ([b, T] each)."""

    input_ids: Tensor
    doc_ids: Tensor
    position_ids: Tensor


def target_pass(target: Any, rows: PackedRows, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Context features [b, T, n*H] of ``layer_ids`` and the target's argmax labels [b, T] for packed rows.

    ``target`` is a TargetModel (or a view of one on another device)."""
    T = rows.input_ids.shape[1]
    dev = rows.input_ids.device
    same_doc = rows.doc_ids[:, :, None] == rows.doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    # Padding rows see themselves only (keeps softmax finite; they are never supervised).
    allowed = (same_doc & causal)[:, None] | torch.eye(T, dtype=torch.bool, device=dev)
    return target.features(
        rows.input_ids, allowed, layer_ids, position_ids=rows.position_ids, labels="argmax"
    )

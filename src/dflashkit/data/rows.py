"""Packed rows: tokenized records packed first-fit into rows of max_len tokens, as training and capture
see them.

A row holds one or more documents (records) and padding: `input_ids`, `loss_mask` (the supervised
response tokens), `doc_ids` (the record's index, -1 on padding) and `position_ids` (0.. per document).
`pack_dataset` packs both splits of a prepared dataset; the same rows feed training, the held-out
evaluation and `dflashkit capture`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.config import RunConfig
from dflashkit.data.dataset import load_dataset
from dflashkit.errors import ConfigError, DataError


@dataclass
class Rows:
    """Packed rows: input_ids, loss_mask, doc_ids, position_ids, each [rows, max_len]."""

    input_ids: Tensor
    loss_mask: Tensor
    doc_ids: Tensor
    position_ids: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, idx: list[int], device: torch.device) -> Rows:
        """Rows ``idx``, on ``device``."""
        return Rows(
            *(t[idx].to(device) for t in (self.input_ids, self.loss_mask, self.doc_ids, self.position_ids))
        )


def pack_sequences(
    records: Sequence[Mapping[str, Sequence[int] | Tensor]], max_len: int, pad_token_id: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pack tokenized conversations into rows of `max_len` tokens (first fit, in record order).

    Each record has "input_ids" and "loss_mask" (equal lengths). A record goes into the first row that still
    has room for all of it, else a new row; a record longer than max_len is truncated to max_len.
    Returns input_ids [rows, max_len] long, loss_mask [rows, max_len] bool, doc_ids [rows, max_len] long
    (the record's index in `records`; -1 on padding) and position_ids [rows, max_len] long (0.. per
    document; 0 on padding). Padding tokens are `pad_token_id` and never supervised.
    """
    rows: list[list[int]] = []  # record indices per row
    free: list[int] = []
    for i, rec in enumerate(records):
        if len(rec["input_ids"]) != len(rec["loss_mask"]):
            raise ValueError(f"record {i}: input_ids and loss_mask lengths differ")
        n = min(len(rec["input_ids"]), max_len)
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append([])
            free.append(max_len)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= n

    input_ids = torch.full((len(rows), max_len), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), max_len), dtype=torch.bool)
    doc_ids = torch.full((len(rows), max_len), -1, dtype=torch.long)
    position_ids = torch.zeros((len(rows), max_len), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            ids = torch.as_tensor(records[i]["input_ids"], dtype=torch.long)[:max_len]
            n = ids.numel()
            input_ids[r, start : start + n] = ids
            loss_mask[r, start : start + n] = torch.as_tensor(records[i]["loss_mask"], dtype=torch.bool)[:n]
            doc_ids[r, start : start + n] = i
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
    return input_ids, loss_mask, doc_ids, position_ids


def pack_rows(records: list[Any], max_len: int, pad_token_id: int, where: str = "the dataset split") -> Rows:
    """Pack tokenized records (with .input_ids and .loss_mask) into rows of max_len tokens."""
    if not records:
        raise DataError(
            f"{where} holds no records; prepare more prompts (data.max_prompts), or see why `dflashkit "
            "prepare` kept none (prompts longer than data.max_prompt_tokens are left out)"
        )
    plain = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask} for r in records]
    return Rows(*pack_sequences(plain, max_len, pad_token_id))


def pack_dataset(cfg: RunConfig, target_config: Any) -> tuple[Rows, Rows]:
    """The packed training and validation rows of data.dir (``target_config``: the target's HF config,
    for its padding token; no weights needed)."""
    pad = int(getattr(target_config, "pad_token_id", None) or 0)
    data_dir = Path(cfg.data.dir)
    train, val = (
        pack_rows(load_dataset(data_dir, split), cfg.train.max_len, pad, f"the {split} split of {data_dir}")
        for split in ("train", "validation")
    )
    return train, val


def check_data_matches_target(manifest: Mapping[str, Any], ident: Mapping[str, Any], where: str) -> None:
    """The data was prepared by this target (its shape and, where both are known, its weights' hash), or
    one clear error saying so."""
    data_target = manifest.get("target", {})
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if key in data_target and data_target[key] != ident.get(key):
            raise ConfigError(
                f"{where} was prepared with a target of {key}={data_target[key]}, but this target has "
                f"{key}={ident.get(key)}; prepare the data again with this target"
            )
    if data_target.get("hash") and ident.get("hash") and data_target["hash"] != ident["hash"]:
        raise ConfigError(
            f"{where} was prepared with another target ({data_target.get('name')}, hash "
            f"{str(data_target['hash'])[:12]}) than {ident['name']} (hash {str(ident['hash'])[:12]}); "
            "prepare the data again with this target"
        )

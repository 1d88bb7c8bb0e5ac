"""The optimizer and its schedule: AdamW over the drafter's trainable parameters, a linear warm-up to
train.lr, then a cosine decay to train.min_lr_ratio x train.lr over the run's steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflashkit.config import RunConfig


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def build_optimizer(
    drafter: nn.Module, cfg: RunConfig, total_steps: int
) -> tuple[list[nn.Parameter], torch.optim.Optimizer, Any]:
    """(the trainable parameters, AdamW over them, its LambdaLR schedule)."""
    train = cfg.train
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, train.warmup_ratio, train.min_lr_ratio)
    )
    return params, optimizer, scheduler

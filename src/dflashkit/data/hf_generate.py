"""The ``"hf"`` generation backend: transformers' ``generate`` on fixed, left-padded batches.

Works for any architecture transformers generates with, and is the reference the slot generator is tested
against. Each call answers up to ``batch_size`` ready requests with the same sampling settings; a batch
waits for its longest reply. Sampling draws from torch's global generator, seeded with the batch's first
request seed, so a sampled reply depends on the batch it ran in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import groupby
from typing import Any

from dflashkit.data.generation import GenerationStats, Reply, Request, RequestSource, cut_reply


def generate_replies(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[Reply]:
    """Answer a batch of tokenized prompts in one left-padded `generate` call. temperature 0 is greedy;
    otherwise sampling (with top-p) draws from torch's global generator, which the caller seeds."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p) :] = 1
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        top_k=0 if sampling else None,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
        )
    return [cut_reply(row, eos_ids, max_new_tokens) for row in out[:, width:].tolist()]


class HFGenerator:
    """The ``"hf"`` backend (see the module docstring)."""

    name = "hf"

    def __init__(self, model: Any, eos_ids: list[int], pad_id: int, batch_size: int):
        self.model = model
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id
        self.batch_size = batch_size

    def run(
        self, source: RequestSource, *, on_progress: Callable[[int], None] | None = None
    ) -> GenerationStats:
        import torch

        stats = GenerationStats()
        calls = 0
        t0 = time.perf_counter()
        while batch := source.take(self.batch_size, idle=True):

            def how(r: Request) -> tuple[float, float, int]:
                return (r.temperature, r.top_p, r.max_new_tokens)

            for (temperature, top_p, max_new), group_iter in groupby(sorted(batch, key=how), key=how):
                group = list(group_iter)
                if temperature > 0:
                    torch.manual_seed(group[0].seed)
                replies = generate_replies(
                    self.model,
                    [list(r.prompt_ids) for r in group],
                    max_new_tokens=max_new,
                    eos_ids=self.eos_ids,
                    pad_id=self.pad_id,
                    temperature=temperature,
                    top_p=top_p,
                )
                calls += 1
                written = 0
                for r, reply in zip(group, replies, strict=True):
                    stats.requests += 1
                    stats.new_tokens += len(reply.ids)
                    stats.prompt_tokens += len(r.prompt_ids)
                    written += len(reply.ids)
                    source.complete(r, reply)
                if on_progress is not None:
                    on_progress(written)
        stats.seconds = time.perf_counter() - t0
        stats.extra = {"generate_calls": calls}
        return stats

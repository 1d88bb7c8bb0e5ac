"""Regeneration: the target answers every prompt itself, so the drafter learns the target's own
distribution (self-distillation).

The target is loaded with plain transformers (AutoModelForCausalLM: generation is all it does here). Prompts are rendered with the chat template, sorted by
length, cut into fixed batches, left-padded and answered with `model.generate` (greedy by default,
temperature / top-p sampling with a per-batch seed otherwise), stopping at EOS or `max_new_tokens`.
Multi-turn prompts are answered round by round, each round on the target's own earlier replies.

Finished conversations go to an append-only JSONL cache, one line per prompt id, flushed and fsynced
after every batch. A restart reads the cache, drops a torn last line (the tail of a write that an
interruption cut), and skips every batch whose prompts are all done. Batches are fixed by the prompt
set, so a resumed run regenerates a partly written batch whole and gets exactly the replies an
uninterrupted run would have written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.data.chat import generation_prompt_ids
from dflashkit.data.sources import Prompt
from dflashkit.errors import ConfigError, DataError, DflashkitError

DTYPES = ("bfloat16", "float16", "float32")


# --- the target -------------------------------------------------------------------------------


def load_target(target: str, *, dtype: str = "bfloat16", device: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) for generation, in eval mode on `device` ("auto": CUDA when present).
    `target` is "embedded" or a transformers model folder; its identity (for manifests) is
    `dflashkit.target.hf.identity_of_folder(target)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dflashkit.target.hf import resolve_target

    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path, _name = resolve_target(target)
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise DflashkitError(
            f"cannot load target {target!r} ({e.__class__.__name__}: {str(e).splitlines()[0]}); pass "
            "'embedded' or a folder holding a transformers model and tokenizer"
        ) from None
    finally:
        hf_logging.enable_progress_bar()
    model.to(device).eval()
    return model, tokenizer


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a reply: the generation config's EOS ids and the tokenizer's."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in [*(gen_eos if isinstance(gen_eos, list) else [gen_eos]), tokenizer.eos_token_id]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    if not ids:
        raise DflashkitError("the target defines no EOS token, so replies could never stop; set eos_token_id")
    return ids


# --- one batch of replies ---------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """The tokens the target wrote: up to and including its EOS when `finished`, else cut at the limit."""

    ids: list[int]
    finished: bool


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
    replies = []
    for row in out[:, width:].tolist():
        stop = next((k for k, t in enumerate(row) if t in eos_ids), None)
        replies.append(Reply(row, False) if stop is None else Reply(row[: stop + 1], True))
    return replies


# --- the cache --------------------------------------------------------------------------------


def read_cache(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """(records by prompt id, number of torn lines dropped). A torn tail (the unparsable end of the
    file that an interrupted write left) is cut off the file; an unparsable line followed by good ones
    is corruption and raises DataError naming the line."""
    if not path.is_file():
        return {}, 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records: dict[str, dict[str, Any]] = {}
    offset = 0
    bad_at: int | None = None  # byte offset of the first unparsable line
    bad_line = 0
    for lineno, line in enumerate(lines, start=1):
        complete = lineno < len(lines)  # the piece after the last newline has none
        if line.strip():
            try:
                rec = json.loads(line) if complete else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                if bad_at is not None:
                    raise DataError(
                        f"{path}:{bad_line}: corrupt line in the generation cache; delete that line "
                        "(or the file, to regenerate everything) and run again"
                    )
                records[rec["id"]] = rec
            elif bad_at is None:
                bad_at, bad_line = offset, lineno
        offset += len(line) + 1
    torn = 0
    if bad_at is not None:
        torn = sum(1 for line in raw[bad_at:].split(b"\n") if line.strip())
        with path.open("r+b") as f:
            f.truncate(bad_at)
            f.flush()
            os.fsync(f.fileno())
    return records, torn


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append finished records as JSON lines, then flush and fsync: after this returns they survive
    a crash."""
    if not records:
        return
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


# --- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024  # a prompt (any round) longer than this is not answered
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    enable_thinking: bool = False


@dataclass
class RegenerationStats:
    batches: int = 0  # batches generated in this run
    generated: int = 0  # records written in this run
    cached: int = 0  # records found in the cache from an earlier run
    torn_lines: int = 0  # torn lines dropped from the cache
    new_tokens: int = 0  # tokens the target wrote in this run (all of each generated batch)
    seconds: float = 0.0  # time spent in generate

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def batch_seed(seed: int, first_id: str, round_index: int) -> int:
    """The sampling seed of one generate call: fixed by the run's seed and the batch, not by history."""
    return int(hashlib.sha256(f"{seed}:{first_id}:{round_index}".encode()).hexdigest()[:15], 16)


def make_batches(prompts: list[Prompt], tokenizer: Any, gen: GenerationSettings) -> list[list[Prompt]]:
    """Fixed batches: prompts sorted by the length of their first rendered round (less padding), then
    by id, cut every `batch_size`."""
    length = {
        p.id: len(
            generation_prompt_ids(
                tokenizer, p.messages()[: _upto_turn(p, 0)], enable_thinking=gen.enable_thinking
            )
        )
        for p in prompts
    }
    order = sorted(prompts, key=lambda p: (length[p.id], p.id))
    return [order[i : i + gen.batch_size] for i in range(0, len(order), gen.batch_size)]


def answer_batch(
    batch: list[Prompt], model: Any, tokenizer: Any, gen: GenerationSettings, eos_ids: list[int], pad_id: int
) -> list[dict[str, Any]]:
    """Cache records for one batch: every user turn answered in order, round by round."""
    import torch

    replies: dict[str, list[Reply]] = {p.id: [] for p in batch}
    texts: dict[str, list[str]] = {p.id: [] for p in batch}
    skipped: dict[str, str] = {}
    stopped: set[str] = set()
    for r in range(max(len(p.turns) for p in batch)):
        rows: list[tuple[Prompt, list[int]]] = []
        for p in batch:
            if p.id in stopped or r >= len(p.turns):
                continue
            ids = generation_prompt_ids(
                tokenizer, p.messages(texts[p.id])[: _upto_turn(p, r)], enable_thinking=gen.enable_thinking
            )
            if len(ids) > gen.max_prompt_tokens:
                stopped.add(p.id)  # later rounds would be longer still
                if r == 0:
                    skipped[p.id] = "prompt_too_long"
                continue
            rows.append((p, ids))
        if not rows:
            break
        if gen.temperature > 0:
            torch.manual_seed(batch_seed(gen.seed, batch[0].id, r))
        out = generate_replies(
            model,
            [ids for _, ids in rows],
            max_new_tokens=gen.max_new_tokens,
            eos_ids=eos_ids,
            pad_id=pad_id,
            temperature=gen.temperature,
            top_p=gen.top_p,
        )
        for (p, _), reply in zip(rows, out, strict=True):
            replies[p.id].append(reply)
            body = reply.ids[:-1] if reply.finished else reply.ids
            texts[p.id].append(
                tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            )
    records = []
    for p in batch:
        if p.id in skipped:
            records.append({"id": p.id, "skipped": skipped[p.id]})
            continue
        n = len(replies[p.id])
        records.append(
            {
                "id": p.id,
                "messages": p.messages(texts[p.id])[: _upto_turn(p, n - 1) + 1],
                "finished": [rep.finished for rep in replies[p.id]],
                "reply_ids": [rep.ids for rep in replies[p.id]],
            }
        )
    return records


def _upto_turn(p: Prompt, r: int) -> int:
    """How many messages of `p.messages(...)` come before the reply to user turn r."""
    return (p.system is not None) + 2 * r + 1


def regenerate(
    prompts: list[Prompt],
    model: Any,
    tokenizer: Any,
    cache_path: Path,
    gen: GenerationSettings,
    *,
    on_batch: Callable[[int, int], None] | None = None,
    progress: bool = True,
) -> RegenerationStats:
    """Answer every prompt not already in the cache, appending each finished batch to it. `on_batch`
    is called with (batches done, batches in all) after each batch is safely on disk."""
    from tqdm.auto import tqdm

    done, torn = read_cache(cache_path)
    stats = RegenerationStats(torn_lines=torn)
    wanted = {p.id for p in prompts}
    stats.cached = sum(1 for pid in done if pid in wanted)
    batches = make_batches(prompts, tokenizer, gen)
    todo = [b for b in batches if any(p.id not in done for p in b)]
    if not todo:
        return stats
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    bar = tqdm(
        total=sum(len(b) for b in todo),
        unit="prompt",
        desc="regenerating",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    try:
        for b in todo:
            t0 = time.perf_counter()
            records = answer_batch(b, model, tokenizer, gen, eos_ids, pad_id)
            stats.seconds += time.perf_counter() - t0
            new = [r for r in records if r["id"] not in done]
            append_records(cache_path, new)
            for r in new:
                done[r["id"]] = r
            stats.new_tokens += sum(len(ids) for r in records for ids in r.get("reply_ids", []))
            stats.generated += len(new)
            stats.batches += 1
            bar.update(len(b))
            bar.set_postfix(tok_s=f"{stats.tokens_per_second:.0f}")
            if on_batch is not None:
                on_batch(len(batches) - len(todo) + stats.batches, len(batches))
    finally:
        bar.close()
    return stats

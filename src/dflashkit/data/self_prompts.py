"""Prompts the target writes itself: the source ``"self"`` of a `data.sources` mixture.

A drafter learns the target's replies, so its data needs prompts of every kind the target will be asked, and
the prompt sets that install offline (chitchat, ShareGPT) hold little maths and little code. An instruct
model writes such prompts itself when its chat template is opened at a user turn and left to continue: the
text before the user's content (system message and user header, as the template renders them), then a seed
("Write a Python function that", "A bakery sells"), then the target writes on until its end-of-turn token.
Chat models trained on their own synthetic instructions write plausible user turns this way.

For each `"self"` source, `write_self_prompts` asks the generation backend that answers the replies for
attempts 0, 1, 2, ... until `count` prompts are kept, and appends every attempt to
``self-prompts-<name>-<digest>.jsonl`` in the dataset folder (append-only, fsynced: a restart resumes from it;
the digest covers what the attempts depend on, so other seeds or sampling settings start another file).
An attempt is kept when the target ended the turn itself, wrote at least `MIN_CHARS` characters after the seed, it is
not a duplicate of an earlier kept prompt (normalised text) and not a question of an installed benchmark set.
Attempt k starts with seed ``seeds[k % len(seeds)]`` and samples from its own seed, fixed by the run's seed,
the source's name and k.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.config import SourceSpec
from dflashkit.data.chat import encode_text, render_text
from dflashkit.data.generation import Backend, ListSource, Request, request_seed
from dflashkit.data.regenerate import append_records, read_cache
from dflashkit.data.sources import Prompt, PromptSet, make_prompt, normalise_text
from dflashkit.errors import ConfigError

SELF_SOURCE = "self"
MIN_CHARS = 16  # shorter written turns ("Hi", "Thanks!") make poor prompts
SENTINEL = "\x00dflashkit-user-turn\x00"
MAX_ATTEMPTS_PER_PROMPT = 4  # stop asking when fewer than one attempt in four is kept


def user_turn_prefix(tokenizer: Any, enable_thinking: bool) -> str:
    """The rendered text before a user turn's content: what the target has seen when it writes the turn
    (the template's default system message, if it has one, and the user header)."""
    text = render_text(
        tokenizer,
        [{"role": "user", "content": SENTINEL}],
        add_generation_prompt=False,
        enable_thinking=enable_thinking,
    )
    at = text.find(SENTINEL)
    if at < 0:
        raise ConfigError(
            "the target's chat template does not write a user turn's text verbatim; source 'self' cannot "
            "open a user turn for the target to write"
        )
    return text[:at]


def prompts_file(out: Path, spec: SourceSpec, run_seed: int) -> Path:
    """Where a `"self"` source's attempts are kept: named after the source, and a digest of what each
    attempt depends on (seeds, sampling, the run's seed; not `suffix`, which is appended when read)."""
    what = {
        "seeds": spec.seeds,
        "max_tokens": spec.prompt_max_tokens,
        "temperature": spec.prompt_temperature,
        "top_p": spec.prompt_top_p,
        "seed": run_seed,
        "name": spec.label,
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]
    return out / f"self-prompts-{spec.label}-{digest}.jsonl"


@dataclass
class SelfPromptCounts:
    """What became of the attempts (the manifest's per-source counts)."""

    attempts: int = 0
    kept: int = 0
    unfinished: int = 0  # cut at prompt_max_tokens before the target ended the turn
    too_short: int = 0
    duplicates: int = 0
    benchmark: int = 0  # the text of a benchmark question: never training data
    new_tokens: int = 0  # written this run
    seconds: float = 0.0  # this run's generation

    def as_dict(self) -> dict[str, Any]:
        return {f"self_{k}": v for k, v in self.__dict__.items()}


def keep_prompts(
    spec: SourceSpec, attempts: dict[str, dict[str, Any]], questions: dict[str, tuple[str, str]]
) -> tuple[list[Prompt], SelfPromptCounts]:
    """The prompts kept from the attempts (in attempt order, at most `count`), and what became of the rest."""
    counts = SelfPromptCounts(attempts=len(attempts))
    seen: set[str] = set()
    kept: list[Prompt] = []
    for k in sorted(attempts, key=int):
        rec = attempts[k]
        text = rec["text"].strip()
        norm = normalise_text(text)
        seed = spec.seeds[int(rec.get("seed", 0))] if spec.seeds else ""
        if not rec["finished"]:
            counts.unfinished += 1
        elif len(rec["text"].removeprefix(seed).strip()) < MIN_CHARS:  # the target's own part
            counts.too_short += 1
        elif norm in seen:
            counts.duplicates += 1
        elif norm in questions:
            counts.benchmark += 1
        elif spec.count is None or len(kept) < spec.count:
            seen.add(norm)
            kept.append(make_prompt([text + spec.suffix], origin=f"{spec.label}:{k}"))
    counts.kept = len(kept)
    return kept, counts


@dataclass
class SelfPrompts:
    """A `"self"` source's prompts, as `plan_records` reads them, and what became of the attempts."""

    prompts: PromptSet
    counts: SelfPromptCounts
    path: Path


def write_self_prompts(
    spec: SourceSpec,
    out: Path,
    backend: Backend,
    tokenizer: Any,
    eos_ids: list[int],
    questions: dict[str, tuple[str, str]],
    *,
    run_seed: int = 0,
    enable_thinking: bool = False,
    progress: bool = True,
) -> SelfPrompts:
    """Have the target write `spec.count` prompts (resuming from the attempts already on disk) and return
    them as the source's `PromptSet`."""
    from tqdm.auto import tqdm

    if spec.count is None:
        raise ConfigError(f"source {spec.label!r}: give count, how many prompts the target writes")
    path = prompts_file(out, spec, run_seed)
    attempts, _torn = read_cache(path)
    prefix = user_turn_prefix(tokenizer, enable_thinking)
    seeds = spec.seeds or [""]
    seed_ids = [encode_text(tokenizer, prefix + s) for s in seeds]
    stop = set(eos_ids)
    kept, counts = keep_prompts(spec, attempts, questions)
    limit = MAX_ATTEMPTS_PER_PROMPT * spec.count + 64
    new_tokens, seconds = 0, 0.0
    bar = tqdm(
        total=spec.count,
        initial=len(kept),
        unit="prompt",
        desc=f"writing prompts ({spec.label})",
        disable=None if progress else True,
    )
    try:
        while len(kept) < spec.count and len(attempts) < limit:
            need = spec.count - len(kept)
            # the attempts asked so far and this batch's (a kept share of ~3/4 is typical; ask a little more)
            upto = min(limit, len(attempts) + math.ceil(need * 1.4) + 2)
            todo = [k for k in range(upto) if str(k) not in attempts]
            requests = [
                Request(
                    key=str(k),
                    prompt_ids=tuple(seed_ids[k % len(seeds)]),
                    max_new_tokens=spec.prompt_max_tokens,
                    temperature=spec.prompt_temperature,
                    top_p=spec.prompt_top_p,
                    seed=request_seed(run_seed, f"{SELF_SOURCE}:{spec.label}", k),
                )
                for k in todo
            ]
            batch = ListSource(requests)
            t0 = time.perf_counter()
            run = backend.run(batch)
            seconds += time.perf_counter() - t0
            new_tokens += run.new_tokens
            records = []
            for k in todo:
                reply = batch.replies[str(k)]
                body = reply.ids[:-1] if reply.finished and reply.ids and reply.ids[-1] in stop else reply.ids
                records.append(
                    {
                        "id": str(k),
                        "seed": k % len(seeds),
                        "text": seeds[k % len(seeds)] + tokenizer.decode(body, skip_special_tokens=True),
                        "finished": reply.finished,
                        "tokens": len(reply.ids),
                    }
                )
            append_records(path, records)
            attempts.update({r["id"]: r for r in records})
            kept, counts = keep_prompts(spec, attempts, questions)
            bar.update(len(kept) - bar.n)
    finally:
        bar.close()
    counts.new_tokens, counts.seconds = new_tokens, round(seconds, 3)
    ps = PromptSet(source=spec.label, format=SELF_SOURCE, prompts=kept, records=len(attempts))
    ps.duplicates = counts.duplicates
    ps.empty = counts.unfinished + counts.too_short
    return SelfPrompts(prompts=ps, counts=counts, path=path)

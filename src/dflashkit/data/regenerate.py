"""Regeneration: the target answers every prompt itself, so the drafter learns the target's own
distribution (self-distillation).

A *record* is one conversation answered once: a prompt (a system message and user turns) with a sampling
setting (greedy, or temperature and top-p with the record's own seed; a prompt may be answered several
times, one record per sample). `Conversations` turns records into generation requests round by round,
each round on the target's own earlier replies (a later round is asked once the earlier one is answered),
and hands them to a backend (`dflashkit.data.generation`: the slot generator, transformers' generate, or a
serving engine). A round whose prompt is longer than `max_prompt_tokens` ends its conversation there.

Finished records go to an append-only JSONL cache, one line per record, flushed and fsynced every few
seconds and whenever the run stops, interrupted or not. A restart reads the cache, drops a torn last line
(the tail of a write that an interruption cut), and generates only the records it lacks: nothing is lost
or written twice. A record's replies depend on its prompt, its seed and the target (greedy replies are the
target's own greedy decoding), not on what ran beside it, up to the rounding of the batched kernels.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.atomic import disk_full_said
from dflashkit.data.chat import generation_prompt_ids
from dflashkit.data.generation import Backend, Reply, Request, request_seed
from dflashkit.data.parallel import TokenizerPool
from dflashkit.data.sources import Prompt
from dflashkit.errors import ConfigError, DataError, DflashkitError

DTYPES = ("bfloat16", "float16", "float32")


# --- the target -------------------------------------------------------------------------------


def load_tokenizer(target: str) -> Any:
    """The target's tokenizer alone (what `load_target` loads first; pass it back to `load_target`, which
    then loads the model only). `target` is "embedded" or a transformers model folder."""
    from transformers import AutoTokenizer

    from dflashkit.target.hf import resolve_target

    path, _name = resolve_target(target)
    with _loading(target):
        return AutoTokenizer.from_pretrained(path)


def load_target(
    target: str, *, dtype: str = "bfloat16", device: str = "auto", weights: bool = True, tokenizer: Any = None
) -> tuple[Any, Any]:
    """(model, tokenizer) for generation, in eval mode on `device` ("auto": CUDA when present); model is
    None with `weights=False` (a serving engine generates). `target` is "embedded" or a transformers
    model folder; its identity (for manifests) is `dflashkit.target.hf.identity_of_folder(target)`.
    `tokenizer`: the one `load_tokenizer(target)` returned (else it is loaded here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflashkit.target.hf import resolve_target

    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path, _name = resolve_target(target)
    if tokenizer is None:
        tokenizer = load_tokenizer(target)
    with _loading(target):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)) if weights else None
    if model is not None:
        model.to(device).eval()
    else:
        tokenizer.dflashkit_folder = str(path)  # where eos_token_ids finds the generation config
    return model, tokenizer


@contextmanager
def _loading(target: str) -> Iterator[None]:
    """Loading the target's files: no progress bars, and one clear error when they are not there."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        yield
    except (OSError, ValueError) as e:
        raise DflashkitError(
            f"cannot load target {target!r} ({e.__class__.__name__}: {str(e).splitlines()[0]}); pass "
            "'embedded' or a folder holding a transformers model and tokenizer"
        ) from None
    finally:
        hf_logging.enable_progress_bar()


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a reply: the generation config's EOS ids and the tokenizer's. ``model``:
    anything with a ``generation_config`` (a transformers model; a TargetModel, lazy or not), or None."""
    ids: list[int] = []
    config = getattr(model, "generation_config", None)
    if model is None and getattr(tokenizer, "dflashkit_folder", None):
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(tokenizer.dflashkit_folder)
        except OSError:
            config = None
    gen_eos = getattr(config, "eos_token_id", None)
    for x in [*(gen_eos if isinstance(gen_eos, list) else [gen_eos]), tokenizer.eos_token_id]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    if not ids:
        raise DflashkitError("the target defines no EOS token, so replies could never stop; set eos_token_id")
    return ids


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
    # a line torn by a full disk is dropped when the cache is read again: the same command resumes
    with disk_full_said(path, needed=len(blob.encode())), path.open("a", encoding="utf-8") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


# --- records and their conversations -----------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One record to generate: `prompt` answered once, greedily (temperature 0) or sampled."""

    record_id: str
    prompt: Prompt
    source: str = ""
    sample: int = 0
    temperature: float = 0.0
    top_p: float = 1.0

    def sampling(self) -> dict[str, float]:
        return {"temperature": self.temperature, "top_p": self.top_p}


def record_id(prompt_id: str, sample: int) -> str:
    """A record's id: the prompt's id for its first sample, "<prompt id>.<k>" for sample k > 0."""
    return prompt_id if sample == 0 else f"{prompt_id}.{sample}"


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024  # a prompt (any round) longer than this is not answered
    seed: int = 0
    enable_thinking: bool = False
    flush_seconds: float = 2.0  # finished records reach the disk at least this often
    flush_records: int = 1024  # ...and whenever this many are waiting


DEFERRED_BATCH = 2048  # later rounds rendered together (in parallel) once this many are waiting


def _upto_turn(p: Prompt, r: int) -> int:
    """How many messages of `p.messages(...)` come before the reply to user turn r."""
    return (p.system is not None) + 2 * r + 1


@dataclass
class _Conversation:
    job: Job
    replies: list[Reply] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def round_prompt_ids(tokenizer: Any, item: tuple[list[dict[str, str]], bool]) -> list[int]:
    """The token ids of one round's prompt (messages, enable_thinking); a `TokenizerPool` function."""
    messages, enable_thinking = item
    return generation_prompt_ids(tokenizer, messages, enable_thinking=enable_thinking)


class Conversations:
    """The `RequestSource` of a regeneration: asks each record's rounds in order and writes each record
    once its last round is answered (`write` receives lists of finished records).

    Prompts are rendered in batches through `pool`: every record's first round up front (once per
    prompt: a prompt's samples share it), later rounds as they gather (`DEFERRED_BATCH` at a time, or
    whatever is waiting when the backend runs dry)."""

    def __init__(
        self,
        jobs: list[Job],
        tokenizer: Any,
        gen: GenerationSettings,
        write: Callable[[list[dict[str, Any]]], None],
        pool: TokenizerPool | None = None,
    ):
        self.tokenizer = tokenizer
        self.gen = gen
        self.write = write
        self.pool = pool or TokenizerPool(tokenizer, workers=1)
        self._ready: list[tuple[int, int, Request]] = []  # a heap: shortest prompt first
        self._running: dict[str, _Conversation] = {}
        self._deferred: list[_Conversation] = []  # answered a round; the next one is not rendered yet
        self._finished: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._order = 0
        self.records_done = 0
        prompts = list({j.prompt.id: j.prompt for j in jobs}.values())
        first = self.pool.map(
            round_prompt_ids, [(p.messages()[: _upto_turn(p, 0)], gen.enable_thinking) for p in prompts]
        )
        ids_of = {p.id: ids for p, ids in zip(prompts, first, strict=True)}
        for job in jobs:
            self._ask(_Conversation(job), ids_of[job.prompt.id] if job.prompt.turns else None)

    def __len__(self) -> int:
        """Records not yet written."""
        return len(self._running) + len(self._deferred) + len(self._finished)

    def take(self, n: int, idle: bool = False) -> list[Request]:
        if self._deferred and (idle or not self._ready or len(self._deferred) >= DEFERRED_BATCH):
            self._render_deferred()
        out = []
        while self._ready and len(out) < n:
            out.append(heapq.heappop(self._ready)[2])
        return out

    def complete(self, request: Request, reply: Reply) -> None:
        conv = self._running.pop(request.key)
        conv.replies.append(reply)
        body = reply.ids[:-1] if reply.finished else reply.ids
        conv.texts.append(
            self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        if len(conv.replies) < len(conv.job.prompt.turns):
            self._deferred.append(conv)
            # a full batch is rendered here, not in `take`: a backend hands replies on while its device
            # decodes, so this work hides behind the device's
            if self.pool.workers < 2 or len(self._deferred) >= DEFERRED_BATCH:  # (1 worker: nothing to batch)
                self._render_deferred()
        else:
            self._finished.append(_record(conv))
        if self._finished and (
            len(self._finished) >= self.gen.flush_records
            or time.monotonic() - self._last_flush >= self.gen.flush_seconds
        ):
            self.flush()

    def flush(self) -> None:
        """Write the finished records (append, fsync)."""
        if self._finished:
            done, self._finished = self._finished, []
            self.write(done)
            self.records_done += len(done)
        self._last_flush = time.monotonic()

    def _render_deferred(self) -> None:
        convs, self._deferred = self._deferred, []
        items = [
            (
                c.job.prompt.messages(c.texts)[: _upto_turn(c.job.prompt, len(c.replies))],
                self.gen.enable_thinking,
            )
            for c in convs
        ]
        for conv, ids in zip(convs, self.pool.map(round_prompt_ids, items), strict=True):
            self._ask(conv, ids)

    def _ask(self, conv: _Conversation, ids: list[int] | None) -> None:
        """Queue the conversation's next round (its prompt `ids`), or finish the conversation when its
        prompt is too long (or it has no turn)."""
        job, r = conv.job, len(conv.replies)
        if ids is not None and len(ids) <= self.gen.max_prompt_tokens:
            key = f"{job.record_id}#{r}"
            request = Request(
                key=key,
                prompt_ids=tuple(ids),
                max_new_tokens=self.gen.max_new_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                seed=request_seed(self.gen.seed, job.record_id, r),
            )
            self._running[key] = conv
            heapq.heappush(self._ready, (len(ids), self._order, request))
            self._order += 1
            return
        self._finished.append(_record(conv))


def _record(conv: _Conversation) -> dict[str, Any]:
    job, n = conv.job, len(conv.replies)
    base = {"id": job.record_id, "source": job.source, "sample": job.sample, "sampling": job.sampling()}
    if n == 0:
        return {**base, "skipped": "prompt_too_long"}
    return {
        **base,
        "messages": job.prompt.messages(conv.texts)[: _upto_turn(job.prompt, n - 1) + 1],
        "finished": [rep.finished for rep in conv.replies],
        "reply_ids": [rep.ids for rep in conv.replies],
    }


# --- the loop ---------------------------------------------------------------------------------


@dataclass
class RegenerationStats:
    generated: int = 0  # records written in this run
    cached: int = 0  # records found in the cache from an earlier run
    torn_lines: int = 0  # torn lines dropped from the cache
    new_tokens: int = 0  # tokens the target wrote in this run
    prompt_tokens: int = 0  # prompt tokens it read (every round)
    seconds: float = 0.0  # time spent generating
    backend: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    # wall seconds of this call's parts: "resume" (reading the cache, checking it), "first_round" (every
    # record's first prompt rendered and queued; the tokenizer pool's start when it is not done yet),
    # "backend" (the backend's run, which its own `seconds` time), "flush" (the last records to the disk)
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def check_cached_sampling(jobs: list[Job], done: dict[str, dict[str, Any]], cache_path: Path) -> None:
    """A cached record must have been sampled as its job asks now (else its replies mean something
    else); records of older caches carry no sampling and are refused too."""
    for job in jobs:
        rec = done.get(job.record_id)
        if rec is not None and rec.get("sampling") != job.sampling():
            raise ConfigError(
                f"{cache_path.parent} holds record {job.record_id} sampled with {rec.get('sampling')}, "
                f"this run asks for {job.sampling()}; use another --out folder, or delete this one to "
                "start over"
            )


def regenerate(
    jobs: list[Job],
    backend: Backend,
    tokenizer: Any,
    cache_path: Path,
    gen: GenerationSettings,
    *,
    on_flush: Callable[[int, int], None] | None = None,
    progress: bool = True,
    pool: TokenizerPool | None = None,
) -> RegenerationStats:
    """Generate every record of `jobs` not already in the cache, appending finished records to it.
    `on_flush(done, total)` is called each time records reach the disk (records of this run's jobs:
    done so far, in all)."""
    from tqdm.auto import tqdm

    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stats.stages[stage] = round(now - clock, 3)
        clock = now

    done, torn = read_cache(cache_path)
    check_cached_sampling(jobs, done, cache_path)
    stats = RegenerationStats(torn_lines=torn, backend=backend.name)
    stats.cached = sum(1 for j in jobs if j.record_id in done)
    todo = [j for j in jobs if j.record_id not in done]
    lap("resume")
    if not todo:
        return stats
    bar = tqdm(
        total=len(todo),
        unit="record",
        desc=f"generating ({backend.name})",
        disable=None if progress else True,
    )
    tokens = 0
    t0 = time.perf_counter()

    def write(records: list[dict[str, Any]]) -> None:
        append_records(cache_path, records)
        stats.generated += len(records)
        bar.update(len(records))
        if on_flush is not None:
            on_flush(stats.cached + stats.generated, len(jobs))

    def advance(n: int) -> None:
        nonlocal tokens
        tokens += n
        bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.perf_counter() - t0):,.0f}", refresh=False)

    source = Conversations(todo, tokenizer, gen, write, pool)
    lap("first_round")
    try:
        run = backend.run(source, on_progress=advance)
        lap("backend")
    finally:
        source.flush()  # whatever finished reaches the disk, also when the run is interrupted
        bar.close()
    lap("flush")
    stats.new_tokens, stats.prompt_tokens, stats.seconds = run.new_tokens, run.prompt_tokens, run.seconds
    stats.extra = dict(run.extra)
    if len(source):
        raise DflashkitError(
            f"the {backend.name} backend stopped with {len(source)} records unanswered; run the same "
            "command again to resume"
        )
    return stats

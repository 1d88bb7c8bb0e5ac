"""`prepare_dataset`: prompts in, a tokenized training dataset folder out. And the loaders training uses.

Steps: read the source, de-duplicate, select (seeded shuffle, max count) and split off validation;
have the target answer every prompt (`regenerate`, resumable); render each conversation with the
target's chat template and mark the assistant tokens (`chat.encode_chat`); write the folder.

The folder (`out`):
    generations.jsonl       the regeneration cache (append-only; what a restart resumes from)
    generation.json         target, template and sampling identity of the cache (a restart must match)
    train.safetensors       tokenized records: flat input_ids (int32) and loss_mask (uint8), offsets
    validation.safetensors  (int64, n+1 entries) and the record ids (JSON, in the file's metadata)
    fingerprint.json        the environment it was made in
    manifest.json           written last: target and template identity, settings, counts

`load_dataset(dir, split)` returns the records of one split; `read_manifest(dir)` the manifest.

A finished dataset does not change under the runs that train on it: `prepare` refuses to write it again
with other settings (a re-split) unless told to (``replace``), and never writes into a training run's
folder (`check_dataset_folder`). Each split's sha256 is in the manifest: a run records it
(`dataset_identity`) and its resume refuses another.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dflashkit import __version__
from dflashkit.atomic import disk_full_said, umask_modes, write_json
from dflashkit.config import SourceSpec, unique_source_labels
from dflashkit.data.chat import encode_chat, template_identity
from dflashkit.data.parallel import TokenizerPool
from dflashkit.data.regenerate import (
    GenerationSettings,
    Job,
    eos_token_ids,
    load_target,
    load_tokenizer,
    read_cache,
    record_id,
    regenerate,
)
from dflashkit.data.self_prompts import SELF_SOURCE, SelfPrompts, write_self_prompts
from dflashkit.data.sources import (
    PromptSet,
    benchmark_questions,
    check_benchmark_overlap,
    load_prompts,
    select_prompts,
    split_prompts,
)
from dflashkit.errors import ConfigError, DataError, DflashkitError
from dflashkit.folders import training_folder
from dflashkit.integrity import file_digest
from dflashkit.runtime import fingerprint

if TYPE_CHECKING:
    from dflashkit.data.generation import Backend

MANIFEST_FILE = "manifest.json"
CACHE_FILE = "generations.jsonl"
GENERATION_FILE = "generation.json"
SPLITS = ("train", "validation")
KIND = "dflashkit-dataset"
SCHEMA = 2  # 2: records carry source, sample and sampling; per-source counts
READABLE_SCHEMAS = (1, 2)  # the split files are the same in both


class PrepareSettings(BaseModel):
    """Everything `prepare_dataset` needs. Unknown keys are errors. The data fields mirror the run
    config's `data` section (`dflashkit.config.DataSection`)."""

    model_config = ConfigDict(extra="forbid")

    out: Path
    target: str = "embedded"  # "embedded" or a transformers folder
    source: str = "chitchat"  # "chitchat", "sharegpt", "mtbench" or a file
    format: Literal["auto", "chat", "sharegpt", "prompts"] = "auto"
    sources: list[SourceSpec] = Field(default_factory=list)  # a mixture; replaces the one-source fields
    _labels = field_validator("sources")(unique_source_labels)
    max_prompts: int | None = Field(1000, ge=1)  # None: every prompt of the source
    val_fraction: float = Field(0.05, ge=0.0, le=1.0)
    max_turns: int | None = Field(None, ge=1)  # user turns kept per conversation; None: all
    samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(1024, ge=1)
    batch_size: int = Field(16, ge=1)  # replies generated at once
    temperature: float = Field(0.0, ge=0.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0  # selection and held-out split; sampling too unless sample_seed is given
    sample_seed: int | None = None  # sampling only (replies, self-written prompts): new samples, same split
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"
    backend: Literal["auto", "slots", "hf"] = "auto"
    servers: list[str] = Field(default_factory=list)  # OpenAI-compatible endpoints; replace the backend
    concurrency: int = Field(64, ge=1)  # requests in flight (all servers together) with --server
    server_timeout_s: float = Field(300.0, gt=0)  # one request's time limit with --server
    server_retries: int = Field(5, ge=0)  # attempts after the first, per request, with --server
    skip_malformed: bool = False
    enable_thinking: bool = False

    @property
    def sampling_seed(self) -> int:
        """The run seed that sampled replies and self-written prompts draw from."""
        return self.seed if self.sample_seed is None else self.sample_seed

    def source_specs(self) -> list[SourceSpec]:
        """The sources to read: the mixture, or the one source the flat fields describe. Weights become
        counts (shares of max_prompts)."""
        if not self.sources:
            if self.source == SELF_SOURCE and self.max_prompts is None:
                raise ConfigError(
                    "source 'self' has the target write as many prompts as max_prompts asks: give a number "
                    "(--max-prompts N, N > 0)"
                )
            try:
                spec = SourceSpec(
                    source=self.source,
                    format=self.format,
                    count=self.max_prompts,
                    max_turns=self.max_turns,
                    samples_per_prompt=self.samples_per_prompt,
                    temperature=self.temperature,
                    top_p=self.top_p,
                )
            except ValidationError as e:  # a rule across the one-source flags (samples with no temperature)
                raise ConfigError(
                    "; ".join(x["msg"].removeprefix("Value error, ") for x in e.errors())
                ) from None
            return [spec]
        weights = [s.weight for s in self.sources if s.weight is not None]
        if weights and self.max_prompts is None:
            raise ConfigError("data.sources gives weights: set data.max_prompts, the total they share")
        total = sum(weights)
        return [
            s.model_copy(update={"count": max(1, round(s.weight / total * self.max_prompts)), "weight": None})
            if s.weight is not None and self.max_prompts is not None
            else s
            for s in self.sources
        ]


def _write_json(path: Path, obj: Any) -> None:
    """Atomically: a crash never leaves half a file."""
    write_json(path, obj, sort_keys=True, ensure_ascii=False)


def _check_generation_identity(path: Path, identity: dict[str, Any]) -> None:
    """The cache in `path`'s folder holds replies made under `identity`, or the folder is new."""
    if not path.is_file():
        _write_json(path, identity)
        return
    recorded = json.loads(path.read_text())
    diffs = []
    for section in sorted(set(recorded) | set(identity)):
        old, new = recorded.get(section, {}), identity.get(section, {})
        diffs += [
            f"{section}.{k}: {old.get(k)!r} vs {new.get(k)!r}"
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)
        ]
    if diffs:
        raise ConfigError(
            f"{path.parent} holds replies generated differently ({'; '.join(diffs)}); use another --out "
            "folder, or delete this one to start over"
        )


def _generation_identity(
    settings: PrepareSettings, target: dict[str, Any], template: dict[str, Any]
) -> dict[str, Any]:
    """What every cached reply depends on (each record also stores its own sampling; the backend, batch
    size and device change speed and bf16 rounding, not the replies' meaning)."""
    return {
        "target": {"hash": target["hash"]},
        "template": template,
        "generation": {
            "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "seed": settings.sampling_seed,
            "dtype": settings.dtype,
        },
    }


def write_split(path: Path, ids: list[str], input_ids: Sequence[Any], loss_masks: Sequence[Any]) -> None:
    """One split as a safetensors file: flat tokens and masks, record offsets, ids in the metadata.
    Records are lists or numpy arrays of token ids and 0/1 masks."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)

    def flat(parts: Sequence[Any], dtype: Any) -> Any:
        return torch.from_numpy(
            np.concatenate([np.asarray(x, dtype=dtype) for x in parts]) if parts else np.zeros(0, dtype)
        )

    tensors = {
        "input_ids": flat(input_ids, np.int32),
        "loss_mask": flat(loss_masks, np.uint8),
        "offsets": offsets,
    }
    tmp = path.with_name(path.name + ".tmp")
    with disk_full_said(path, needed=sum(t.nbytes for t in tensors.values()), tmp=tmp):
        save_file(tensors, str(tmp), metadata={"ids": json.dumps(ids), "schema": str(SCHEMA)})
    umask_modes(tmp)  # safetensors writes it private; a dataset is shared like its manifest
    os.replace(tmp, path)


@dataclass
class SourcePlan:
    """One source's prompts, selected and split, and the records to generate from them."""

    spec: SourceSpec
    counts: dict[str, int]
    train: list[Job]
    validation: list[Job]


def plan_records(settings: PrepareSettings, written: dict[str, PromptSet] | None = None) -> list[SourcePlan]:
    """Read every source, de-duplicate (within a source, and against earlier sources), select (seeded
    shuffle, `count`), split off the held-out prompts per source, and make the records: `samples_per_prompt`
    sampled records per training prompt, one greedy record per held-out prompt (held-out replies are what
    serving at temperature 0 produces, which is what the held-out acceptance length predicts). A selected
    prompt that holds a question of an installed benchmark set (MT-Bench, GSM8K, HumanEval) is refused.
    `written`: the prompts of each `"self"` source by name (`write_self_prompts`), which the target wrote."""
    plans: list[SourcePlan] = []
    seen: set[str] = set()
    questions = benchmark_questions()
    for spec in settings.source_specs():
        if spec.source == SELF_SOURCE:
            if written is None or spec.label not in written:
                raise DflashkitError(f"source {spec.label!r}: the target has not written its prompts yet")
            read = written[spec.label]
        else:
            read = load_prompts(
                spec.source, spec.format, skip_malformed=settings.skip_malformed, max_turns=spec.max_turns
            )
        unique = [p for p in read.prompts if p.id not in seen]
        seen.update(p.id for p in unique)
        # `count` prompts after passing over `skip` (held out first: the skipped ones follow them)
        selected = select_prompts(
            unique, None if spec.count is None else spec.count + spec.skip, settings.seed
        )
        if spec.val_count is not None:  # a fixed held-out set: the first prompts of the seeded order
            validation, train = selected[: spec.val_count], selected[spec.val_count + spec.skip :]
            selected = validation + train  # what this dataset answers (the passed-over prompts are not)
        else:
            val_fraction = settings.val_fraction if spec.val_fraction is None else spec.val_fraction
            train, validation = split_prompts(selected, val_fraction)
        check_benchmark_overlap(spec.label, selected, questions)
        name = spec.label
        plans.append(
            SourcePlan(
                spec=spec,
                counts={
                    **read.counts(),
                    "format": read.format,  # type: ignore[dict-item]
                    "in_earlier_sources": len(read.prompts) - len(unique),
                    "selected": len(selected),
                    **({"passed_over": spec.skip} if spec.skip else {}),
                    "train_prompts": len(train),
                    "validation_prompts": len(validation),
                },
                train=[
                    Job(record_id(p.id, k), p, name, k, spec.temperature, spec.top_p)
                    for p in train
                    for k in range(spec.samples_per_prompt)
                ],
                validation=[Job(p.id, p, name) for p in validation],
            )
        )
    if not any(plan.train or plan.validation for plan in plans):
        sources = ", ".join(f"{p.spec.label} ({p.counts['records']} records read)" for p in plans)
        raise DataError(f"no prompts found in {sources}; check the source")
    return plans


def make_backend(settings: PrepareSettings, model: Any, tokenizer: Any, eos_ids: list[int]) -> Backend:
    """The generation backend the settings ask for ("auto": the slot generator when it supports the
    target's architecture, transformers' generate otherwise)."""
    from dflashkit.data.generator import SlotGenerator, SlotSettings
    from dflashkit.data.hf_generate import HFGenerator
    from dflashkit.target.slot_decoder import check_supported

    if settings.servers:
        from dflashkit.data.server import make_server_backend

        return make_server_backend(
            settings.servers,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            concurrency=settings.concurrency,
            timeout_s=settings.server_timeout_s,
            retries=settings.server_retries,
            enable_thinking=settings.enable_thinking,
        )
    name = settings.backend
    if name == "auto":
        try:
            check_supported(model.config)
            name = "slots"
        except DflashkitError:
            name = "hf"
    if name == "slots":
        slots = SlotSettings(
            slots=settings.batch_size,
            capacity=settings.max_prompt_tokens + settings.max_new_tokens,
            prefill_rows=min(64, settings.batch_size),
        )
        return SlotGenerator.create(model, eos_ids, slots)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return HFGenerator(model, eos_ids, pad_id, settings.batch_size)


# Settings that change how fast a dataset is made, not what it holds: a finished dataset may be made again
# with other values of these (`check_dataset_folder`).
SPEED_SETTINGS = (
    "out",
    "batch_size",
    "device",
    "backend",
    "servers",
    "concurrency",
    "server_timeout_s",
    "server_retries",
)


def check_dataset_folder(settings: PrepareSettings, *, replace: bool = False) -> None:
    """Refuse to write a dataset into a training run's folder, or over a finished dataset made with other
    settings (e.g. another val_fraction: a re-split under the runs that train on it) unless ``replace``."""
    out = Path(settings.out)
    training = training_folder(out)
    if training is not None:
        raise ConfigError(f"{out} is {training}; write the dataset to another --out folder")
    if not (out / MANIFEST_FILE).is_file():
        return
    try:
        made = read_manifest(out).get("settings", {})
    except DataError:
        return  # not a finished dataset: `prepare` writes it as it would a new one
    now = settings.model_dump(mode="json")
    changed = [
        f"{k} {made.get(k)!r} -> {now.get(k)!r}"
        for k in sorted(made)  # a setting added to dflashkit since was at its default
        if k not in SPEED_SETTINGS and made.get(k) != now.get(k)
    ]
    if changed and not replace:
        raise ConfigError(
            f"{out} holds a finished dataset made with other settings ({'; '.join(changed)}); write the new "
            "one to another --out folder, or pass --replace to rewrite this one (runs trained on it then "
            "refuse to resume)"
        )


def dataset_identity(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The content hash (sha256) of each split file of a finished dataset, computed from the files as they
    are now (a file rewritten by hand differs from the one its manifest recorded). None when ``path``
    holds no finished dataset."""
    folder = Path(path)
    try:
        splits = read_manifest(folder)["splits"]
        return {name: file_digest(folder / splits[name]["file"]) for name in SPLITS}
    except (DataError, OSError, KeyError, TypeError):
        return None


def prepare_dataset(
    settings: PrepareSettings,
    *,
    on_flush: Callable[[int, int], None] | None = None,
    progress: bool = True,
    flush_records: int = 1024,
    replace: bool = False,
) -> dict[str, Any]:
    """Build (or resume building) the dataset folder `settings.out`; returns its manifest.
    `on_flush(done, total)` is called each time generated records reach the disk (at least every
    `flush_records` records and every few seconds). ``replace``: a finished dataset made with other
    settings may be rewritten (`check_dataset_folder`)."""
    from dflashkit.target.hf import identity_of_folder  # torch: only when a dataset is built

    out = Path(settings.out)
    check_dataset_folder(settings, replace=replace)
    out.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}  # wall seconds of each stage, for the manifest
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages[stage] = round(now - clock, 3)
        clock = now

    # sources the target writes ("self") are read once the target has written them, after it loads
    writes = [s for s in settings.source_specs() if s.source == SELF_SOURCE]
    plans = [] if writes else plan_records(settings)
    jobs = [j for plan in plans for j in plan.train + plan.validation]
    lap("read_sources")
    with TokenizerPool(load_tokenizer(settings.target)) as pool:
        if writes or len(jobs) >= pool.min_items:  # enough work: the workers start while the target loads
            pool.start()
        model, tokenizer = load_target(
            settings.target,
            dtype=settings.dtype,
            device=settings.device,
            weights=not settings.servers,
            tokenizer=pool.tokenizer,
        )
        lap("load_target")
        target = identity_of_folder(settings.target)
        template = template_identity(tokenizer, settings.enable_thinking)
        _check_generation_identity(out / GENERATION_FILE, _generation_identity(settings, target, template))
        eos_ids = eos_token_ids(model, tokenizer)
        gen = GenerationSettings(
            max_new_tokens=settings.max_new_tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            seed=settings.sampling_seed,
            enable_thinking=settings.enable_thinking,
            flush_records=flush_records,
        )
        backend = make_backend(settings, model, tokenizer, eos_ids)
        lap("start_generator")
        written: dict[
            str, SelfPrompts
        ] = {}  # each "self" source: its prompts and what became of the attempts
        if writes:
            questions = benchmark_questions()
            for spec in writes:
                written[spec.label] = write_self_prompts(
                    spec,
                    out,
                    backend,
                    tokenizer,
                    eos_ids,
                    questions,
                    run_seed=settings.sampling_seed,
                    enable_thinking=settings.enable_thinking,
                    progress=progress,
                )
            plans = plan_records(settings, {k: w.prompts for k, w in written.items()})
            jobs = [j for plan in plans for j in plan.train + plan.validation]
            lap("write_prompts")
        stats = regenerate(
            jobs, backend, tokenizer, out / CACHE_FILE, gen, on_flush=on_flush, progress=progress, pool=pool
        )
        lap("generate")
        # ...its parts: the generator's own run ("generate.backend") and what runs around it
        stages.update({f"generate.{k}": v for k, v in stats.stages.items()})
        cache, _ = read_cache(out / CACHE_FILE)
        lap("read_cache")
        encoded = _encode_records(jobs, cache, settings.enable_thinking, eos_ids, pool)
        lap("encode_records")
        pool_stats = pool.stats()
    counts = dict.fromkeys(
        (
            "prompt_too_long",
            "unsupervised",
            "truncated_replies",
            "unmasked_turns",
            "new_tokens",
            "tokens",
            "supervised_tokens",
        ),
        0,
    )
    splits: dict[str, Any] = {}
    per_source: dict[str, dict[str, Any]] = {p.spec.label: dict(p.counts) for p in plans}
    for label, w in written.items():  # what became of the target's attempts, and where they are kept
        per_source[label].update({**w.counts.as_dict(), "file": w.path.name})
    for name in SPLITS:
        split_jobs = [j for plan in plans for j in (plan.train if name == "train" else plan.validation)]
        ids, input_ids, masks = _collect_split(split_jobs, cache, encoded, counts, per_source, name)
        write_split(out / f"{name}.safetensors", ids, input_ids, masks)
        splits[name] = {
            "file": f"{name}.safetensors",
            "records": len(ids),
            "tokens": sum(len(x) for x in input_ids),
            "supervised_tokens": int(sum(int(m.sum()) for m in masks)),
            "sha256": file_digest(out / f"{name}.safetensors"),  # its identity (`dataset_identity`)
        }
    if splits["train"]["records"] == 0:
        raise DataError(
            f"{out}: no usable training record: of {sum(len(p.train) for p in plans)} training records "
            f"{counts['prompt_too_long']} had prompts longer than max_prompt_tokens="
            f"{settings.max_prompt_tokens} and {counts['unsupervised']} had no assistant token to learn; "
            "raise max_prompt_tokens, or use other prompts"
        )
    lap("write_splits")
    fingerprint.save(fingerprint.collect(), out)

    manifest = {
        "kind": KIND,
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dflashkit_version": __version__,
        "target": target,
        "template": template,
        "settings": settings.model_dump(mode="json"),
        "sources": per_source,
        "counts": {
            "prompts": sum(p.counts["selected"] for p in plans),
            "records": sum(s["records"] for s in splits.values()),
            "generated": stats.generated,
            "cached": stats.cached,
            "torn_lines": stats.torn_lines,
            "skipped": counts["prompt_too_long"] + counts["unsupervised"],
            **counts,
        },
        "splits": splits,
        "stage_seconds": stages,  # this command's stages (generate: of the records not cached before)
        # the tokenizer's worker processes (rendering prompts, encoding records): how many (0: none, the
        # work ran in-process), seconds from their start until all were ready, and seconds waited for that
        "tokenizer_pool": pool_stats,
        "generation": {
            "backend": stats.backend,
            "eos_token_ids": eos_ids,
            "device": str(model.device) if model is not None else "server",
            "new_tokens": stats.new_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "seconds": round(stats.seconds, 3),
            "new_tokens_per_second": round(stats.tokens_per_second, 2),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in stats.extra.items()},
        },
    }
    _write_json(out / MANIFEST_FILE, manifest)
    return manifest


def encode_record(tokenizer: Any, item: tuple[list[dict[str, str]], list[bool], list[int], bool]) -> Any:
    """One record's tokens and loss mask (messages, finished, eos ids, enable_thinking); a
    `TokenizerPool` function."""
    import numpy as np

    messages, finished, eos_ids, enable_thinking = item
    enc = encode_chat(
        tokenizer, messages, enable_thinking=enable_thinking, finished=finished, eos_ids=eos_ids
    )
    # numpy arrays travel back from a worker process as bytes, lists of ints one object at a time
    return EncodedRecord(
        np.asarray(enc.input_ids, dtype=np.int32),
        np.asarray(enc.loss_mask, dtype=np.uint8),
        enc.assistant_turns,
        enc.masked_turns,
    )


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: Any  # numpy int32 [T]
    loss_mask: Any  # numpy uint8 [T]
    assistant_turns: int
    masked_turns: int


def _encode_records(
    jobs: list[Job],
    cache: dict[str, dict[str, Any]],
    enable_thinking: bool,
    eos_ids: list[int],
    pool: TokenizerPool,
) -> dict[str, Any]:
    """The encoding of every generated record, by record id."""
    todo = [cache[j.record_id] for j in jobs if not cache[j.record_id].get("skipped")]
    items = [(r["messages"], r["finished"], eos_ids, enable_thinking) for r in todo]
    return {r["id"]: enc for r, enc in zip(todo, pool.map(encode_record, items), strict=True)}


def _collect_split(
    jobs: list[Job],
    cache: dict[str, dict[str, Any]],
    encoded: dict[str, Any],
    counts: dict[str, int],
    per_source: dict[str, dict[str, Any]],
    split: str,
) -> tuple[list[str], list[Any], list[Any]]:
    ids: list[str] = []
    input_ids: list[Any] = []
    masks: list[Any] = []
    for job in jobs:
        rec = cache[job.record_id]
        if rec.get("skipped"):
            counts[rec["skipped"]] += 1
            continue
        enc = encoded[job.record_id]
        supervised = int(enc.loss_mask.sum())
        if not supervised:
            counts["unsupervised"] += 1
            continue
        counts["truncated_replies"] += sum(not f for f in rec["finished"])
        counts["new_tokens"] += sum(len(r) for r in rec["reply_ids"])
        counts["unmasked_turns"] += enc.assistant_turns - enc.masked_turns
        counts["tokens"] += len(enc.input_ids)
        counts["supervised_tokens"] += supervised
        src = per_source[job.source]
        src[f"{split}_records"] = src.get(f"{split}_records", 0) + 1
        src[f"{split}_tokens"] = src.get(f"{split}_tokens", 0) + len(enc.input_ids)
        ids.append(job.record_id)
        input_ids.append(enc.input_ids)
        masks.append(enc.loss_mask)
    return ids, input_ids, masks


# --- loading ----------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a finished dataset folder (DataError when it is missing or not a dataset)."""
    folder = Path(path)
    file = folder / MANIFEST_FILE
    if not file.is_file():
        hint = (
            "resume it with the same `dflashkit prepare` command"
            if (folder / CACHE_FILE).is_file()
            else "make one with `dflashkit prepare`"
        )
        raise DataError(f"{folder} holds no finished dataset (no {MANIFEST_FILE}); {hint}")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{file}:{e.lineno}: invalid JSON ({e.msg}); run `dflashkit prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise DataError(f"{file} is not a dflashkit dataset manifest")
    if manifest.get("schema") not in READABLE_SCHEMAS:
        raise DataError(
            f"{file} has schema {manifest.get('schema')}, this dflashkit reads {SCHEMA}; prepare it again"
        )
    return manifest


@dataclass(frozen=True)
class TokenizedRecord:
    """One conversation: token ids (LongTensor [T]) and the loss mask (BoolTensor [T], True on the
    assistant's tokens)."""

    id: str
    input_ids: Any
    loss_mask: Any


def load_dataset(
    path: str | os.PathLike[str], split: Literal["train", "validation"] = "train"
) -> list[TokenizedRecord]:
    """The records of one split of a finished dataset folder, in the order they were written."""
    from safetensors import safe_open

    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    folder = Path(path)
    manifest = read_manifest(folder)
    file = folder / manifest["splits"][split]["file"]
    if not file.is_file():
        raise DataError(f"{file} is missing; run `dflashkit prepare` again to rebuild it")
    with safe_open(str(file), framework="pt") as f:
        ids = json.loads(f.metadata()["ids"])
        input_ids = f.get_tensor("input_ids").long()
        loss_mask = f.get_tensor("loss_mask").bool()
        offsets = f.get_tensor("offsets").tolist()
    if len(offsets) != len(ids) + 1 or offsets[-1] != input_ids.numel():
        raise DataError(f"{file} is inconsistent (offsets vs records); run `dflashkit prepare` again")
    return [
        TokenizedRecord(rid, input_ids[offsets[i] : offsets[i + 1]], loss_mask[offsets[i] : offsets[i + 1]])
        for i, rid in enumerate(ids)
    ]


def held_out_prompts_fingerprint(path: str | os.PathLike[str]) -> str | None:
    """A fingerprint of the prompts of a dataset's held-out split: every token of each record the target did
    not write (template, system and user turns), record by record in order. Two datasets that hold out the
    same prompts share it, whatever their replies and training records; None when the folder is no finished
    dataset."""
    import hashlib

    try:
        records = load_dataset(path, "validation")
    except (DataError, OSError, KeyError, ValueError):
        return None
    digest = hashlib.sha256()
    for rec in records:
        digest.update(rec.input_ids[~rec.loss_mask].numpy().astype("<i8").tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def prompt_ids(records: list[TokenizedRecord]) -> list[list[int]]:
    """The prompt of each record as token ids: everything before its first supervised (assistant) token.
    Records without one are left out."""
    out = []
    for rec in records:
        supervised = rec.loss_mask.nonzero()
        if len(supervised):
            out.append(rec.input_ids[: int(supervised[0])].tolist())
    return out

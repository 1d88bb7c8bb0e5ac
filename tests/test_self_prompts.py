"""Source "self": prompts the target writes itself. The user turn opened as the chat template writes it, the
attempts kept or dropped by the rules (unfinished, too short, duplicate, a benchmark question), the file they
are kept in resumed without asking again, and `prepare` end to end with a mixture that holds two such sources."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dflashkit.config import DataSection, SourceSpec
from dflashkit.data.dataset import PrepareSettings, plan_records, prepare_dataset
from dflashkit.data.generation import GenerationStats, Reply
from dflashkit.data.regenerate import load_target
from dflashkit.data.self_prompts import keep_prompts, prompts_file, user_turn_prefix, write_self_prompts
from dflashkit.data.sources import normalise_text
from dflashkit.errors import DflashkitError

TEXTS = [
    " takes a list of numbers and returns their sum.",
    " reverses a string without slicing.",
    "!",  # too short once the seed is short
    " takes a list of numbers and returns their sum.",  # a duplicate of the first
    " checks whether a number is prime.",
    " counts the vowels in a sentence.",
    " merges two sorted lists into one sorted list.",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_target("embedded", weights=False)[1]


class FakeWriter:
    """A backend whose reply depends on the request alone: `TEXTS[seed % 7]`, encoded, then the end token
    (except every fifth seed: cut unfinished). Counts the requests it answered."""

    name = "fake"

    def __init__(self, tok: Any):
        self.tok, self.eos, self.asked = tok, tok.convert_tokens_to_ids("<|im_end|>"), 0

    def run(self, source: Any, *, on_progress: Any = None) -> GenerationStats:
        stats = GenerationStats()
        while batch := source.take(4, idle=True):
            for req in batch:
                ids = self.tok(TEXTS[req.seed % len(TEXTS)], add_special_tokens=False)["input_ids"]
                finished = req.seed % 5 != 0
                ids = ids + [self.eos] if finished else ids
                self.asked += 1
                stats.requests += 1
                stats.new_tokens += len(ids)
                source.complete(req, Reply(ids, finished))
        return stats


def spec(**kw: Any) -> SourceSpec:
    base: dict[str, Any] = {"source": "self", "name": "code", "count": 4, "seeds": ["Write a function that"]}
    return SourceSpec(**{**base, **kw})


def test_the_user_turn_is_opened_as_the_template_writes_it(tok: Any) -> None:
    prefix = user_turn_prefix(tok, enable_thinking=False)
    assert prefix.endswith("<|im_start|>user\n") and prefix.startswith("<|im_start|>system\n")
    full = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert full.startswith(prefix + "Hi there")


def test_attempts_are_kept_by_the_rules_and_resumed_without_asking_again(tok: Any, tmp_path: Path) -> None:
    questions = {
        normalise_text("Write a function that checks whether a number is prime."): ("humaneval", "x")
    }
    writer = FakeWriter(tok)
    s = spec(count=3, suffix="\nAnswer in Python.")
    got = write_self_prompts(s, tmp_path, writer, tok, [writer.eos], questions, progress=False)
    texts = [p.turns[0] for p in got.prompts.prompts]
    assert len(texts) == 3 and all(t.startswith("Write a function that ") for t in texts)
    assert all(t.endswith("\nAnswer in Python.") for t in texts)
    assert len({normalise_text(t) for t in texts}) == 3  # no duplicate kept
    assert not any("prime" in t for t in texts)  # the benchmark question was dropped
    c = got.counts
    assert c.kept == 3 and c.attempts == writer.asked
    assert c.unfinished + c.too_short + c.duplicates + c.benchmark + c.kept <= c.attempts
    lines = [json.loads(x) for x in got.path.read_text().splitlines()]
    assert len(lines) == c.attempts and got.path == prompts_file(tmp_path, s, 0)
    # again: everything comes from the file, nothing is asked
    again = FakeWriter(tok)
    same = write_self_prompts(s, tmp_path, again, tok, [again.eos], questions, progress=False)
    assert again.asked == 0 and [p.turns for p in same.prompts.prompts] == [
        p.turns for p in got.prompts.prompts
    ]
    # a crash after two attempts, in the middle of writing the third: the torn line is cut, and the attempts
    # still needed are asked again, from their own seeds, to the same prompts
    raw = got.path.read_bytes().split(b"\n")
    got.path.write_bytes(b"\n".join(raw[:2]) + b"\n" + raw[2][:20])
    third = FakeWriter(tok)
    redo = write_self_prompts(s, tmp_path, third, tok, [third.eos], questions, progress=False)
    assert third.asked > 0 and [p.id for p in redo.prompts.prompts] == [p.id for p in got.prompts.prompts]


def test_kept_prompts_stop_at_count_and_the_digest_follows_the_settings(tmp_path: Path) -> None:
    attempts = {
        str(k): {"text": f"Prompt number {k} is long enough", "finished": True} for k in range(10)
    } | {
        "10": {"text": "short", "finished": True},
        "11": {"text": "cut off before the end", "finished": False},
    }
    kept, counts = keep_prompts(spec(count=4, seeds=[]), attempts, {})
    assert [p.origin for p in kept] == ["code:0", "code:1", "code:2", "code:3"]
    assert (counts.too_short, counts.unfinished, counts.attempts) == (1, 1, 12)
    a = prompts_file(tmp_path, spec(), 0)
    assert a == prompts_file(tmp_path, spec(suffix="!"), 0)  # the suffix is appended when read
    assert a != prompts_file(tmp_path, spec(seeds=["Other"]), 0) != prompts_file(tmp_path, spec(), 1)


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="settings of source 'self'"):
        SourceSpec(source="chitchat", count=3, seeds=["x"])
    with pytest.raises(ValidationError, match="give count"):
        SourceSpec(source="self")
    with pytest.raises(ValidationError, match="more than once"):
        DataSection(sources=[{"source": "self", "count": 2}, {"source": "self", "count": 3}])
    with pytest.raises(DflashkitError, match="not written its prompts"):
        plan_records(PrepareSettings(out=Path("unused"), sources=[{"source": "self", "count": 2}]))


def test_prepare_with_two_sources_the_target_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixture of a file and two "self" sources: each writes its prompts into the dataset folder, the
    manifest says what became of the attempts, records carry the source's name, and a second run generates
    nothing."""
    from dflashkit.data import dataset

    monkeypatch.setattr(dataset, "make_backend", lambda settings, model, tok, eos: FakeWriter(tok))
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is the capital of France?\nName three colours.\nSay hello in Spanish.\n")
    mixture = [
        {"source": str(prompts), "name": "file", "count": 3, "val_count": 1},
        {"source": "self", "name": "code", "count": 3, "val_count": 1, "seeds": ["Write a function that"]},
        {
            "source": "self",
            "name": "maths",
            "count": 2,
            "seeds": ["A bakery"],
            "suffix": "\nReason step by step.",
            "samples_per_prompt": 2,
            "temperature": 0.7,
        },
    ]
    st = PrepareSettings(
        out=tmp_path / "d", sources=mixture, max_new_tokens=8, batch_size=4, dtype="float32", device="cpu"
    )
    manifest = prepare_dataset(st, progress=False)
    src = manifest["sources"]
    assert set(src) == {"file", "code", "maths"}
    assert src["code"]["self_kept"] == 3 and src["code"]["validation_prompts"] == 1
    assert src["maths"]["train_records"] == 2 * src["maths"]["train_prompts"]
    assert (tmp_path / "d" / src["code"]["file"]).is_file()
    records = [json.loads(x) for x in (tmp_path / "d" / "generations.jsonl").read_text().splitlines()]
    assert {r["source"] for r in records} == {"file", "code", "maths"}
    maths = [r for r in records if r["source"] == "maths"]
    assert maths and all(r["messages"][-2]["content"].endswith("\nReason step by step.") for r in maths)
    again = prepare_dataset(st, progress=False)
    assert again["counts"]["generated"] == 0 and again["sources"]["code"]["self_new_tokens"] == 0


def test_one_source_flags_end_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`prepare --source self` needs a number of prompts; a rule across the one-source flags is one line,
    not a traceback."""
    from dflashkit.cli import main

    assert main(["prepare", "--source", "self", "--max-prompts", "0", "--out", str(tmp_path / "a")]) == 2
    assert "give a number (--max-prompts N" in capsys.readouterr().err
    assert (
        main(["prepare", "--source", "chitchat", "--samples-per-prompt", "2", "--out", str(tmp_path / "b")])
        == 2
    )
    err = capsys.readouterr().err
    assert "set a temperature" in err and "Traceback" not in err

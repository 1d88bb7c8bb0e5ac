"""The house's measures, counted from the checkout and written to benchmarks/results/house.json:

    python benchmarks/house.py            # prints them and writes the file
    python benchmarks/house.py --check    # prints them; exit 1 where a process word is left (names file:line)

- ``readme_lines``: lines of README.md;
- ``process_word_lines``: lines of tracked text (and tracked file names) that name a measurement or a plan by an
  ordinal of the work period that made it instead of its date, device and commit (``process_words``, the scan
  ``tests/test_house.py`` runs);
- ``engines``: the decode engines, ``dflashkit.infer.engine.ENGINES``;
- ``src_lines``: lines of every file ``git ls-files src`` lists;
- ``configs``: the ready configs, ``configs/*.yaml``;
- ``benchmark_scripts``: the scripts in benchmarks/ that measure (``report.py``, their helper, and this file left
  out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "house.json"
NOT_MEASURING = {"report.py", "house.py"}

_UNITS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
_ORDINALS = [
    *_UNITS,
    *["tenth", "eleventh", "twelfth", "twentieth", "thirtieth", "fortieth", "fiftieth"],
    r"[a-z]+teenth",
    *(f"{tens}-{unit}" for tens in ("twenty", "thirty", "forty", "fifty") for unit in _UNITS),
]
# an ordinal before "session(s)", also across a line break and a comment's marker
ORDINAL_SESSION = re.compile(rf"\b(?:{'|'.join(_ORDINALS)})(?:-|[ \t]*\n?[ \t#*/>]*)sessions?\b", re.I)
# a file named by the work period that made it: its name ending in "-s" and the period's number (and a letter)
PERIOD_SUFFIX = re.compile(r"[A-Za-z0-9_}]-s[0-9]{1,3}[a-z]?(?=[.\-_/{}(),;:`'\"\s]|$)")
BINARY = (".png", ".safetensors", ".gguf", ".pt", ".bin", ".whl", ".gz", ".zip")


def tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if f]


def read_text(name: str) -> str | None:
    """A tracked file's text; None for a binary file or one the checkout lacks."""
    path = ROOT / name
    if name.endswith(BINARY) or not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def process_words(name: str, text: str) -> list[str]:
    """`name:line: words` for every process ordinal in one file's text."""
    found = []
    for pattern in (ORDINAL_SESSION, PERIOD_SUFFIX):
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{name}:{line}: {m.group(0).strip()!r}")
    return found


def tracked_process_words() -> list[str]:
    """Every process word of the checkout: in a tracked file's name, or in its text."""
    files = tracked()
    found = [f"{name}: its name" for name in files if PERIOD_SUFFIX.search(Path(name).name)]
    for name in files:
        text = read_text(name)
        if text is not None:
            found += process_words(name, text)
    return found


def count_lines(names: list[str]) -> int:
    return sum(len(text.splitlines()) for text in map(read_text, names) if text is not None)


def measure() -> dict[str, int]:
    sys.path.insert(0, str(ROOT / "src"))
    from dflashkit.infer.engine import ENGINES

    words = tracked_process_words()
    return {
        "readme_lines": count_lines(["README.md"]),
        "process_word_lines": len({w.rsplit(": ", 1)[0] for w in words}),
        "engines": len(ENGINES),
        "src_lines": count_lines(tracked("src")),
        "configs": len([f for f in tracked("configs") if f.endswith(".yaml")]),
        "benchmark_scripts": len(
            [
                f
                for f in tracked("benchmarks")
                if f.count("/") == 1 and f.endswith((".py", ".sh")) and Path(f).name not in NOT_MEASURING
            ]
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a process word is left")
    args = ap.parse_args()
    counts = measure()
    print(json.dumps(counts, indent=2))
    if args.check:
        words = tracked_process_words()
        print("\n".join(words[:50]))
        return 1 if words else 0
    tmp = OUT.with_name(OUT.name + ".tmp")
    tmp.write_text(json.dumps(counts, indent=2) + "\n")
    os.replace(tmp, OUT)  # atomic: a reader sees the old file or the new one
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

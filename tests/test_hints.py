"""Hints name only options the command has: every message in src/ that names a `--option` either names
its command (`dflashkit CMD ... --option`: that command's parser has it) or sits in a module that only
some commands reach, each of which has the option."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from dflashkit.cli import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "dflashkit"
OPTION = re.compile(r"(?<![\w/-])(--[a-z][a-z0-9-]*)")
NAMED = re.compile(r"dflashkit (\w+)\b([^`'\"]*)")

# The commands whose code reaches a module (a path prefix) or one of its functions (path::function), the
# most specific key winning: a bare --option in one of its messages must be an option of each of them.
REACHED_BY = {
    "data/": ("prepare",),
    "data/sources.py": ("prepare", "eval", "bench"),
    "data/features.py": ("capture",),
    "data/rows.py": ("train", "capture"),
    "train/": ("train",),
    "train/fanout.py": ("fanout",),
    "infer/": ("eval", "generate", "bench"),
    "infer/bench.py": ("bench",),
    "target/slot_decoder.py": ("prepare",),
    "target/kernels.py": ("eval", "generate", "bench"),
    "target/hf.py::default_mask_token_id": ("init", "train"),
    "model/checkpoint.py": ("init", "convert"),
    "runtime/doctor.py": ("doctor",),
    "runtime/checks.py": ("doctor",),
    "attention/checks.py": ("doctor",),
}
# Not dflashkit's options: other tools' command lines quoted in a message.
FOREIGN = ("pip ", "torchrun", "nvidia-smi", "uv ", "llama.cpp", "vLLM", "SGLang")


def _options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


def _messages(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, text) of each string of a module, an f-string's literal parts joined;
    help= texts and argv elements (a string that is one option) left out."""
    tree = ast.parse(source)
    skip = set()
    owner: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            skip |= {id(kw.value) for kw in node.keywords if kw.arg in ("help", "description", "epilog")}
        if isinstance(node, ast.JoinedStr):
            skip |= {id(v) for v in node.values}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):  # outer functions come first: the innermost one is kept
                owner[id(inner)] = node.name
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if OPTION.fullmatch(text.split("=")[0]) or any(f in text for f in FOREIGN):
            continue
        out.append((node.lineno, owner.get(id(node), ""), text))
    return out


def _hints_of(rel: str, source: str) -> list[tuple[int, str, tuple[str, ...], str]]:
    """(line, option, the commands that must have it, text) of every option a module's messages name."""
    found = []
    for line, function, text in _messages(source):
        keys = [k for k in REACHED_BY if rel.startswith(k) or k == f"{rel}::{function}"]
        reach = REACHED_BY[max(keys, key=len)] if keys else ()
        named_spans = []
        for m in NAMED.finditer(text):
            named_spans.append((m.start(), m.end()))
            found += [(line, opt, (m.group(1),), text) for opt in OPTION.findall(m.group(2))]
        for m in OPTION.finditer(text):
            if not any(a <= m.start() < b for a, b in named_spans):
                found.append((line, m.group(1), reach, text))
    return found


def _wrong(rel: str, source: str) -> list[str]:
    options = _options()
    everything = set().union(*options.values())
    wrong = []
    for line, opt, commands, text in _hints_of(rel, source):
        if not commands:  # a module every command may reach: the option must be some command's
            if opt not in everything:
                wrong.append(f"{rel}:{line}: {opt} is no command's option: {text!r}")
            continue
        lacking = [c for c in commands if c not in options or opt not in options[c]]
        if lacking:
            wrong.append(f"{rel}:{line}: dflashkit {'/'.join(lacking)} has no {opt}: {text!r}")
    return wrong


def test_every_hint_names_an_option_its_commands_have():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not (rel.startswith("commands/") or rel in ("cli.py", "__main__.py")):  # not the parsers
            wrong += _wrong(rel, path.read_text())
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("rel", "source", "said"),
    [
        (
            "data/sources.py",
            'def detect_format(path):\n    raise DataError(f"{path}: pass --format chat|sharegpt|prompts")\n',
            "dflashkit eval/bench has no --format",
        ),
        (
            "target/hf.py",
            'def default_mask_token_id(folder):\n    raise ConfigError(f"{folder}: pass --mask-token-id")\n',
            "dflashkit train has no --mask-token-id",
        ),
        ("train/plan.py", 'X = "see dflashkit eval --format"\n', "dflashkit eval has no --format"),
    ],
)
def test_the_walk_finds_the_hints_once_shown(rel, source, said):
    """The hints users met (eval's --format, train's --mask-token-id) are what the walk refuses."""
    assert any(said in w for w in _wrong(rel, source))

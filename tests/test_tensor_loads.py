"""Every torch.load in benchmarks/ and src/ reads tensors only (weights_only=True): a file handed on the
command line can never run code. benchmarks/tree_policy.py is being removed and is left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = {"benchmarks/tree_policy.py"}


def _unsafe_loads(source: str) -> list[int]:
    """Lines of torch.load(...) calls without weights_only=True."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "load" or not (
            isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
        ):
            continue
        safe = any(
            kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
            for kw in node.keywords
        )
        if not safe:
            lines.append(node.lineno)
    return lines


def test_every_torch_load_reads_tensors_only() -> None:
    unsafe = []
    for path in sorted([*ROOT.joinpath("benchmarks").rglob("*.py"), *ROOT.joinpath("src").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in LEFT_OUT:
            unsafe += [f"{rel}:{line}" for line in _unsafe_loads(path.read_text())]
    assert not unsafe, f"torch.load without weights_only=True: {', '.join(unsafe)}"


def test_the_scan_finds_an_unsafe_load() -> None:
    assert _unsafe_loads("import torch\nx = torch.load(p, weights_only=False)\ny = torch.load(p)\n") == [2, 3]
    assert _unsafe_loads("import torch\nx = torch.load(p, map_location='cpu', weights_only=True)\n") == []

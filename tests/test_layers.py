"""Dependencies run one way: every import in src/dflashkit, those inside functions included, goes to a
lower layer (or within its own package, or to the base modules every layer may use).

    cli (cli.py, __main__.py, each package's commands.py / *_commands.py)
    (within train: the trainer is imported only by the fan-out, the fan-out by nothing but the CLI)
    train | infer          (independent of each other)
    data
    model | target         (independent of each other)
    attention
    runtime
    base: dflashkit/__init__.py, errors.py, atomic.py, integrity.py, config.py
"""

import ast
from pathlib import Path

import dflashkit

ROOT = Path(dflashkit.__file__).parent
BASE = {"dflashkit", "dflashkit.errors", "dflashkit.atomic", "dflashkit.integrity", "dflashkit.config"}
# (package, layer): higher layers may import lower ones; packages of one layer are independent.
LAYERS = {
    "runtime": 1,
    "attention": 2,
    "model": 3,
    "target": 3,
    "data": 4,
    "train": 5,
    "infer": 5,
}
CLI = 6
# Within a package, the modules that drive the others: who may import them (besides the CLI).
DRIVERS = {
    "dflashkit.train.trainer": {"dflashkit.train.fanout"},  # the loop: only the fan-out reuses it
    "dflashkit.train.fanout": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def place(module: str) -> tuple[int, str]:
    """(layer, package) of a dflashkit module."""
    if module in BASE:
        return 0, "base"
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in ("cli", "__main__"):
        return CLI, "cli"
    if parts[-1] == "commands" or parts[-1].endswith("_commands"):
        return CLI, "cli"
    return LAYERS[parts[1]], parts[1]


def is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every dflashkit import in a module, at any depth: `import`, `from ... import`
    (a name that is itself a module counts as that module), and `importlib.import_module("...")`."""
    found = []
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("dflashkit")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("dflashkit"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if is_module(sub) else base))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            arg = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name == "import_module" and isinstance(arg, str) and arg.startswith("dflashkit"):
                found.append((node.lineno, arg))
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        layer, package = place(module)
        tree = ast.parse(path.read_text())
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            to_layer, to_package = place(target)
            if target in DRIVERS and module not in DRIVERS[target] and layer != CLI and module != target:
                where = f"{path.relative_to(ROOT.parent)}:{line}"
                bad.append(f"{where}: {module} imports {target}, which drives it (only the CLI may)")
                continue
            if to_package == package or to_layer == 0:
                continue
            if layer == 0 or to_layer >= layer:
                where = f"{path.relative_to(ROOT.parent)}:{line}"
                bad.append(
                    f"{where}: {module} (layer {layer}, {package}) imports {target} (layer {to_layer})"
                )
    return bad


def test_dependencies_run_upward_only():
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse(
        "def f():\n    from dflashkit.train import trainer\n"
        "def g():\n    import importlib\n    importlib.import_module('dflashkit.attention.checks')\n"
    )
    assert imported_modules(tree, "dflashkit.runtime.x") == [
        (2, "dflashkit.train.trainer"),
        (5, "dflashkit.attention.checks"),
    ]
    relative = ast.parse("def f():\n    from ..train import trainer\n    from .compile import COMPILE_LOCK\n")
    assert imported_modules(relative, "dflashkit.runtime.x") == [
        (2, "dflashkit.train.trainer"),
        (3, "dflashkit.runtime.compile"),
    ]
    assert place("dflashkit.data.commands") == (CLI, "cli") and place("dflashkit.config") == (0, "base")
    assert place("dflashkit.model.drafter")[0] == place("dflashkit.target.hf")[0]  # siblings: independent

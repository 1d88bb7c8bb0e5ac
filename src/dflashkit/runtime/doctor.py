"""`dflashkit doctor`: show the fingerprint, diff two of them, run the self-checks."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashkit.runtime import fingerprint
from dflashkit.runtime.checks import known_issues, run_checks

SECTIONS = ("python", "platform", "torch", "gpu", "packages", "package_set", "inductor_cache", "env")


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) if v else "-"
    return "-" if v is None or v == "" else str(v)


def show(fp: dict[str, Any], console: Console) -> None:
    table = Table(title="dflashkit doctor: environment fingerprint", show_lines=False)
    table.add_column("section", style="cyan")
    table.add_column("entry")
    table.add_column("value", overflow="fold")
    for section in SECTIONS:
        values = fp.get(section) or {}
        if not values:
            table.add_row(section, "-", "(none set)" if section == "env" else "-")
            continue
        for i, (k, v) in enumerate(values.items()):
            style = (
                "bold"
                if fingerprint.flatten({section: {k: v}}).keys() & set(fingerprint.CRITICAL_KEYS)
                else ""
            )
            table.add_row(section if i == 0 else "", k, f"[{style}]{_fmt(v)}[/]" if style else _fmt(v))
    console.print(table)


def show_brief(fp: dict[str, Any], console: Console) -> None:
    t, g = fp["torch"], fp["gpu"]
    gpus = f"{g['count']} x {g['names'][0]}" if g["count"] else "no GPU"
    console.print(
        f"torch {t['version']} (git {str(t['git_version'])[:12]}, cuda {t['cuda']}), {gpus}, "
        f"inductor cache {fp['inductor_cache']['state']}, packages {fp['package_set']['hash']}"
    )


def write_json(fp: dict[str, Any], dest: str) -> None:
    if dest == "-":
        sys.stdout.write(json.dumps(fp, indent=2, sort_keys=True) + "\n")
    else:
        path = fingerprint.save(fp, dest)
        Console(stderr=True).print(f"fingerprint written to {path}")


def show_diff(a_path: str, b_path: str, console: Console) -> int:
    """Print what changed from A to B; 1 when a critical entry differs, else 0."""
    a, b = fingerprint.load(a_path), fingerprint.load(b_path)
    changes = fingerprint.diff(a, b)
    if not changes:
        console.print(f"[green]identical environments[/] ({a_path} vs {b_path})")
        return 0
    return show_diff_changes(changes, a_path, b_path, console)


def show_diff_changes(changes: list[fingerprint.Change], a_name: str, b_name: str, console: Console) -> int:
    table = Table(title=f"environment diff: {a_name} -> {b_name}")
    table.add_column("", width=8)
    table.add_column("entry", style="cyan")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    for c in changes:
        mark = "[bold red]CRITICAL[/]" if c.critical else ""
        table.add_row(mark, c.key, _fmt(c.old), _fmt(c.new))
    console.print(table)
    critical = [c.key for c in changes if c.critical]
    if critical:
        console.print(
            f"[bold red]critical change:[/] {', '.join(critical)} (compiled kernels and caches may differ)"
        )
        return 1
    console.print(f"{len(changes)} non-critical change(s)")
    return 0


def run_check(console: Console) -> int:
    """Self-tests and the known-issues table; 1 when a self-test fails."""
    results = run_checks()
    table = Table(title="dflashkit doctor --check")
    table.add_column("check", style="cyan")
    table.add_column("result")
    table.add_column("time", justify="right")
    table.add_column("detail", overflow="fold")
    for r in results:
        status = "[yellow]SKIP[/]" if r.skipped else ("[green]PASS[/]" if r.ok else "[bold red]FAIL[/]")
        table.add_row(r.name, status, f"{r.seconds:.1f}s", r.detail)
    console.print(table)

    issues = Table(title="known issues (read off the installed torch)")
    issues.add_column("issue", style="cyan")
    issues.add_column("present")
    issues.add_column("evidence", overflow="fold")
    issues.add_column("what dflashkit does / what to do", overflow="fold")
    for k in known_issues():
        present = "[yellow]yes[/]" if k.present else ("no" if k.present is False else "?")
        issues.add_row(k.name, present, k.detail, k.advice)
    console.print(issues)
    failed = [r.name for r in results if not r.ok]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed:[/] {', '.join(failed)}")
        return 1
    console.print(f"[green]all {len(results)} checks passed[/]")
    return 0

"""What benchmark scripts share: their full results as JSON in $OUT/<name> (the GPU tool fetches $OUT), and
the child process each repetition runs in (fresh process, its result on one `RESULT {json}` line)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULT_PREFIX = "RESULT "


def write_report(name: str, report: Any, out_dir: str | Path | None = None) -> Path | None:
    """Write `report` as JSON to out_dir/name (a script's --out), else to $OUT/name when OUT is set; return
    the path (None when neither is given)."""
    out_dir = out_dir or os.environ.get("OUT")
    if not out_dir:
        return None
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return path


def write_json(path: Path | None, result: Any) -> None:
    """Write ``result`` as JSON to ``path`` (a script's --out file), its folder made; nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def fill_defaults(args: Any, defaults: dict[str, Any]) -> None:
    """Set each argument the command line left as None to its default (drivers' defaults differ in --smoke)."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def print_result(result: Any) -> None:
    """A child's result, the one line its driver reads."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(cmd: list[str], env: dict[str, str], timeout_s: float) -> dict:
    """Run one child; its last RESULT line, or {"errors": {"process": why}} when it printed none."""
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"errors": {"process": f"timed out after {timeout_s} s"}}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"errors": {"process": f"exit {p.returncode}: {tail[:200]}"}}

"""Where benchmark scripts leave their full results: $OUT/<name> as JSON (the GPU tool fetches $OUT)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(name: str, report: Any) -> Path | None:
    """Write `report` as JSON to $OUT/name when OUT is set; return the path (None without OUT)."""
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return None
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return path

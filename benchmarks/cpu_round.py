"""The speculative round on the CPU, before and after a change, side by side in one run.

Runs `dflashkit eval --prompts validation --dtype bfloat16` (speculative and autoregressive decoding of the
same held-out prompts on the same engine; `--prompts mtbench` for MT-Bench, no dataset needed) from two
checkouts, BEFORE (a commit, checked out into a temporary worktree) and this checkout, one right after the
other on each engine of `--engines`. A round's cost in autoregressive tokens is tau / speedup, i.e. how many one-token target steps
one draft + verify round costs. Prints a table and writes cpu_round.json to --out; with --update-results it
also writes the best round cost of this checkout into benchmarks/results/decode_steps.json
(``cpu_round_cost_ar_tokens``, the decode-engine issue's key).

    python benchmarks/cpu_round.py --drafter runs/embedded/best --data runs/embedded/data --out /tmp/cpu-round
    python benchmarks/cpu_round.py ... --before d65d31d~1 --max-prompts 16 --update-results
    python benchmarks/cpu_round.py --drafter benchmarks/drafters/embedded-gpu-more --prompts mtbench \
        --before HEAD~1 --engines graphs --max-prompts 4 --out /tmp/cpu-round

Timings are wall-clock on a shared machine: run it on an idle one (`uptime`), and read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "decode_steps.json"


def checkout(commit: str, into: Path) -> Path:
    """A detached worktree of ``commit``: its src/ folder."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(into), commit], check=True
    )
    return into / "src"


def run_eval(src: Path, engine: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One `dflashkit eval` from the checkout whose sources are ``src``; its eval.json plus wall seconds."""
    cmd = [sys.executable, "-m", "dflashkit.cli", "eval", "--drafter", args.drafter]
    cmd += ["--data", args.data] if args.data else []
    cmd += ["--prompts", args.prompts, "--dtype", "bfloat16", "--engine", engine]
    cmd += [
        "--max-prompts",
        str(args.max_prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise SystemExit(f"eval from {src} on the {engine} engine failed:\n{tail}")
    report = json.loads((out / "eval.json").read_text())
    return {**report, "wall_seconds": seconds}


def row(name: str, commit: str, engine: str, report: dict[str, Any]) -> dict[str, Any]:
    tau, speedup = report["mean_acceptance_length"], report["speedup"]
    return {
        "variant": name,
        "commit": commit,
        "engine": engine,
        "prompts": report["prompts"],
        "tau": tau,
        "ar_tok_s": report["ar_tokens_per_second"],
        "spec_tok_s": report["spec_tokens_per_second"],
        "speedup": speedup,
        "round_cost_ar_tokens": tau / speedup if speedup else None,
        "wall_seconds": round(report["wall_seconds"], 1),
    }


def head_commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="drafter checkpoint folder (e.g. runs/embedded/best)")
    ap.add_argument("--data", help="its dataset folder (the held-out prompts of --prompts validation)")
    ap.add_argument("--prompts", default="validation", help="eval's --prompts: validation, mtbench or a file")
    ap.add_argument("--engines", default="dynamic,graphs", help="engines, each run before and after")
    ap.add_argument(
        "--before",
        default="d65d31d~1",
        help="commit of the 'before' row (default: before the head fix; none: no before row)",
    )
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True, help="folder for cpu_round.json and each eval's output")
    ap.add_argument(
        "--update-results", action="store_true", help="write cpu_round_cost_ar_tokens into " + str(RESULTS)
    )
    args = ap.parse_args()
    if args.prompts == "validation" and not args.data:
        ap.error("--prompts validation reads the held-out split of --data: give --data, or --prompts mtbench")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    here = head_commit()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout(args.before, Path(tmp) / "before") if args.before != "none" else None
        plan = []
        for engine in args.engines.split(","):
            if before is not None:
                plan.append(("before", args.before, before, engine))
            plan.append(("after", here, ROOT / "src", engine))
        try:
            for name, commit, src, engine in plan:
                print(f"eval: {name} ({commit}), {engine} engine ...", flush=True)
                report = run_eval(src, engine, args, out / f"{name}-{engine}")
                rows.append(row(name, commit, engine, report))
        finally:
            if before is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "before")]
                )
    print("\n| variant | engine | prompts | tau | AR tok/s | spec tok/s | speedup | round cost (AR tokens) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} ({r['commit']}) | {r['engine']} | {r['prompts']} | {r['tau']:.2f} | {r['ar_tok_s']:.1f} "
            f"| {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['round_cost_ar_tokens']:.2f} |"
        )
    after = [r for r in rows if r["variant"] == "after" and r["round_cost_ar_tokens"] is not None]
    best = min(after, key=lambda r: r["round_cost_ar_tokens"])
    result = {
        "command": "python benchmarks/cpu_round.py " + " ".join(sys.argv[1:]),
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "rows": rows,
        "cpu_round_cost_ar_tokens": best["round_cost_ar_tokens"],
        "cpu_round_engine": best["engine"],
        "time": time.time(),
    }
    (out / "cpu_round.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nbest round of this checkout: {best['round_cost_ar_tokens']:.2f} AR tokens ({best['engine']} engine)"
    )
    if args.update_results:
        results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        results["cpu_round_cost_ar_tokens"] = best["round_cost_ar_tokens"]
        results["cpu_round"] = {k: result[k] for k in ("command", "rows", "cpu_round_engine")}
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote cpu_round_cost_ar_tokens into {RESULTS}")


if __name__ == "__main__":
    main()

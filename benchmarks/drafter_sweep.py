"""Recipe sweep: train drafter variants on one dataset and compare their held-out served tau.

The variants are the `fanout.variants` of a config (configs/embedded-gpu-sweep.yaml: drafter depth 1/2/3,
block size 8 vs 16, loss decay gamma, learning rate; each a set of dotted overrides of the base config). They
train through the fan-out (`dflashkit fanout`: one target pass per micro-batch for all of them, as threads of
one process) or one after another (`--mode sequential`: `dflashkit train` per variant, the same settings).
For each variant the sweep reads its metrics.jsonl: the held-out served-order acceptance length at every
evaluation (the curve), the best one and its step, and whether it was still improving at the last evaluation
(then more steps may pay). `--bench SETS` also decodes each variant's best checkpoint on those prompt sets
with `dflashkit bench` (T=0) and adds the decoded tau and speedup per set.

Outputs in --out (default: the config's run.out_dir): sweep.json, sweep.md (the table), sweep.png (the
curves); the table is printed, and sweep.json is also written to $OUT when it is set.

    python benchmarks/drafter_sweep.py -c configs/embedded-gpu-sweep.yaml             # GPU: the fan-out, all variants
    python benchmarks/drafter_sweep.py -c configs/embedded-gpu-sweep.yaml --resume    # continue after a time limit
    python benchmarks/drafter_sweep.py -c configs/embedded-gpu-sweep.yaml --variants l1-b16,l2-b16 --group a
    python benchmarks/drafter_sweep.py -c configs/embedded-gpu-sweep.yaml --report-only --bench mtbench,heldout
    python benchmarks/drafter_sweep.py --smoke                                        # CPU: tiny data, 3 variants
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from dflashkit.train.metrics import read_metrics  # noqa: E402
from report import write_report  # noqa: E402

SMOKE_DATA = [
    "--source", "chitchat", "--max-prompts", "16", "--val-fraction", "0.25", "--max-turns", "1",
    "--max-new-tokens", "24", "--batch-size", "16", "--dtype", "float32", "--no-progress",
]  # fmt: skip


def smoke_config(data: Path, out: Path) -> dict[str, Any]:
    """A sweep small enough for a 2-core CPU: the embedded target, three tiny drafters, a few steps."""
    return {
        "target": {"path": "embedded", "dtype": "float32"},
        "data": {"dir": str(data)},
        "drafter": {"layers": 1, "block_size": 4, "num_target_layers": 2},
        "train": {
            "max_steps": 6, "batch_size": 1, "max_len": 128, "num_anchors": 8, "lr": 1.0e-3,
            "chunk_blocks": 8, "log_every": 1, "eval_every": 3, "save_every": 3, "cache_features": True,
        },
        "attention": {"backend": "auto"},
        "run": {"out_dir": str(out)},
        "fanout": {
            "target_device": "auto",
            "variants": [
                {"name": "l1-b4"},
                {"name": "l2-b4", "overrides": {"drafter.layers": 2}},
                {"name": "l1-b8", "overrides": {"drafter.block_size": 8, "train.gamma": 3.0}},
            ],
        },
    }  # fmt: skip


STOP_GRACE_S = 120  # after SIGTERM, time for the step under way and its checkpoint before SIGKILL


def dflashkit(*args: str, timeout: float | None = None) -> int:
    """Run one dflashkit command from this checkout (its output shown as it comes); its exit status. At the
    timeout it gets SIGTERM: training ends the step under way and checkpoints it (then --resume continues)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    print("$ dflashkit " + " ".join(args), flush=True)
    code = run_until([sys.executable, "-m", "dflashkit.cli", *args], env, timeout)
    if code == 124:
        print(f"(stopped after {timeout:.0f} s: continue with --resume)", flush=True)
    return code


def run_until(
    cmd: list[str], env: dict[str, str] | None, timeout: float | None, grace: float = STOP_GRACE_S
) -> int:
    """Run ``cmd``; its exit status, or 124 when it ran past ``timeout`` seconds: then it gets SIGTERM and
    ``grace`` seconds to stop (SIGKILL after)."""
    with subprocess.Popen(cmd, env=env) as proc:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
            return 124


# --------------------------------------------------------------------------------------------------
# Configs


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("fanout"), dict)
        or not data["fanout"].get("variants")
    ):
        raise SystemExit(
            f"{path}: a sweep config needs a fanout section with variants (configs/embedded-gpu-sweep.yaml)"
        )
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def pick_variants(cfg: dict[str, Any], names: str | None) -> list[dict[str, Any]]:
    variants = cfg["fanout"]["variants"]
    if not names:
        return variants
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {v["name"] for v in variants}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown variant {', '.join(unknown)}; the config has {', '.join(sorted(known))}")
    return [v for v in variants if v["name"] in wanted]


def variant_config(cfg: dict[str, Any], variant: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The base config with one variant's overrides applied, its fanout section dropped: a single run."""
    one = json.loads(json.dumps({k: v for k, v in cfg.items() if k != "fanout"}))
    for key, value in (variant.get("overrides") or {}).items():
        set_dotted(one, key, value)
    set_dotted(one, "run.out_dir", str(out_dir))
    return one


# --------------------------------------------------------------------------------------------------
# Reading the runs


def served(val: dict[str, Any]) -> float:
    value = val.get("served_acceptance_length", val.get("acceptance_length"))
    return float(value) if value is not None else math.nan


def variant_result(variant: dict[str, Any], folder: Path | None, max_steps: int | None) -> dict[str, Any]:
    """One variant's curve (held-out served-order tau at every evaluation), best point and state."""
    result: dict[str, Any] = {"name": variant["name"], "overrides": variant.get("overrides") or {}}
    if folder is None or not (folder / "metrics.jsonl").is_file():
        return {**result, "status": "not trained", "curve": []}
    records = read_metrics(folder / "metrics.jsonl")
    curve = [
        {
            "step": r["step"],
            "served_tau": served(r["val"]),
            "mean_anchor_tau": r["val"].get("acceptance_length"),
            "val_loss": r["val"].get("loss"),
        }
        for r in records
        if isinstance(r.get("val"), dict)
    ]
    last_step = records[-1]["step"] if records else 0
    status = "error" if (folder / "error.txt").is_file() else "finished"
    if status == "finished" and max_steps is not None and last_step < max_steps:
        status = f"partial ({last_step} of {max_steps} steps)"
    best = max(curve, key=lambda c: c["served_tau"], default=None)
    return {
        **result,
        "folder": str(folder),
        "status": status,
        "steps": last_step,
        "curve": curve,
        "best_served_tau": best["served_tau"] if best else None,
        "best_step": best["step"] if best else None,
        "improving_at_end": bool(best and curve and best["step"] == curve[-1]["step"]),
    }


def find_folder(out: Path, name: str) -> Path | None:
    """A variant's run folder: <out>/<name> (sequential, or the default fan-out group) or <out>/<group>/<name>."""
    found = [p.parent for p in out.glob(f"*/{name}/metrics.jsonl")] + [
        p.parent for p in out.glob(f"{name}/metrics.jsonl")
    ]
    return max(found, key=lambda p: (p / "metrics.jsonl").stat().st_mtime) if found else None


def bench_variant(
    folder: Path, data: str, sets: str, max_prompts: int, max_new_tokens: int, engine: str
) -> dict[str, Any]:
    """Decode a variant's best checkpoint on ``sets`` (T=0) with dflashkit bench; its T=0 summary."""
    out = folder / "bench"
    args = ["bench", "--drafter", str(folder / "best"), "--data", data, "--sets", sets, "--temperatures", "0"]
    args += ["--max-prompts", str(max_prompts), "--max-new-tokens", str(max_new_tokens), "--engine", engine]
    code = dflashkit(*args, "--out", str(out))
    if code != 0 or not (out / "bench.json").is_file():
        return {"error": f"dflashkit bench exited {code}"}
    return json.loads((out / "bench.json").read_text())["summary_t0"]


# --------------------------------------------------------------------------------------------------
# Report


def table_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    sets = sorted({s for r in results for s in (r.get("bench") or {}) if s != "error"})
    head = ["variant", "overrides", "status", "steps", "best served tau", "at step", "improving at end"]
    head += [f"{s} tau / speedup" for s in sets]
    rows = []
    for r in results:
        over = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items()) or "(base)"
        best = r.get("best_served_tau")
        row = [r["name"], over, r["status"], str(r.get("steps", "-")), "-" if best is None else f"{best:.3f}"]
        row += [str(r.get("best_step") or "-"), "yes" if r.get("improving_at_end") else "no"]
        for s in sets:
            b = (r.get("bench") or {}).get(s)
            row.append(f"{b['tau']:.2f} / {b['speedup']:.2f}x" if b and b.get("speedup") else "-")
        rows.append(row)
    return head, rows


def print_table(results: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    head, rows = table_rows(results)
    t = Table(title=title)
    for h in head:
        t.add_column(h, justify="left" if h in ("variant", "overrides", "status") else "right")
    for row in rows:
        t.add_row(*row)
    Console().print(t)


def markdown(results: list[dict[str, Any]], command: str) -> str:
    head, rows = table_rows(results)
    lines = [f"`{command}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    curves = [
        f"- {r['name']}: " + ", ".join(f"{c['step']}: {c['served_tau']:.3f}" for c in r["curve"])
        for r in results
        if r["curve"]
    ]
    return "\n".join(lines + ["", "Held-out served tau by step:", *curves]) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r["curve"]:
            ax.plot(
                [c["step"] for c in r["curve"]], [c["served_tau"] for c in r["curve"]], "o-", label=r["name"]
            )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out acceptance length, served order")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", "-c", type=Path, help="a config with a fanout section (configs/embedded-gpu-sweep.yaml)"
    )
    p.add_argument("--data", help="the dataset folder (default: data.dir of the config)")
    p.add_argument("--out", type=Path, help="sweep folder (default: run.out_dir of the config)")
    p.add_argument(
        "--mode", choices=["fanout", "sequential"], default="fanout", help="how the variants train"
    )
    p.add_argument("--variants", help="a comma-separated subset of the config's variants (default: all)")
    p.add_argument(
        "--group",
        help="fan-out mode: train into OUT/GROUP (a fan-out folder holds one fan-out; give each subset its own)",
    )
    p.add_argument("--resume", action="store_true", help="continue every variant from its newest checkpoint")
    p.add_argument("--report-only", action="store_true", help="train nothing: read what the runs wrote")
    p.add_argument("--timeout", type=float, help="stop training after this many seconds (then --resume)")
    p.add_argument("--bench", metavar="SETS", help="also decode each best checkpoint on these sets (T=0)")
    p.add_argument(
        "--bench-max-prompts", type=int, default=32, metavar="N", help="prompts per bench set (32)"
    )
    p.add_argument("--bench-max-new-tokens", type=int, default=256, metavar="N", help="new tokens (256)")
    p.add_argument(
        "--engine", choices=["dynamic", "static"], default=None, help="bench engine (static on a GPU)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="CPU: a tiny dataset (made here), three tiny variants"
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of the base config")
    args = p.parse_args()

    if args.smoke:
        args.out = args.out or Path("runs/sweep-smoke")
        if not args.data:
            args.data = str(args.out / "data")
            if not (Path(args.data) / "manifest.json").is_file() and dflashkit(
                "prepare", "--out", args.data, *SMOKE_DATA
            ):
                return 1
        cfg = smoke_config(Path(args.data), args.out)
        args.engine = args.engine or "dynamic"
    elif args.config is None:
        p.error("give --config (a config with a fanout section) or --smoke")
    else:
        cfg = load_yaml(args.config)
    for text in args.overrides:
        key, _, value = text.partition("=")
        set_dotted(cfg, key, yaml.safe_load(value))
    if args.data:
        set_dotted(cfg, "data.dir", args.data)
    out = Path(args.out or cfg.get("run", {}).get("out_dir", "runs/sweep"))
    out.mkdir(parents=True, exist_ok=True)
    variants = pick_variants(cfg, args.variants)
    max_steps = cfg.get("train", {}).get("max_steps")
    t0 = time.perf_counter()
    exits: dict[str, int] = {}  # exit status of each training command

    if not args.report_only:
        resume = ["--resume"] if args.resume else []
        if args.mode == "fanout":
            group = out / args.group if args.group else out
            run_cfg = json.loads(json.dumps(cfg))
            run_cfg["fanout"]["variants"] = variants
            set_dotted(run_cfg, "run.out_dir", str(group))
            path = out / f"sweep-{args.group or 'fanout'}.yaml"
            path.write_text(yaml.safe_dump(run_cfg, sort_keys=False))
            exits["fanout"] = dflashkit("fanout", "-c", str(path), *resume, timeout=args.timeout)
        else:
            for v in variants:
                path = out / f"sweep-{v['name']}.yaml"
                path.write_text(yaml.safe_dump(variant_config(cfg, v, out / v["name"]), sort_keys=False))
                left = None if args.timeout is None else max(1.0, args.timeout - (time.perf_counter() - t0))
                exits[v["name"]] = dflashkit("train", "-c", str(path), *resume, timeout=left)

    results = [
        variant_result(
            v, find_folder(out, v["name"]), v.get("overrides", {}).get("train.max_steps", max_steps)
        )
        for v in variants
    ]
    if args.bench:
        import torch

        engine = args.engine or ("static" if torch.cuda.is_available() else "dynamic")
        data = str(cfg["data"]["dir"])
        for r in results:
            if r.get("folder") and (Path(r["folder"]) / "best").is_dir():
                r["bench"] = bench_variant(
                    Path(r["folder"]),
                    data,
                    args.bench,
                    args.bench_max_prompts,
                    args.bench_max_new_tokens,
                    engine,
                )
    command = " ".join(["python", "benchmarks/drafter_sweep.py", *sys.argv[1:]])
    report = {
        "command": command,
        "config": str(args.config) if args.config else "smoke",
        "data": str(cfg["data"]["dir"]),
        "mode": args.mode,
        "seconds": round(time.perf_counter() - t0, 1),
        "training_exit": exits,
        "variants": results,
    }
    (out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "sweep.md").write_text(markdown(results, command))
    plot(results, out / "sweep.png")
    write_report("drafter_sweep.json", report)
    print_table(results, f"drafter sweep on {cfg['data']['dir']} ({args.mode})")
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'} and {out / 'sweep.png'}")
    failed = {k: v for k, v in exits.items() if v != 0}
    if failed:
        print(
            f"training did not finish cleanly ({', '.join(f'{k}: exit {v}' for k, v in failed.items())}): see above"
        )
        return 1
    return 0 if all(r["status"] == "finished" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

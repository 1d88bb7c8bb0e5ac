"""`dflashkit fanout`: train several drafter variants at once from one target (threads of one process)."""

from __future__ import annotations

import argparse
from typing import Any

from dflashkit.config import RunConfig


def run_fanout(cfg: RunConfig, *, resume: bool, dry_run: bool, console: Any, nproc: int | None = None) -> int:
    """Train (or, with dry_run, check) the fan-out of a config; 1 when a drafter did not finish."""
    from dflashkit.errors import ConfigError
    from dflashkit.train.fanout import dry_run_fanout, train_fanout

    if nproc is not None:
        raise ConfigError(
            "this config has a fanout section: its drafters are threads of one process; drop --nproc"
        )
    if dry_run:
        dry_run_fanout(cfg, console)
        return 0
    result = train_fanout(cfg, resume=resume, console=console)
    return 0 if result.ok else 1


def _fanout(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflashkit.config import load_config

    overrides = list(args.overrides)
    if args.allow_env_drift:
        overrides.append("run.allow_env_drift=true")
    if args.out:
        overrides.append(f"run.out_dir={args.out}")
    cfg = load_config(args.config, overrides)
    return run_fanout(cfg, resume=args.resume, dry_run=args.dry_run, console=Console())


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fanout",
        help="train several drafter variants at once from one target (the config's fanout section)",
        description="One target computes each micro-batch's features once; the drafter variants of the "
        "config's fanout section train on them at the same time, as threads (one per device or sharing "
        "one). Results in run.out_dir/<variant>/ and a table comparing the variants in "
        "run.out_dir/fanout.json. Any section.key=value word overrides the base config.",
    )
    p.add_argument("--config", "-c", help="YAML run config with a fanout section (e.g. configs/fanout.yaml)")
    p.add_argument("--out", help="run folder (same as run.out_dir=...); the variants go in its subfolders")
    p.add_argument(
        "--resume", action="store_true", help="continue every variant exactly from its latest checkpoint"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate every variant's config, data, target and drafter"
    )
    p.add_argument(
        "--allow-env-drift",
        action="store_true",
        help="resume even when torch/CUDA/triton/GPU changed since the checkpoints",
    )
    p.set_defaults(handler=_fanout, overrides=[])  # section.key=value words anywhere (cli.main collects them)

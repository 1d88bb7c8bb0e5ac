"""`dflashkit fanout`: train several drafter variants at once from one target (threads of one process)."""

from __future__ import annotations

import argparse
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.train.commands import add_run_arguments


def run_fanout(
    cfg: RunConfig,
    *,
    resume: bool,
    dry_run: bool,
    console: Any,
    nproc: int | None = None,
    move_aside: bool = False,
) -> int:
    """Train (or, with dry_run, check) the fan-out of a config; 1 when a drafter did not finish."""
    from dflashkit.errors import ConfigError
    from dflashkit.train.fanout import dry_run_fanout, train_fanout

    if nproc is not None:
        raise ConfigError(
            "this config has a fanout section: its drafters are threads of one process; drop --nproc"
        )
    if dry_run:
        dry_run_fanout(cfg, console, resume=resume, move_aside=move_aside)
        return 0
    result = train_fanout(cfg, resume=resume, console=console, move_aside=move_aside)
    return 0 if result.ok else 1


def _fanout(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflashkit.train.commands import config_from_args

    return run_fanout(
        config_from_args(args),
        resume=args.resume,
        dry_run=args.dry_run,
        console=Console(),
        move_aside=args.move_aside,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fanout",
        help="train several drafter variants at once from one target (the config's fanout section)",
        description="One target computes each micro-batch's features once; the drafter variants of the "
        "config's fanout section train on them at the same time, as threads (one per device or sharing "
        "one). Results in run.out_dir/<variant>/ and a table comparing the variants in "
        "run.out_dir/fanout.json. Any section.key=value word overrides the base config.",
    )
    add_run_arguments(p, variants=True)
    p.set_defaults(handler=_fanout)

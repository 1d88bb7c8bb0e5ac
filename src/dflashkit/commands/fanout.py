"""`dflashkit fanout`: the earlier name of `dflashkit train` on a config with a fanout section (several drafter
variants at once from one target, threads of one process); kept for one release, and it says so."""

from __future__ import annotations

import argparse

from dflashkit.commands.train import add_run_arguments, config_from_args, run_fanout


def _fanout(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    console.print(
        "[dim]dflashkit fanout is `dflashkit train` on a config with a fanout section; this name goes in the "
        "next release[/]"
    )
    return run_fanout(
        config_from_args(args),
        resume=args.resume,
        dry_run=args.dry_run,
        console=console,
        move_aside=args.move_aside,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fanout",
        help="the earlier name of `train` on a config with a fanout section (kept for one release)",
        description="One target computes each micro-batch's features once; the drafter variants of the "
        "config's fanout section train on them at the same time, as threads (one per device or sharing "
        "one). Results in run.out_dir/<variant>/ and a table comparing the variants in "
        "run.out_dir/fanout.json. Any section.key=value word overrides the base config.",
    )
    add_run_arguments(p, variants=True)
    p.set_defaults(handler=_fanout)

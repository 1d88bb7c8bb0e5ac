"""`dflashkit doctor`: the environment's fingerprint, a diff of two, and the live self-checks."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser("doctor", help="environment fingerprint, diff and self-checks")
    d.add_argument("--json", metavar="PATH", help="write the fingerprint as JSON to PATH ('-' for stdout)")
    d.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="compare two fingerprints (files or run/checkpoint folders); exit 1 on a critical change",
    )
    d.add_argument("--check", action="store_true", help="run live self-tests and show known issues")
    d.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflashkit.attention import checks as attention_checks
    from dflashkit.runtime import doctor, fingerprint

    console = Console()
    if args.diff:
        return doctor.show_diff(args.diff[0], args.diff[1], console)
    fp = fingerprint.collect()
    if args.json:
        doctor.write_json(fp, args.json)
    elif args.check:
        doctor.show_brief(fp, console)
    else:
        doctor.show(fp, console)
    if args.check:
        attention_checks.register()  # the compiled flex_attention and thread-safety self-tests
        return doctor.run_check(Console(stderr=args.json == "-"))
    return 0

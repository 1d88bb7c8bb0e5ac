"""The one `dflashkit` command. Each subcommand's handler imports what it needs lazily, so that
`dflashkit doctor` starts fast and a missing optional piece only affects the command that uses it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from dflashkit import __version__
from dflashkit.errors import DflashkitError

Handler = Callable[[argparse.Namespace], int]


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


def build_parser() -> argparse.ArgumentParser:
    from dflashkit.config import PATHS_RULE

    p = argparse.ArgumentParser(
        prog="dflashkit",
        description="Train, check and run DFlash block-diffusion drafters for speculative decoding.",
        epilog=EXAMPLES + "\n" + wrap(PATHS_RULE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("doctor", help="environment fingerprint, diff and self-checks")
    d.add_argument("--json", metavar="PATH", help="write the fingerprint as JSON to PATH ('-' for stdout)")
    d.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="compare two fingerprints (files or run/checkpoint folders); exit 1 on a critical change",
    )
    d.add_argument("--check", action="store_true", help="run live self-tests and show known issues")
    d.set_defaults(handler=_doctor)

    for register in _extra_commands():
        register(sub)
    return p


EXAMPLES = """\
examples (the embedded default, end to end on a CPU; `make demo` runs these):
  dflashkit doctor --check                                 the environment and live self-checks
  dflashkit prepare -c configs/embedded.yaml               prompts answered by the target: a dataset
  dflashkit train -c configs/embedded.yaml --dry-run       check everything the run needs, train nothing
  dflashkit train -c configs/embedded.yaml                 train a drafter (runs/embedded/best)
  dflashkit eval -c configs/embedded.yaml --prompts validation --check-lossless
  dflashkit generate -c configs/embedded.yaml "Tell me about the sea"

`dflashkit COMMAND --help` shows each command's options and examples.
"""


def wrap(text: str, width: int = 100) -> str:
    import textwrap

    return textwrap.fill(text, width)


def unknown_words_error(command: str, extra: list[str], takes_overrides: bool) -> str:
    """The one line for command-line words no option took: bare words among overrides, unknown options."""
    words = [e for e in extra if not e.startswith("-") and not (takes_overrides and "=" in e)]
    options = [e for e in extra if e.startswith("-")]
    parts = []
    if words:
        shown = " ".join(repr(w) for w in words)
        if takes_overrides:
            parts.append(
                f"{shown} is not an option or an override: overrides are section.key=value (e.g. "
                "train.lr=3e-4 drafter.block_size=16)"
            )
        else:
            parts.append(f"unexpected words {shown}")
    if options:
        parts.append(f"unknown option {' '.join(options)}")
    return f"dflashkit {command}: error: {'; '.join(parts)}; see dflashkit {command} --help"


# Modules that define further subcommands beside the code they drive. Each has
# `register(subparsers)`, which adds its parsers with `set_defaults(handler=...)` and imports heavy
# dependencies only inside the handlers.
COMMAND_MODULES = (
    "dflashkit.model.commands",  # init, convert
    "dflashkit.data.commands",  # prepare, capture
    "dflashkit.train.commands",  # train
    "dflashkit.train.fanout_commands",  # fanout
    "dflashkit.infer.commands",  # eval, generate
)


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    import importlib

    found = []
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that part of the toolkit is not there yet
            raise
        found.append(mod.register)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides (section.key=value) may sit anywhere among a command's options.
    if extra:
        takes_overrides = hasattr(args, "overrides")
        if takes_overrides and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            print(unknown_words_error(args.command, extra, takes_overrides), file=sys.stderr)
            return 2
    handler: Handler = args.handler
    try:
        return handler(args)
    except DflashkitError as e:
        if os.environ.get("DFLASHKIT_TRACEBACK"):
            raise
        print(f"dflashkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflashkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

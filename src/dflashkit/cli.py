"""The one `dflashkit` command: the parser of every subcommand group (`dflashkit.commands`), dotted
overrides anywhere among a command's options, and one clear line for a user's error. Each handler imports
what it needs when it runs, so that `dflashkit doctor` starts fast and a missing optional piece only
affects the command that uses it."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable

from dflashkit import __version__
from dflashkit.atomic import disk_full_error, is_disk_full
from dflashkit.commands import bench, data, doctor, fanout, infer, model, train
from dflashkit.config import PATHS_RULE
from dflashkit.errors import DflashkitError
from dflashkit.lock import release_held

Handler = Callable[[argparse.Namespace], int]
# The subcommand groups (dflashkit.commands), in the order --help lists them.
COMMANDS = (doctor, model, data, train, fanout, infer, bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflashkit",
        description="Train, check and run DFlash block-diffusion drafters for speculative decoding.",
        epilog=EXAMPLES + "\n" + wrap(PATHS_RULE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMANDS:
        group.register(sub)
    return p


EXAMPLES = """\
examples (the embedded default, end to end on a CPU; `make demo` runs these):
  dflashkit doctor --check                                 the environment and live self-checks
  dflashkit prepare -c configs/embedded.yaml               prompts answered by the target: a dataset
  dflashkit train -c configs/embedded.yaml --dry-run       check everything the run needs, train nothing
  dflashkit train -c configs/embedded.yaml                 train a drafter (runs/embedded/best)
  dflashkit bench -c configs/embedded.yaml --sets heldout --temperatures 0 --check-lossless
  dflashkit generate -c configs/embedded.yaml "Tell me about the sea"

`dflashkit COMMAND --help` shows each command's options and examples.
"""


def wrap(text: str, width: int = 100) -> str:
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
    except Exception as e:  # a full disk where no writer said which file: still one line
        if not is_disk_full(e) or os.environ.get("DFLASHKIT_TRACEBACK"):
            raise
        where = getattr(e, "filename", None) or os.getcwd()
        print(f"dflashkit {args.command}: error: {disk_full_error(where)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflashkit {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        release_held()  # the folders the command wrote (`dflashkit.lock`)


if __name__ == "__main__":
    sys.exit(main())

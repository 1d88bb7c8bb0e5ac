"""`dflashkit prepare`: regenerate replies with the target and write a tokenized dataset folder.

The command line only builds `PrepareSettings` and calls `prepare_dataset`; heavy imports happen in
the handler.
"""

from __future__ import annotations

import argparse
from typing import Any

# Command-line flag -> settings field; a flag left out keeps the PrepareSettings default.
_FIELDS = (
    "target",
    "source",
    "format",
    "out",
    "max_prompts",
    "val_fraction",
    "max_turns",
    "max_new_tokens",
    "max_prompt_tokens",
    "batch_size",
    "temperature",
    "top_p",
    "seed",
    "dtype",
    "device",
    "skip_malformed",
    "enable_thinking",
)


def settings_from_args(args: argparse.Namespace) -> Any:
    """PrepareSettings from parsed arguments (ConfigError, one line, when a value is invalid)."""
    from pydantic import ValidationError

    from dflashkit.data.dataset import PrepareSettings
    from dflashkit.errors import ConfigError

    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        from dflashkit.config import load_config

        cfg = load_config(args.config, list(args.overrides))
        values = {"out": cfg.data.dir, "target": cfg.target.path, **cfg.data.model_dump(exclude={"dir"})}
    values.update({k: getattr(args, k) for k in _FIELDS if getattr(args, k, None) is not None})
    if "out" not in values:
        raise ConfigError("name the dataset folder with --out DIR (or give --config)")
    if values.get("max_prompts") == 0:
        values["max_prompts"] = None
    try:
        return PrepareSettings(**values)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"--{where.replace('_', '-')}: {first['msg']}") from None


def _prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dflashkit.data.dataset import prepare_dataset

    settings = settings_from_args(args)
    manifest = prepare_dataset(settings, progress=not args.no_progress)
    counts, gen = manifest["counts"], manifest["generation"]
    table = Table(title=f"dataset {settings.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("target", f"{manifest['target']['name']} ({manifest['target']['model_type']})")
    table.add_row(
        "template",
        f"{manifest['template']['chat_template_sha256'][:12]}  enable_thinking={manifest['template']['enable_thinking']}",
    )
    table.add_row(
        "prompts",
        f"{counts['prompts']} selected of {manifest['source']['prompts']} unique ({manifest['source']['malformed']} malformed skipped, {manifest['source']['duplicates']} duplicates)",
    )
    table.add_row(
        "generated",
        f"{counts['generated']} now, {counts['cached']} from the cache ({counts['torn_lines']} torn lines dropped)",
    )
    table.add_row(
        "skipped",
        f"{counts['prompt_too_long']} prompts too long, {counts['unsupervised']} without assistant tokens",
    )
    for name, split in manifest["splits"].items():
        table.add_row(
            name,
            f"{split['records']} records, {split['tokens']} tokens, {split['supervised_tokens']} supervised",
        )
    table.add_row("truncated", f"{counts['truncated_replies']} replies hit --max-new-tokens")
    if gen["batches"]:
        table.add_row(
            "speed",
            f"{gen['new_tokens_per_second']:.1f} new tokens/s ({gen['device']}, batch {settings.batch_size}, {settings.dtype})",
        )
    Console().print(table)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="regenerate replies with the target and write a tokenized dataset (resumable)",
        description="Read prompts, have the target answer them (batched, cached, resumable), render "
        "each conversation with the target's chat template, and write train/validation records with a "
        "loss mask on the assistant's tokens, a manifest and the environment fingerprint.",
    )
    p.add_argument("--config", "-c", help="run config: its target and data sections give the defaults")
    p.add_argument("--out", help="dataset folder (re-running the same command resumes)")
    p.add_argument("--target", help="'embedded' (default) or a transformers model folder")
    p.add_argument("--source", help="'chitchat' (default), 'mtbench', or a file")
    p.add_argument(
        "--format", choices=("auto", "chat", "sharegpt", "prompts"), help="file format (default auto)"
    )
    p.add_argument("--max-prompts", type=int, metavar="N", help="prompts to select (default 1000; 0 for all)")
    p.add_argument("--val-fraction", type=float, metavar="F", help="held-out fraction (default 0.05)")
    p.add_argument(
        "--max-turns", type=int, metavar="N", help="user turns kept per conversation (default all)"
    )
    p.add_argument("--max-new-tokens", type=int, metavar="M", help="reply length limit (default 256)")
    p.add_argument(
        "--max-prompt-tokens", type=int, metavar="M", help="longer prompts are skipped (default 1024)"
    )
    p.add_argument("--batch-size", type=int, metavar="K", help="prompts per generate call (default 16)")
    p.add_argument("--temperature", type=float, metavar="T", help="0 for greedy (default), else sampling")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--seed", type=int, metavar="S", help="selection, split and sampling seed (default 0)")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="target dtype (default bfloat16)"
    )
    p.add_argument("--device", help="'auto' (default: CUDA when present), 'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--skip-malformed", action="store_true", default=None, help="skip and count bad records")
    p.add_argument(
        "--enable-thinking", action="store_true", default=None, help="render with thinking mode on"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_prepare, overrides=[])  # section.key=value words override the --config

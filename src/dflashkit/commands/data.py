"""`dflashkit prepare`: regenerate replies with the target and write a tokenized dataset folder.
`dflashkit capture`: run the target once over the packed rows and write its features for training.

The command line only builds settings and calls `prepare_dataset` / `capture_features`; heavy
imports happen in the handlers.
"""

from __future__ import annotations

import argparse
from typing import Any

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.commands import values
from dflashkit.config import load_config
from dflashkit.errors import ConfigError
from dflashkit.lock import hold_folder

# Command-line flag -> settings field; a flag left out keeps the PrepareSettings default.
_FIELDS = (
    "target",
    "source",
    "format",
    "out",
    "max_prompts",
    "val_fraction",
    "max_turns",
    "samples_per_prompt",
    "max_new_tokens",
    "max_prompt_tokens",
    "batch_size",
    "temperature",
    "top_p",
    "seed",
    "sample_seed",
    "dtype",
    "device",
    "skip_malformed",
    "enable_thinking",
    "backend",
    "servers",
    "concurrency",
    "server_timeout_s",
    "server_retries",
)


# Flags that describe a single source; a config with a data.sources mixture sets them per source.
_ONE_SOURCE_FIELDS = ("source", "format", "max_turns", "samples_per_prompt", "temperature", "top_p")


def settings_from_args(args: argparse.Namespace) -> Any:
    """PrepareSettings from parsed arguments (ConfigError, one line, when a value is invalid)."""
    from pydantic import ValidationError

    from dflashkit.data.dataset import PrepareSettings

    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        cfg = load_config(args.config, list(args.overrides))
        values = {
            "out": cfg.data.dir,
            "target": cfg.target.path,
            **cfg.data.model_dump(exclude={"dir", "features_dir"}),
        }
    given = {k: getattr(args, k) for k in _FIELDS if getattr(args, k, None) is not None}
    clash = sorted(k for k in given if k in _ONE_SOURCE_FIELDS) if values.get("sources") else []
    if clash:
        flags = ", ".join("--" + k.replace("_", "-") for k in clash)
        raise ConfigError(
            f"the flags {flags} set one source, but the config's data.sources is a mixture; set them per "
            "source in data.sources, or give no --config"
        )
    values.update(given)
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


def longest_prompt_beyond_context(settings: Any) -> str | None:
    """The warning when a prompt up to --max-prompt-tokens and its reply would pass the target's context."""
    from dflashkit.target.context import beyond_context, context_of
    from dflashkit.target.hf import load_target_config

    return beyond_context(
        settings.max_prompt_tokens,
        settings.max_new_tokens,
        context_of(load_target_config(settings.target)),
        "a prompt of up to --max-prompt-tokens",
    )


def _prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dflashkit.data.dataset import prepare_dataset

    settings = settings_from_args(args)
    check_folder_can_be_made(settings.out)  # before the target loads
    hold_folder(settings.out)  # one writer per dataset folder (`dflashkit.lock`)
    warning = longest_prompt_beyond_context(settings)
    if warning:
        Console().print(f"[yellow]{warning}[/]", soft_wrap=True)
    manifest = prepare_dataset(settings, progress=not args.no_progress, replace=args.replace)
    counts, gen = manifest["counts"], manifest["generation"]
    table = Table(title=f"dataset {settings.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("target", f"{manifest['target']['name']} ({manifest['target']['model_type']})")
    table.add_row(
        "template",
        f"{manifest['template']['chat_template_sha256'][:12]}  enable_thinking={manifest['template']['enable_thinking']}",
    )
    for name, src in manifest["sources"].items():
        table.add_row(
            f"source {name}",
            f"{src['selected']} prompts selected of {src['prompts']} unique ({src['malformed']} malformed "
            f"skipped, {src['duplicates']} duplicates): {src.get('train_records', 0)} training records "
            f"({src.get('train_tokens', 0):,} tokens), {src.get('validation_records', 0)} held out",
        )
        if "self_attempts" in src:  # prompts the target wrote
            table.add_row(
                "",
                f"written by the target: {src['self_kept']} kept of {src['self_attempts']} attempts "
                f"({src['self_unfinished']} unfinished, {src['self_too_short']} too short, "
                f"{src['self_duplicates']} duplicates, {src['self_benchmark']} benchmark questions); {src['file']}",
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
    if gen["new_tokens"]:
        table.add_row(
            "speed",
            f"{gen['new_tokens_per_second']:,.0f} new tokens/s ({gen['backend']} on {gen['device']}, "
            f"{settings.batch_size} at once, {settings.dtype}; {gen['new_tokens']:,} tokens in {gen['seconds']:.0f} s)",
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
    p.add_argument(
        "--replace",
        action="store_true",
        help="rewrite a finished dataset in --out made with other settings (runs trained on it then refuse "
        "to resume; without it such a folder is refused)",
    )
    p.add_argument("--target", help="'embedded' (default) or a transformers model folder")
    p.add_argument(
        "--source",
        help="'chitchat' (default), 'sharegpt', 'mtbench', 'self' (prompts the target writes), or a file",
    )
    p.add_argument(
        "--format", choices=("auto", "chat", "sharegpt", "prompts"), help="file format (default auto)"
    )
    p.add_argument(
        "--max-prompts",
        type=values.count_or_all,
        metavar="N",
        help="prompts to select (default 1000; 0 for all)",
    )
    p.add_argument(
        "--val-fraction", type=values.fraction, metavar="F", help="held-out fraction (default 0.05)"
    )
    p.add_argument(
        "--max-turns", type=values.count, metavar="N", help="user turns kept per conversation (default all)"
    )
    p.add_argument(
        "--samples-per-prompt",
        type=values.count,
        metavar="K",
        help="sampled training replies per prompt (default 1; needs --temperature > 0 when above 1)",
    )
    p.add_argument(
        "--max-new-tokens", type=values.count, metavar="M", help="reply length limit (default 256)"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=values.count,
        metavar="M",
        help="longer prompts are skipped (default 1024)",
    )
    p.add_argument(
        "--batch-size",
        type=values.count,
        metavar="K",
        help="replies generated at once (default 16; a GPU takes 512+)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "slots", "hf"),
        help="generator: slots (ours, Llama-family targets), hf (transformers' generate), auto (default)",
    )
    p.add_argument(
        "--server",
        dest="servers",
        action="append",
        metavar="URL",
        help="generate through an OpenAI-compatible server (vLLM, SGLang, llama.cpp); repeat for several",
    )
    p.add_argument(
        "--concurrency", type=values.count, metavar="N", help="requests in flight with --server (default 64)"
    )
    p.add_argument(
        "--server-timeout",
        dest="server_timeout_s",
        type=values.positive,
        metavar="S",
        help="seconds one request may take with --server (default 300)",
    )
    p.add_argument(
        "--server-retries",
        type=values.whole_number,
        metavar="N",
        help="retries per request with --server, with exponential back-off (default 5)",
    )
    p.add_argument(
        "--temperature", type=values.temperature, metavar="T", help="0 for greedy (default), else sampling"
    )
    p.add_argument("--top-p", type=values.top_p, metavar="P", help="nucleus sampling threshold (default 1.0)")
    p.add_argument(
        "--seed", type=values.whole_number, metavar="S", help="selection, split and sampling seed (default 0)"
    )
    p.add_argument(
        "--sample-seed",
        type=values.whole_number,
        metavar="S",
        help="sampling seed alone: new samples of the same prompts, same held-out split (default: --seed)",
    )
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
    register_capture(subparsers)


def _capture(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dflashkit.data.features import CaptureSettings, capture_features, verify_features

    cfg = load_config(args.config, list(args.overrides))
    out = args.out or cfg.data.features_dir
    if not out:
        raise ConfigError("name the feature folder with --out DIR (or data.features_dir=DIR)")
    check_folder_can_be_made(out)
    settings = CaptureSettings(
        out=out,
        dtype=args.dtype,
        shard_mb=args.shard_mb if args.shard_mb is not None else CaptureSettings.shard_mb,
        batch_rows=args.batch_rows,
    )
    console = Console()
    hold_folder(out)  # one writer per feature folder (`dflashkit.lock`)
    m = capture_features(cfg, settings, progress=not args.no_progress, console=console)
    per = m["bytes_per_token"]
    table = Table(title=f"features {out}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "target", f"{m['target']['name']}, layers {m['target_layer_ids']} of {m['target']['num_layers']}"
    )
    table.add_row(
        "stored",
        f"{m['dtype']} [T={m['max_len']}, {m['feature_dim']}] per row, {m['rows_per_shard']} rows per shard",
    )
    for split, info in m["splits"].items():
        table.add_row(
            split,
            f"{info['rows']} rows, {len(info['shards'])} shards, {info['supervised_tokens']} supervised tokens",
        )
    table.add_row(
        "bytes per token",
        f"{per['total']} = features {per['features']} + scale {per['scale']} + last hidden "
        f"{per.get('last_hidden', 0)} + label {per['labels']} + row {per['rows']}",
    )
    table.add_row(
        "size", f"{m['bytes'] / 2**20:.1f} MiB ({m['measured_bytes_per_token']} B per stored token)"
    )
    run = m["run"]
    speed = (
        f", {run['tokens_per_second']:,.0f} tokens/s on {run['device']}" if run["tokens_per_second"] else ""
    )
    table.add_row("this run", f"{run['shards_written']} shards written, {run['shards_kept']} kept{speed}")
    console.print(table)
    if args.verify:
        counts = verify_features(out)
        console.print(
            f"[bold green]verified[/]: {counts['shards']} shards, {counts['rows']} rows (digests, shapes, "
            "finite features, label range, row data)"
        )
    if cfg.data.features_dir != out:
        console.print(f"train from it with data.features_dir={out}")
    return 0


def register_capture(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "capture",
        help="run the target once and write its features for training (sharded, resumable)",
        description="Pack the dataset's training and validation rows exactly as training does, run the "
        "target over them once, and write its context features (target_layer_ids) and argmax labels to "
        "sharded safetensors with a manifest. Train from them with data.features_dir=DIR. Re-running the "
        "same command keeps finished shards and rewrites torn ones.",
    )
    p.add_argument("--config", "-c", help="run config (target, data, drafter layers, train.max_len)")
    p.add_argument("--out", help="feature folder (default: data.features_dir)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float8_e4m3fn"),
        default="bfloat16",
        help="feature storage (default bfloat16; float8_e4m3fn halves it, one scale per token and layer)",
    )
    p.add_argument("--shard-mb", type=values.positive, metavar="MB", help="shard size in MiB (default 2048)")
    p.add_argument(
        "--batch-rows", type=values.count, metavar="K", help="rows per target pass (default train.batch_size)"
    )
    p.add_argument("--verify", action="store_true", help="then re-read every shard and check it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_capture, overrides=[])  # section.key=value words override the --config

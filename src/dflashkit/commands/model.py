"""`dflashkit init` (an untrained drafter for a target), `dflashkit convert` (z-lab <-> speculators) and
`dflashkit check-serving` (what vLLM's and SGLang's DFlash loaders would miss in a folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.commands import values
from dflashkit.errors import ConfigError
from dflashkit.lock import hold_folder


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "init",
        help="write an untrained drafter checkpoint shaped for a target",
        epilog="example:\n  dflashkit init --target embedded --out runs/untrained --layers 1 --block-size 8\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target", default="embedded", help="'embedded' (default) or the path of an HF model folder"
    )
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (z-lab layout)")
    p.add_argument("--layers", type=values.count, default=5, help="draft layers (default 5)")
    p.add_argument(
        "--block-size", type=values.count, default=16, help="slots per block: the anchor + B-1 drafted tokens"
    )
    p.add_argument(
        "--target-layer-ids",
        help="comma-separated target layers to read (default: as many as draft layers, evenly spaced)",
    )
    p.add_argument(
        "--mask-token-id",
        type=values.whole_number,
        help="mask token id (default: chosen from the target's tokenizer)",
    )
    p.add_argument("--seed", type=values.whole_number, default=0, help="seed of the random initial weights")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weight dtype on disk"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --out if it is an existing drafter checkpoint folder (never a training checkpoint or run)",
    )
    p.set_defaults(handler=_init)

    c = sub.add_parser(
        "convert",
        help="convert a drafter checkpoint between the z-lab and speculators layouts",
        description="Rewrite a drafter checkpoint in the other layout, tensors bit for bit; fingerprint.json "
        "and metrics.json come along, and the new folder (with checksums) appears atomically. DST may not "
        "be SRC, hold it, or lie inside it.",
        epilog="examples:\n"
        "  dflashkit convert runs/embedded/best runs/embedded-speculators --to speculators --target embedded\n"
        "  dflashkit convert downloaded-drafter my-drafter --to zlab\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("src", type=Path, help="checkpoint folder to read (either layout)")
    c.add_argument("dst", type=Path, help="checkpoint folder to write")
    c.add_argument("--to", required=True, choices=("zlab", "speculators"), help="layout to write")
    c.add_argument(
        "--target",
        help="'embedded' or an HF model folder: checked against the drafter; for --to speculators its "
        "embed_tokens and lm_head are included",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it is an existing drafter checkpoint folder (never the source, a folder holding "
        "it, a training checkpoint, anything in a run's checkpoints/, or a run folder)",
    )
    c.set_defaults(handler=_convert)

    s = sub.add_parser(
        "check-serving",
        help="name what vLLM's and SGLang's DFlash loaders read that a drafter folder lacks",
        description="Check a drafter folder against the fields vLLM's and SGLang's DFlash loaders read "
        "(docs/serving.md); exits non-zero naming each missing field.",
        epilog="example:\n  dflashkit check-serving runs/embedded-zlab\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("dir", type=Path, help="drafter checkpoint folder (either layout)")
    s.set_defaults(handler=_check_serving)


def _init(args: argparse.Namespace) -> int:
    import torch

    from dflashkit.model.checkpoint import check_destination, save_drafter
    from dflashkit.model.config import config_for_target
    from dflashkit.model.drafter import DFlashDrafter
    from dflashkit.target.hf import (
        default_mask_token_id,
        identity_of_folder,
        load_target_config,
        mask_token_text,
    )

    check_folder_can_be_made(args.out)  # before the lock beside it is made
    hold_folder(args.out, beside=True)  # one writer; an interrupted init's debris goes (`dflashkit.lock`)
    check_destination(None, args.out, args.force)
    hf_config = load_target_config(args.target)
    ids = None
    if args.target_layer_ids:
        try:
            ids = [int(x) for x in args.target_layer_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(
                f"--target-layer-ids must be integers separated by commas, got {args.target_layer_ids!r}"
            ) from None
    mask = args.mask_token_id
    if mask is None:
        mask = default_mask_token_id(args.target, int(hf_config.vocab_size))
    config = config_for_target(
        hf_config,
        num_layers=args.layers,
        block_size=args.block_size,
        mask_token_id=mask,
        mask_token=mask_token_text(args.target, mask),
        target_layer_ids=ids,
        target=identity_of_folder(args.target),
    )
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed=args.seed)
    save_drafter(drafter, args.out, dtype=getattr(torch, args.dtype))
    n = sum(p.numel() for p in drafter.parameters())
    print(
        f"wrote {args.out}: {config.num_hidden_layers} layers, block size {config.block_size}, "
        f"hidden {config.hidden_size}, target layers {config.target_layer_ids} of {config.num_target_layers}, "
        f"mask token {config.mask_token_id}, {n / 1e6:.1f}M parameters ({args.dtype})"
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from dflashkit.model.checkpoint import check_checkpoint_folder, check_destination, convert_checkpoint

    check_checkpoint_folder(args.src)  # before loading a target: the paths first
    check_folder_can_be_made(args.dst, "DST")  # before the lock beside it is made
    hold_folder(args.dst, beside=True)  # one writer; an interrupted convert's debris goes (`dflashkit.lock`)
    check_destination(args.src, args.dst, args.force)
    target = None
    if args.target:
        from dflashkit.target.hf import TargetModel

        target = TargetModel.load(args.target)
    convert_checkpoint(args.src, args.dst, args.to, target=target, force=args.force)
    print(f"wrote {args.dst} ({args.to} layout)")
    return 0


def _check_serving(args: argparse.Namespace) -> int:
    from dflashkit.errors import CheckpointError
    from dflashkit.model.checkpoint import check_checkpoint_folder
    from dflashkit.model.serving import missing_fields

    check_checkpoint_folder(args.dir)
    missing = missing_fields(args.dir)
    if any(missing.values()):
        parts = [f"{engine} misses {', '.join(fields)}" for engine, fields in missing.items() if fields]
        raise CheckpointError(
            f"{args.dir}: {'; '.join(parts)}. Rewrite it with `dflashkit convert {args.dir} OUT --to zlab "
            "--target TARGET`"
        )
    print(f"{args.dir}: vLLM and SGLang find every field their DFlash loaders read")
    return 0

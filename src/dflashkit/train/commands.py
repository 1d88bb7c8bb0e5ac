"""`dflashkit train`: train a drafter from a config, resume exactly, or check everything with --dry-run."""

from __future__ import annotations

import argparse


def _train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflashkit.config import load_config

    overrides = list(args.overrides)
    if args.allow_env_drift:
        overrides.append("run.allow_env_drift=true")
    if args.out:
        overrides.append(f"run.out_dir={args.out}")
    cfg = load_config(args.config, overrides)
    console = Console()
    if args.dry_run:
        from dflashkit.train.plan import dry_run

        dry_run(cfg, console)
        return 0
    from dflashkit.train.trainer import train

    result = train(cfg, resume=args.resume, console=console)
    val = result.final_val
    console.print(
        f"[bold green]done[/]: {result.steps} steps in {result.seconds:.0f} s; validation acceptance length "
        f"{val.get('acceptance_length', float('nan')):.3f} (best {result.best_acceptance_length:.3f}); "
        f"best drafter in {result.out_dir / 'best'}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a drafter (config + dotted overrides, e.g. train.lr=3e-4)",
        description="Train a DFlash drafter on one process. Any section.key=value word overrides the config "
        "(e.g. train.lr=3e-4 drafter.layers=2).",
    )
    p.add_argument("--config", "-c", help="YAML run config (configs/embedded.yaml is the default job)")
    p.add_argument("--out", help="run folder (same as run.out_dir=...)")
    p.add_argument(
        "--resume", action="store_true", help="continue exactly from the run folder's latest checkpoint"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate config, data, target and drafter; do not train"
    )
    p.add_argument(
        "--allow-env-drift",
        action="store_true",
        help="resume even when torch/CUDA/triton/GPU changed since the checkpoint",
    )
    p.set_defaults(handler=_train, overrides=[])  # section.key=value words anywhere (cli.main collects them)

"""`dflashkit train`: train a drafter from a config, resume exactly, or check everything with --dry-run;
`--nproc N` trains data-parallel on N processes (it starts the same command under torchrun)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.commands import values
from dflashkit.config import PATHS_RULE, RunConfig, load_config
from dflashkit.errors import ConfigError


def add_run_arguments(p: argparse.ArgumentParser, *, variants: bool = False) -> None:
    """The options `train` and `fanout` share; section.key=value words anywhere override the config."""
    whose = "every variant exactly from its" if variants else "exactly from the run folder's"
    p.add_argument("--config", "-c", help="YAML run config" + (" with a fanout section" if variants else ""))
    p.add_argument("--out", help="run folder (same as run.out_dir=...)")
    p.add_argument(
        "--resume",
        action="store_true",
        help=f"continue {whose} newest intact checkpoint, with the settings it was trained with (a change to "
        "the model, data, loss or optimizer is refused; docs/training.md, Resuming)",
    )
    p.add_argument(
        "--move-aside",
        action="store_true",
        help="when the run folder holds an earlier run, move its files to <folder>.old-<time> and start anew "
        "(without it, training refuses to replace a run; nothing is ever deleted)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate config, data, target and drafter; do not train"
    )
    p.add_argument(
        "--allow-env-drift",
        action="store_true",
        help="resume even when torch/CUDA/triton/GPU changed since the checkpoint",
    )
    p.set_defaults(overrides=[])  # cli.main collects the section.key=value words


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.resume and args.move_aside:
        raise ConfigError(
            "--resume continues the run in its folder and --move-aside moves that run away to start anew: "
            "pass one of them"
        )
    overrides = list(args.overrides)
    if args.allow_env_drift:
        overrides.append("run.allow_env_drift=true")
    if args.out:
        overrides.append(f"run.out_dir={args.out}")
    cfg = load_config(args.config, overrides)
    # train, fanout and their --dry-run: a run folder that cannot be made is said before anything loads
    check_folder_can_be_made(cfg.run.out_dir, "the run folder (--out, run.out_dir)")
    return cfg


def _train(args: argparse.Namespace) -> int:
    from rich.console import Console

    cfg = config_from_args(args)
    console = Console()
    if cfg.fanout is not None:  # several drafter variants from one target: `dflashkit fanout`
        return run_fanout(
            cfg,
            resume=args.resume,
            dry_run=args.dry_run,
            console=console,
            nproc=args.nproc,
            move_aside=args.move_aside,
        )
    launch = _launch_command(args)
    if launch is not None:
        console.print(f"data-parallel: {' '.join(launch)}")
    if args.dry_run:
        from dflashkit.train.plan import dry_run

        dry_run(
            cfg,
            console,
            nproc=args.nproc,
            nnodes=args.nnodes,
            resume=args.resume,
            move_aside=args.move_aside,
        )
        return 0
    if launch is not None:
        import subprocess

        return subprocess.call(launch)
    from dflashkit.model.acceptance import served_tau
    from dflashkit.train.trainer import train

    result = train(cfg, resume=args.resume, console=console, move_aside=args.move_aside)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    val = result.final_val
    if result.stopped_by:
        console.print(
            f"[bold yellow]stopped[/] by {result.stopped_by} after step {result.steps}: its checkpoint is "
            f"written (best {result.best_served_acceptance_length:.3f} in {result.out_dir / 'best'}); "
            "the same command with --resume continues from it"
        )
        return 143 if result.stopped_by == "SIGTERM" else 130
    console.print(
        f"[bold green]done[/]: {result.steps} steps in {result.seconds:.0f} s; validation acceptance length "
        f"{val.get('acceptance_length', float('nan')):.3f}, in served order {served_tau(val):.3f}"
        + (
            f", expected at T={val['serve_temperature']:g} {val['served_expected_acceptance_length']:.3f}"
            if "served_expected_acceptance_length" in val
            else ""
        )
        + f" (best {result.best_served_acceptance_length:.3f}); "
        f"best drafter in {result.out_dir / 'best'}"
    )
    return 0


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


def _launch_command(args: argparse.Namespace) -> list[str] | None:
    """The torchrun command for --nproc (None without it)."""
    from dflashkit.train import distributed

    if args.nproc is None:
        if args.nnodes != 1 or args.rdzv_endpoint:
            raise ConfigError("--nnodes and --rdzv-endpoint go with --nproc N (processes per host)")
        return None
    if distributed.launched_by_torchrun():
        raise ConfigError("this process was started by torchrun already; drop --nproc")
    return distributed.launch_command(
        distributed.train_argv(args), args.nproc, args.nnodes, args.rdzv_endpoint
    )


TRAIN_EXAMPLES = """\
examples:
  dflashkit train -c configs/embedded.yaml --dry-run             check everything the run needs, train nothing
  dflashkit train -c configs/embedded.yaml                       train into run.out_dir (runs/embedded)
  dflashkit train -c configs/embedded.yaml --resume train.max_steps=1000
                                                                 continue the run, for longer
  dflashkit train -c configs/embedded.yaml --out runs/b16 drafter.block_size=16
                                                                 a new run in its own folder
  dflashkit train -c configs/embedded.yaml --move-aside          start over: the earlier run's files
                                                                 move to runs/embedded.old-<time>
  dflashkit train -c configs/qwen3-8b.yaml --nproc 8       data-parallel on 8 GPUs of this host

--resume continues with the settings the run was trained with: it refuses a change to the model
(target.*, drafter.*), the data (data.*, train.max_len, train.seed), the loss or the optimizer, and
allows train.max_steps, train.epochs, the log/eval/save cadence, train.keep_last, train.tensorboard,
the batch split, run.*, attention.*, distributed.* and eval.* (docs/training.md, Resuming).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a drafter (config + dotted overrides, e.g. train.lr=3e-4)",
        description="Train a DFlash drafter on one process, or data-parallel with --nproc N (or under "
        "torchrun). Any section.key=value word overrides the config (e.g. train.lr=3e-4 drafter.layers=2). "
        + PATHS_RULE,
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument(
        "--nproc",
        type=values.count,
        metavar="N",
        help="train data-parallel on N processes of this host (one per GPU): runs this command under torchrun",
    )
    p.add_argument(
        "--nnodes",
        type=values.count,
        default=1,
        metavar="M",
        help="with --nproc: hosts taking part (run the same command on every host, with --rdzv-endpoint)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes > 1: the rendezvous address (a free port on one host, reachable from all)",
    )
    p.set_defaults(handler=_train)

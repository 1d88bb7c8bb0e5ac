"""Data-parallel training: one process per GPU under torchrun, DDP by default, FSDP2 for large drafters.

    torchrun --nproc-per-node 8 -m dflashkit train -c CONFIG        (or: dflashkit train -c CONFIG --nproc 8)

How a run is split over W processes (ranks), each with micro-batch b and accumulation a:

- Every rank packs the same rows and walks the same micro-batch stream (`dflashkit.data.stream`). One
  *global micro-batch* is W*b consecutive rows of the seeded epoch order; rank r trains on rows
  [r*b, (r+1)*b) of it. An optimizer step takes a global micro-batches, so the global batch is W x b x a
  rows. The data cursor counts global rows.
- A row's anchors come from a generator seeded with (seed, epoch, the row's place in the epoch order)
  (`data.stream.anchor_seed`), so they do not depend on W, on b, or on which rank reads the row.
- Each micro-batch's loss is normalised by the weight sum of the whole global micro-batch (one scalar
  all-reduce), so the averaged gradient is the gradient one process would get from the W*b rows.
  Together: W ranks x b rows train as 1 process x W*b rows does, up to float reduction order.
- Training metrics are sums (`all_reduce_stats`). Validation rows are dealt round-robin
  and every rank runs the same number of forwards (FSDP's all-gathers need lockstep); sums are reduced.
- Rank 0 logs and writes the checkpoints and best/. Under FSDP every rank first takes part in
  gathering the full weights and optimizer state. A checkpoint holds the full (unsharded) state in the
  one-process layout plus the global step and cursor, so a run resumes on another world size or strategy.

The process group comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous):
nccl when the run uses CUDA (rank r on cuda:LOCAL_RANK), gloo on the CPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dflashkit.config import RunConfig
from dflashkit.errors import ConfigError, DeviceError
from dflashkit.runtime.devices import resolve_device

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# --------------------------------------------------------------------------------------------------
# Who am I


@dataclass(frozen=True)
class Dist:
    """This process's place in a data-parallel run (rank 0 of 1 for a one-process run)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "single"  # "single", "ddp" or "fsdp"
    owns_group: bool = False  # init_distributed created the process group, so shutdown destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1


def single_process(device: torch.device) -> Dist:
    return Dist(device=device)


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def init_distributed(cfg: RunConfig) -> Dist:
    """The process group of a torchrun launch (nccl on CUDA, each rank on cuda:LOCAL_RANK; gloo on the
    CPU), or a one-process Dist when torchrun did not start this process. An existing process group is
    joined as it is (and left alone by `shutdown`)."""
    device = resolve_device(cfg)
    if not (launched_by_torchrun() or dist.is_initialized()):
        return single_process(device)
    rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        if cfg.run.device not in ("auto", "cuda"):
            raise ConfigError(
                f"run.device={cfg.run.device} names one GPU, but under torchrun each rank uses "
                "cuda:LOCAL_RANK; use run.device=auto or run.device=cuda"
            )
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceError(
                f"rank {rank} has LOCAL_RANK {local_rank}, but this host has {count} GPUs; start at most "
                f"{count} processes per host (dflashkit train --nproc {count}, or torchrun --nproc-per-node {count})"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return single_process(device)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        owns = True
    return Dist(device, rank, world, local_rank, cfg.distributed.strategy, owns)


def shutdown(d: Dist) -> None:
    """Leave the process group that `init_distributed` created (a no-op otherwise)."""
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if not d.parallel:
        return
    if d.device.type == "cuda":
        dist.barrier(device_ids=[d.device.index])
    else:
        dist.barrier()


# --------------------------------------------------------------------------------------------------
# Which held-out rows each rank measures (training rows: `dflashkit.data.stream`)


def lockstep_rows(n: int, d: Dist) -> list[tuple[int, bool]]:
    """This rank's share of n evaluation rows, dealt round-robin, as (row, counted) pairs. Every rank gets
    the same number of pairs (FSDP forwards are collectives); a rank short of rows repeats the last row
    with counted=False, to be run and not counted."""
    if n == 0:
        return []
    per_rank = -(-n // d.world_size)
    rows = range(d.rank, per_rank * d.world_size, d.world_size)
    return [(i, True) if i < n else (n - 1, False) for i in rows]


# --------------------------------------------------------------------------------------------------
# The model: DDP or FSDP2


def wrap_drafter(drafter: nn.Module, cfg: RunConfig, d: Dist) -> nn.Module:
    """The module to train: the drafter itself in one process; DDP around it; or, with FSDP2, the drafter
    sharded in place (`fully_shard` as one unit: its forward reaches into its layers' attention, so the
    layers are not separate units), computing in `distributed.fsdp_param_dtype` and reducing in fp32.
    Evaluation and checkpoints use the drafter itself (`run.drafter`), never the DDP wrapper."""
    if not d.parallel:
        return drafter
    if d.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.device.index] if d.device.type == "cuda" else None
        return DistributedDataParallel(drafter, device_ids=ids)  # the drafter has no buffers to sync
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, cfg.distributed.fsdp_param_dtype), reduce_dtype=torch.float32
    )
    fully_shard(drafter, mesh=mesh, mp_policy=policy)
    return drafter


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter inside a DDP wrapper (the module itself otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def gradient_sync(model: nn.Module, d: Dist, sync: bool) -> Iterator[None]:
    """Run one micro-batch's forward and backward; with sync=False the gradients only accumulate locally
    (every micro-batch of an accumulation but the last), with sync=True they are averaged over ranks."""
    if not d.parallel or sync:
        yield
    elif d.strategy == "ddp":
        with model.no_sync():  # type: ignore[operator]
            yield
    else:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]


def global_loss(weighted_sum: Tensor, weight_sum: Tensor, loss: Tensor, d: Dist) -> tuple[Tensor, float]:
    """The loss this rank back-propagates for one micro-batch, and its share of the global micro-batch's
    loss (the shares add up over ranks to the one-process loss of all W*b rows).

    In one process that is the micro-batch's own loss. With W ranks it is weighted_sum x W / (weight sum
    over all ranks): DDP and FSDP average gradients over ranks, which then gives the gradient of
    sum(weighted sums) / sum(weights), exactly what one process computes for the W*b rows together."""
    if not d.parallel:
        return loss, float(loss.detach())
    total = weight_sum.detach().double().reshape(1).to(d.device)
    dist.all_reduce(total)
    denominator = float(total.clamp_min(torch.finfo(torch.float32).tiny))
    return weighted_sum * (d.world_size / denominator), float(weighted_sum.detach()) / denominator


def sum_over_ranks(values: Sequence[float], d: Dist) -> list[float]:
    """Sums over ranks of a few floats (the values themselves in one process)."""
    if not d.parallel:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_stats(stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum stats over all ranks in place (a no-op without an initialised process group). Returns `stats`."""
    if dist.is_available() and dist.is_initialized():
        for v in stats.values():
            dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return stats


def reduce_stats(stats: dict[str, Tensor], d: Dist) -> dict[str, Tensor]:
    """Acceptance stats summed over ranks (on the CPU, as `add_stats` keeps them)."""
    if not d.parallel:
        return stats
    moved = {k: v.to(d.device) for k, v in stats.items()}  # nccl reduces device tensors only
    return {k: v.cpu() for k, v in all_reduce_stats(moved).items()}


def grad_norm_value(norm: Tensor) -> float:
    """clip_grad_norm_'s result as a float (a replicated DTensor under FSDP)."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# --------------------------------------------------------------------------------------------------
# Checkpoints: the full state, in the one-process layout


def _fsdp(d: Dist) -> bool:
    return d.parallel and d.strategy == "fsdp"


def full_state_dict(drafter: nn.Module, d: Dist) -> dict[str, Tensor]:
    """The drafter's full weights (fp32 master copy). Under FSDP every rank must call this (it gathers);
    rank 0 gets the tensors (on the CPU), the other ranks an empty dict."""
    if not _fsdp(d):
        return drafter.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _param_names(drafter: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order: index i of a plain optimizer state is names[i]."""
    names = {id(p): n for n, p in drafter.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


class FullOptimizerState:
    """An FSDP2 optimizer as a checkpoint sees it (`state.save_training_state` / `load_training_state`):
    `state_dict()` is the full, unsharded state in the one-process layout (parameters by index), which
    any world size and strategy loads; `load_state_dict` scatters such a state back into the shards.

    Building one with gather=True gathers the state, a collective every rank must join; only rank 0
    then holds it."""

    def __init__(self, drafter: nn.Module, optimizer: torch.optim.Optimizer, gather: bool):
        self.drafter, self.optimizer = drafter, optimizer
        self.names = _param_names(drafter, optimizer)
        self.full: dict[str, Any] = {}
        if gather:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            by_name = get_optimizer_state_dict(
                drafter, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if by_name:
                index = {n: i for i, n in enumerate(self.names)}
                self.full = {
                    "state": {index[n]: s for n, s in by_name["state"].items()},
                    "param_groups": [
                        dict(g, params=[index[n] for n in g["params"]]) for g in by_name["param_groups"]
                    ],
                }

    def state_dict(self) -> dict[str, Any]:
        return self.full

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        by_name = {
            "state": {self.names[int(i)]: s for i, s in state["state"].items()},
            "param_groups": [
                dict(g, params=[self.names[int(i)] for i in g["params"]]) for g in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            self.drafter, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True)
        )


def checkpoint_optimizer(
    drafter: nn.Module, optimizer: torch.optim.Optimizer, d: Dist, *, gather: bool
) -> Any:
    """What `state.save_training_state` / `load_training_state` get as the optimizer: the optimizer itself
    (its state is already full) except under FSDP (a `FullOptimizerState`; gather=True to save)."""
    return FullOptimizerState(drafter, optimizer, gather) if _fsdp(d) else optimizer


def resume_note(extra: dict[str, Any], d: Dist, global_batch: int) -> str | None:
    """A line for the log when a checkpoint resumes on another world size or global batch (None if not)."""
    saved_world = int(extra.get("world_size", 1))
    saved_batch = extra.get("global_batch")
    notes = []
    if saved_world != d.world_size:
        notes.append(
            f"the checkpoint was written by {saved_world} rank(s), this run has {d.world_size}: training "
            "continues from the same global step and row, with the same anchors (they depend on seed, epoch "
            "and row, not on the rank); the float reduction order changes and only rank 0's random streams "
            "were kept, so the run matches an uninterrupted one to rounding, not bit for bit (an exact "
            "resume needs the same world size)"
        )
    if saved_batch is not None and int(saved_batch) != global_batch:
        notes.append(
            f"the global batch changed from {saved_batch} to {global_batch} rows per step (world x "
            "train.batch_size x train.grad_accum): the schedule continues, the trajectory differs"
        )
    return "; ".join(notes) or None


# --------------------------------------------------------------------------------------------------
# `dflashkit train --nproc N`: start the same command under torchrun


def train_argv(args: Any) -> list[str]:
    """The `dflashkit train` words of a parsed command line, without the launch options (what each
    process torchrun starts runs)."""
    argv = ["train"]
    if args.config:
        argv += ["--config", str(args.config)]
    if args.out:
        argv += ["--out", str(args.out)]
    if args.resume:
        argv.append("--resume")
    if getattr(args, "move_aside", False):
        argv.append("--move-aside")
    if args.allow_env_drift:
        argv.append("--allow-env-drift")
    return argv + list(args.overrides)


def launch_command(
    argv: Sequence[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None
) -> list[str]:
    """The torchrun command that runs `dflashkit <argv>` on nproc processes per host: one host through a
    local rendezvous (--standalone), several through c10d at rdzv_endpoint (the same command on every
    host)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1 (got {nproc})")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1 (got {nnodes})")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ConfigError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a free port on the first host, reachable "
                "from every host)"
            )
        cmd += [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            "--rdzv-id=dflashkit-train",
        ]
    return [*cmd, "-m", "dflashkit", *argv]

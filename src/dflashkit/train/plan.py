"""`dflashkit train --dry-run`: run the checks the run itself would make, without loading the target's
weights or training, and print the plan: config, data (its manifest, and the packed rows of both splits:
enough of them for a batch), target and drafter together, and the attention memory a training step and an
evaluation row would need on this device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from dflashkit.attention.dense_budget import dense_budget_gib, preflight_dense
from dflashkit.config import RunConfig
from dflashkit.data.dataset import read_manifest
from dflashkit.data.features import (
    check_capture_has_distribution,
    check_capture_matches,
    read_features_manifest,
)
from dflashkit.data.rows import pack_dataset
from dflashkit.model.checkpoint import check_drafter_files
from dflashkit.runtime.devices import resolve_backend, resolve_device, use_compiled_regions
from dflashkit.target.hf import identity_of_folder, load_target_config
from dflashkit.train import state
from dflashkit.train.checkpoints import CHECKPOINTS
from dflashkit.train.rundir import check_resume_config, claim_run_folder, run_files
from dflashkit.train.setup import (
    check_data_matches_target,
    check_rows,
    drafter_config,
    start_note,
    total_steps,
    with_init_shape,
)


def dry_run(
    cfg: RunConfig,
    console: Any,
    nproc: int | None = None,
    nnodes: int = 1,
    *,
    resume: bool = False,
    move_aside: bool = False,
) -> dict[str, Any]:
    """``nproc`` x ``nnodes``: the ranks a data-parallel launch would start (``--nproc``, ``--nnodes``);
    None for one process. ``resume``, ``move_aside``: the run folder is checked as `train` would (nothing
    is moved or renamed)."""
    cfg = with_init_shape(cfg)  # the shape a run from drafter.init trains (a bad folder: one clear error)
    if cfg.drafter.init:  # its weights as the run reads them: a damaged file fails here as it would there
        check_drafter_files(cfg.drafter.init)
    out = run_folder_plan(cfg, resume=resume, move_aside=move_aside)
    device = resolve_device(cfg)
    backend = resolve_backend(cfg, device)
    ranks = (nproc or 1) * (nnodes if nproc else 1)
    compiled = use_compiled_regions(cfg, backend, cfg.distributed.strategy if ranks > 1 else "single")
    target_cfg = load_target_config(cfg.target.path)
    ident = identity_of_folder(cfg.target.path)
    config = drafter_config(cfg, target_cfg, ident)
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    check_data_matches_target(manifest, ident, config, str(data_dir))
    train_rows, val_rows = pack_dataset(cfg, target_cfg)  # an empty split is an error here too
    check_rows(cfg, train_rows, ranks)
    attention = attention_memory(cfg, config, device, backend)
    features = "online (the target runs every step)"
    if cfg.data.features_dir:
        fm = read_features_manifest(cfg.data.features_dir)
        check_capture_matches(
            fm,
            where=cfg.data.features_dir,
            ident=ident,
            layer_ids=config.target_layer_ids,
            max_len=cfg.train.max_len,
            data_manifest=manifest,
            rows={"train": train_rows, "validation": val_rows},
        )
        check_capture_has_distribution(fm, cfg, cfg.data.features_dir)
        features = f"offline, {cfg.data.features_dir} ({fm['dtype']}, layers {fm['target_layer_ids']})"
    per_step = ranks * cfg.train.batch_size * cfg.train.grad_accum
    cache = cfg.run.compile_cache
    plan = {
        "device": str(device),
        "ranks": f"{ranks} ({cfg.distributed.strategy})" if ranks > 1 else "1",
        "attention backend": backend,
        "compiled": "flex attention, each layer and loss chunk"
        if compiled
        else ("flex attention" if backend == "flex" else "nothing"),
        "compile cache": "none"
        if not cache
        else f"{cache} ({'exists' if Path(cache).is_file() else 'written after warm-up'})",
        "features": features,
        "target": f"{ident['name']} ({ident['architecture']}, {ident['num_layers']} layers, hidden {ident['hidden_size']})",
        "drafter": f"{config.num_hidden_layers} layers, block {config.block_size}, target layers {config.target_layer_ids}, mask id {config.mask_token_id}",
        "starts from": start_note(cfg),
        "data": f"{data_dir}: {manifest.get('counts', {})}; packed into {len(train_rows)} training and "
        f"{len(val_rows)} held-out rows of {cfg.train.max_len} tokens",
        "steps": f"{total_steps(cfg, len(train_rows), ranks)}",
        "attention memory": attention,
        "train": f"lr {cfg.train.lr}, {cfg.train.num_anchors} anchors x {cfg.train.max_len} tokens, "
        f"{ranks} x batch {cfg.train.batch_size} x accum {cfg.train.grad_accum} = {per_step} rows per step",
        "loss": f"{cfg.train.loss_weighting}, gamma {cfg.decay_gamma():.2f}, labels from {cfg.train.labels}",
        "out": out,
    }
    table = Table(title="dflashkit train --dry-run: everything checks out")
    table.add_column("", style="cyan")
    table.add_column("plan", overflow="fold")
    for k, v in plan.items():
        table.add_row(k, v)
    console.print(table)
    return plan


def attention_memory(cfg: RunConfig, config: Any, device: Any, backend: str) -> str:
    """The dense attention memory of a training micro-batch and of an evaluation row on this device, checked
    against the budget as the run checks it before any attention runs (`attention.dense_budget.preflight_dense`):
    a shape over budget is the error the run would meet, with a hint for this device."""

    if backend == "flex":
        return "flex: compiled, memory linear in sequence length (no dense score matrix)"
    q_len = cfg.train.num_anchors * config.block_size  # N blocks of B slots
    kv_len = cfg.train.max_len + q_len  # the context, then the blocks
    heads = config.num_attention_heads
    need = 0
    for batch, what in ((cfg.train.batch_size, "a training micro-batch"), (1, "an evaluation row")):
        preflight_dense(
            batch, 1, q_len, kv_len, what=f"the {backend} attention mask of {what}", device=device
        )
        where = f"{backend} attention of {what}"
        need = max(need, preflight_dense(batch, heads, q_len, kv_len, what=where, device=device))
    return (
        f"{backend} (dense) on {device}: score matrix {cfg.train.batch_size}x{heads}x{q_len}x{kv_len}, "
        f"{need / 2**30:.2f} GiB per layer, within the {dense_budget_gib():g} GiB budget"
    )


def run_folder_plan(cfg: RunConfig, *, resume: bool, move_aside: bool) -> str:
    """What training would do with run.out_dir, checked as `train` checks it (`train.rundir`): an earlier
    run there is refused without --resume or --move-aside; --resume checks the checkpoint it would continue
    and the config against the one it was trained with."""

    out = Path(cfg.run.out_dir)
    if resume:
        notes: list[str] = []
        ckpt = state.pick_resume_checkpoint(out / CHECKPOINTS, notes.append, set_aside=False)
        if ckpt is None:
            return f"{out} (no checkpoint: --resume starts from scratch)"
        check_resume_config(ckpt, cfg)
        return f"{out}, resuming from {ckpt.name}" + (f" ({'; '.join(notes)})" if notes else "")
    found = run_files(out)
    if found and move_aside:
        return f"{out} (its earlier run's files, {', '.join(found)}, would move to {out}.old-<time>)"
    if found:
        claim_run_folder(out, move_aside=False, report=lambda _: None)  # raises, naming the choices
    return str(out)

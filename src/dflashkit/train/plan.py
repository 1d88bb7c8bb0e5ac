"""`dflashkit train --dry-run`: check config, data manifest, target and drafter together, without
loading the target's weights or training, and print the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from dflashkit.config import RunConfig
from dflashkit.errors import ConfigError


def dry_run(cfg: RunConfig, console: Any, nproc: int | None = None, nnodes: int = 1) -> dict[str, Any]:
    """``nproc`` x ``nnodes``: the ranks a data-parallel launch would start (``--nproc``, ``--nnodes``);
    None for one process."""
    from dflashkit.data.dataset import read_manifest
    from dflashkit.target.hf import identity_of_folder, load_target_config
    from dflashkit.train.trainer import (
        check_data_matches_target,
        drafter_config,
        resolve_backend,
        resolve_device,
        use_compiled_regions,
    )

    device = resolve_device(cfg)
    backend = resolve_backend(cfg, device)
    ranks = (nproc or 1) * (nnodes if nproc else 1)
    compiled = use_compiled_regions(cfg, backend, cfg.distributed.strategy if ranks > 1 else "single")
    target_cfg = load_target_config(cfg.target.path)
    ident = identity_of_folder(cfg.target.path)
    dc = drafter_config(cfg, target_cfg, ident)
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    check_data_matches_target(manifest, ident, dc, str(data_dir))
    if cfg.drafter.init and not Path(cfg.drafter.init).is_dir():
        raise ConfigError(f"drafter.init={cfg.drafter.init} is not a checkpoint folder")
    features = "online (the target runs every step)"
    if cfg.data.features_dir:  # everything but the packed rows' digest, which needs the tokenizer
        from dflashkit.data.features import check_capture_matches, read_features_manifest

        fm = read_features_manifest(cfg.data.features_dir)
        check_capture_matches(
            fm,
            where=cfg.data.features_dir,
            ident=ident,
            layer_ids=dc.target_layer_ids,
            max_len=cfg.train.max_len,
            data_manifest=manifest,
            rows={},
        )
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
        "drafter": f"{dc.num_hidden_layers} layers, block {dc.block_size}, target layers {dc.target_layer_ids}, mask id {dc.mask_token_id}",
        "data": f"{data_dir}: {manifest.get('counts', {})}",
        "train": f"lr {cfg.train.lr}, {cfg.train.num_anchors} anchors x {cfg.train.max_len} tokens, "
        f"{ranks} x batch {cfg.train.batch_size} x accum {cfg.train.grad_accum} = {per_step} rows per step",
        "loss": f"{cfg.train.loss_weighting}, gamma {cfg.decay_gamma():.2f}, labels from {cfg.train.labels}",
        "out": cfg.run.out_dir,
    }
    table = Table(title="dflashkit train --dry-run: everything checks out")
    table.add_column("", style="cyan")
    table.add_column("plan", overflow="fold")
    for k, v in plan.items():
        table.add_row(k, v)
    console.print(table)
    return plan

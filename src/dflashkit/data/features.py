"""Offline target features: `dflashkit capture` runs the target once over every packed row and writes
its context features and argmax labels to sharded safetensors; training reads them back
(`data.features_dir`) instead of running the target every step.

The rows are exactly the trainer's (`data.rows.pack_dataset`, `target.packed.target_pass`), so a capture stored
in float32 trains to the same losses as the online path, and one stored in the target's own dtype
(bf16 on a GPU) gives that path's features bit for bit.

The folder (`out`):
    capture.json                  what the shards are made of: target, layer ids, dataset, max_len,
                                  dtype, rows per shard (a restart must match it)
    train-00000.safetensors ...   R rows each: features [R, T, n*H] (bfloat16 | float32 | fp8 e4m3),
    validation-00000.safetensors  scale [R, T, n] (fp8 only: one float32 per token and layer),
                                  last_hidden [R, T, H] (only for a config whose loss or metric needs the
                                  target's whole distribution, and whose drafter does not read the last
                                  layer itself: the target's last layer, bfloat16 | float32),
                                  labels [R, T] int32 (the target's argmax), input_ids, doc_ids,
                                  position_ids [R, T] int32, loss_mask [R, T] uint8; the metadata
                                  names the rows and carries a digest of the tensors
    fingerprint.json              the environment it was made in
    manifest.json                 written last: identity, counts, bytes per token, shard list

The target's whole distribution at a token (train.loss kl, tv or lk, train.serve_temperature > 0) is its
last layer's output through its final norm and lm_head, computed at training time from the stored last
hidden state: H values a token (576 for the embedded target, 1152 B in bf16; 4096 for a Qwen3-8B-shaped
one, 8 KiB in bf16), never the vocabulary-sized logits. The manifest's "target_last_hidden" says where it
is (or null: a capture that cannot train such a config, which training refuses).

Restarting the same command keeps every finished shard (its digest checks out) and rewrites the rest,
a torn or stale one included. `verify_features` re-reads every shard. `FeatureStore` serves rows to the
trainer, and `check_capture_matches` refuses a capture made from another target, layer set, max_len,
dataset or packing.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from dflashkit import __version__
from dflashkit.atomic import disk_full_said, fsync_path, umask_modes, write_json
from dflashkit.data.chat import check_template_identity
from dflashkit.data.dataset import read_manifest
from dflashkit.data.rows import check_data_matches_target, pack_dataset
from dflashkit.errors import ConfigError, DataError
from dflashkit.model.config import target_layer_ids_of
from dflashkit.runtime import fingerprint
from dflashkit.runtime.devices import resolve_device, target_dtype
from dflashkit.target.hf import TargetModel
from dflashkit.target.packed import target_pass

KIND = "dflashkit-features"
SCHEMA = 1
MANIFEST_FILE = "manifest.json"
CAPTURE_FILE = "capture.json"
META_KEY = "dflashkit"  # one metadata entry (safetensors writes several in a random order)
SPLITS = ("train", "validation")
ROW_FIELDS = ("input_ids", "loss_mask", "doc_ids", "position_ids")

FeatureDtype = Literal["bfloat16", "float32", "float8_e4m3fn"]
FEATURE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite e4m3fn value
# Bytes per token of the row data stored beside the features: input_ids, doc_ids, position_ids
# (int32 each) and loss_mask (uint8).
ROW_BYTES = 4 + 4 + 4 + 1
LABEL_BYTES = 4  # int32 argmax
LAST_HIDDEN = "last_hidden"  # the target's last layer, stored beside the drafter's layers when needed


# --------------------------------------------------------------------------------------------------
# Sizes


def last_hidden_dtype(dtype: str) -> str:
    """The dtype the target's last hidden state is stored in for features in ``dtype``: the same, but
    bfloat16 for fp8 (the distribution it gives is the loss's target)."""
    return "bfloat16" if dtype == FP8 else dtype


def bytes_per_token(
    hidden_size: int, num_layers: int, dtype: str = "bfloat16", last_hidden: bool = False
) -> dict[str, int]:
    """Bytes one captured token takes: features (n layers x H), the fp8 scales, the target's last hidden
    state (``last_hidden``: H values), the label and the row data. Embedded target, 3 x 576 in bf16: 3456 B
    of features, 1152 B of last hidden state; a Qwen3-8B-shaped target, 5 x 4096: 40960 B in bf16, 20480 B
    in fp8, 8192 B of last hidden state."""
    if dtype not in FEATURE_DTYPES:
        raise ConfigError(f"feature dtype {dtype!r} is not one of {', '.join(FEATURE_DTYPES)}")
    item = torch.empty(0, dtype=FEATURE_DTYPES[dtype]).element_size()
    last_item = torch.empty(0, dtype=FEATURE_DTYPES[last_hidden_dtype(dtype)]).element_size()
    sizes = {
        "features": num_layers * hidden_size * item,
        "scale": 4 * num_layers if dtype == FP8 else 0,
        LAST_HIDDEN: hidden_size * last_item if last_hidden else 0,
        "labels": LABEL_BYTES,
        "rows": ROW_BYTES,
    }
    sizes["total"] = sum(sizes.values())
    return sizes


# --------------------------------------------------------------------------------------------------
# Encoding: bf16 / fp32 as they are; fp8 e4m3 with one scale per token and layer


def quantize_fp8(features: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
    """[..., n*H] -> (fp8 e4m3 [..., n*H], float32 scale [..., n]): each token's slice of each layer is
    scaled so that its largest magnitude maps to 448. Layers differ by orders of magnitude in size,
    hence one scale per layer, not per token."""
    *lead, dim = features.shape
    groups = features.float().reshape(*lead, num_layers, dim // num_layers)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, dim), scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The inverse of `quantize_fp8`: fp8 [..., n*H] and scale [..., n] -> [..., n*H] in ``dtype``."""
    *lead, dim = q.shape
    n = scale.shape[-1]
    return (q.float().reshape(*lead, n, dim // n) * scale[..., None]).reshape(*lead, dim).to(dtype)


def encode_features(features: Tensor, dtype: str, num_layers: int) -> dict[str, Tensor]:
    """The stored tensors for features [..., n*H]: {"features"} or, for fp8, {"features", "scale"}."""
    if dtype == FP8:
        q, scale = quantize_fp8(features, num_layers)
        return {"features": q, "scale": scale}
    return {"features": features.to(FEATURE_DTYPES[dtype])}


def decode_features(stored: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
    """Features in ``dtype`` from the stored tensors (`encode_features`' output)."""
    if "scale" in stored:
        return dequantize_fp8(stored["features"], stored["scale"], dtype)
    return stored["features"].to(dtype)


# --------------------------------------------------------------------------------------------------
# Digests


def tensor_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 of names, dtypes, shapes and bytes, in name order (independent of the file layout)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{str(t.dtype)}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def rows_digest(rows: Any) -> str:
    """sha256 of packed rows (input_ids, loss_mask, doc_ids, position_ids) as int64: the proof that a
    capture holds the rows training packs."""
    return tensor_digest({k: getattr(rows, k).to(torch.int64) for k in ROW_FIELDS})


_VOLATILE_MANIFEST = ("created", "dflashkit_version", "generation")
_VOLATILE_SETTINGS = (
    "out",
    "device",
    "batch_size",
    "backend",
    "servers",
    "concurrency",
    "server_timeout_s",
    "server_retries",
)


def dataset_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of a dataset manifest without what changes on every run (time, speed, folder, device)."""
    kept = {k: v for k, v in manifest.items() if k not in _VOLATILE_MANIFEST}
    if isinstance(kept.get("settings"), dict):
        kept["settings"] = {k: v for k, v in kept["settings"].items() if k not in _VOLATILE_SETTINGS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Shards


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def shard_ranges(num_rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of consecutive shards."""
    return [(s, min(num_rows, s + rows_per_shard)) for s in range(0, num_rows, rows_per_shard)]


def _write_json(path: Path, obj: Any) -> None:
    write_json(path, obj, sort_keys=True)


def write_shard(path: Path, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Write a shard atomically (temp file, fsync, rename); ``meta`` gets the tensors' digest."""
    from safetensors.torch import save_file

    record = {**meta, "digest": tensor_digest(tensors)}
    tmp = path.with_name(path.name + ".tmp")
    with disk_full_said(path, needed=sum(v.nbytes for v in tensors.values()), tmp=tmp):
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp),
            metadata={META_KEY: json.dumps(record, sort_keys=True)},
        )
    umask_modes(tmp)  # the writer creates it private; a capture is shared like a dataset
    fsync_path(tmp)
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """All tensors of a shard and its metadata (DataError when the file is torn or not a shard)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            names = f.keys()
            tensors = {k: f.get_tensor(k) for k in names}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path} is torn or not a feature shard ({e}); run `dflashkit capture` again"
        ) from None
    return tensors, meta


def shard_is_complete(path: Path, expected: Mapping[str, Any]) -> bool:
    """True when ``path`` is a whole shard with the expected metadata and a matching digest."""
    if not path.is_file():
        return False
    try:
        tensors, meta = read_shard(path)
    except DataError:
        return False
    if any(meta.get(k) != v for k, v in expected.items()):
        return False
    return meta.get("digest") == tensor_digest(tensors)


# --------------------------------------------------------------------------------------------------
# Capture


@dataclass(frozen=True)
class CaptureSettings:
    """How `capture_features` stores features. ``batch_rows`` None: the config's train.batch_size."""

    out: Path
    dtype: FeatureDtype = "bfloat16"
    shard_mb: float = 2048.0
    batch_rows: int | None = None


def _capture_identity(
    cfg: Any,
    ident: dict[str, Any],
    layer_ids: list[int],
    data_manifest: dict[str, Any],
    rows: dict[str, Any],
    settings: CaptureSettings,
    target_dtype: torch.dtype,
    rows_per_shard: int,
    last_hidden: dict[str, Any] | None,
) -> dict[str, Any]:
    """Everything the shard bytes depend on; a restart into the same folder must match it."""
    return {
        "target_last_hidden": last_hidden,
        "kind": KIND,
        "schema": SCHEMA,
        "target": {k: ident.get(k) for k in ("hash", "hidden_size", "num_layers", "vocab_size")},
        "target_layer_ids": list(layer_ids),
        "target_dtype": str(target_dtype).removeprefix("torch."),
        "dataset": {
            "dir": str(cfg.data.dir),
            "manifest_sha256": dataset_digest(data_manifest),
            "template": data_manifest.get("template"),
        },
        "max_len": cfg.train.max_len,
        "rows_sha256": {split: rows_digest(r) for split, r in rows.items()},
        "dtype": settings.dtype,
        "rows_per_shard": rows_per_shard,
    }


def _check_restart(path: Path, identity: dict[str, Any]) -> None:
    """The folder is new, or holds shards made under ``identity`` (else one clear error)."""
    manifest = path.parent / MANIFEST_FILE
    if manifest.is_file() and json.loads(manifest.read_text()).get("kind") != KIND:
        raise ConfigError(
            f"{path.parent} holds something else (a dataset?); capture into another --out folder"
        )
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    diffs = [
        f"{k}: {recorded.get(k)!r} vs {identity.get(k)!r}"
        for k in sorted(set(recorded) | set(identity))
        if k != "dataset" and recorded.get(k) != identity.get(k)
    ]
    if recorded.get("dataset", {}).get("manifest_sha256") != identity["dataset"]["manifest_sha256"]:
        diffs.append("dataset manifest")
    if diffs:
        short = "; ".join(d if len(d) < 160 else d[:157] + "..." for d in diffs)
        raise ConfigError(
            f"{path.parent} holds a capture made differently ({short}); use another --out folder, or delete "
            "this one to start over"
        )


def _progress_bar(enabled: bool, console: Any) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]capture[/] {task.fields[split]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows  {task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def capture_features(
    cfg: Any,
    settings: CaptureSettings,
    *,
    progress: bool = True,
    console: Any = None,
    on_shard: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Run the target over the config's packed training and validation rows and write the feature
    folder ``settings.out`` (or finish one: finished shards are kept); returns its manifest.
    ``on_shard(split, index)`` is called after each shard is safely on disk (written or kept)."""
    out = Path(settings.out)
    data_dir = Path(cfg.data.dir)
    if out.resolve() == data_dir.resolve():
        raise ConfigError(f"--out {out} is the dataset folder; capture into a folder of its own")
    device = resolve_device(cfg)
    dtype = target_dtype(cfg, device)
    data_manifest = read_manifest(data_dir)
    target = TargetModel.load(cfg.target.path, dtype=dtype, device=device)
    ident = target.identity()
    check_data_matches_target(data_manifest, ident, str(data_dir))
    layer_ids = target_layer_ids_of(cfg.drafter, target.num_layers)
    train_rows, val_rows = pack_dataset(cfg, target.config)
    rows = {"train": train_rows, "validation": val_rows}
    last_hidden = last_hidden_plan(cfg, layer_ids, target.num_layers, target.hidden_size, settings.dtype)
    store_last = last_hidden is not None and last_hidden["stored"] == LAST_HIDDEN

    T = cfg.train.max_len
    per_token = bytes_per_token(target.hidden_size, len(layer_ids), settings.dtype, store_last)
    batch_rows = settings.batch_rows or cfg.train.batch_size
    rows_per_shard = max(1, int(settings.shard_mb * 2**20 // (T * per_token["total"])))
    if rows_per_shard > batch_rows:  # whole target passes per shard
        rows_per_shard -= rows_per_shard % batch_rows
    identity = _capture_identity(
        cfg, ident, layer_ids, data_manifest, rows, settings, dtype, rows_per_shard, last_hidden
    )
    out.mkdir(parents=True, exist_ok=True)
    _check_restart(out / CAPTURE_FILE, identity)
    _write_json(out / CAPTURE_FILE, identity)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # unfinished until the manifest is written again
    capture_key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    for stale in out.glob("*.safetensors.tmp"):
        stale.unlink()

    plan = {split: shard_ranges(len(r), rows_per_shard) for split, r in rows.items()}
    total_rows = sum(len(r) for r in rows.values())
    written = kept = 0
    seconds = 0.0
    computed_tokens = 0
    splits: dict[str, Any] = {}
    with _progress_bar(progress, console) as bar:
        task = bar.add_task("capture", total=total_rows, split="", rate="")
        for split, ranges in plan.items():
            shards = []
            for index, (start, stop) in enumerate(ranges):
                path = out / shard_name(split, index)
                expected = {"capture": capture_key, "split": split, "start": start, "stop": stop}
                bar.update(task, split=f"{split} {index + 1}/{len(ranges)}")
                if shard_is_complete(path, expected):
                    kept += 1
                else:
                    t0 = time.perf_counter()
                    tensors = _capture_shard(
                        target, rows[split], start, stop, layer_ids, batch_rows, settings.dtype, store_last
                    )
                    write_shard(path, tensors, expected)
                    written += 1
                    seconds += time.perf_counter() - t0
                    computed_tokens += (stop - start) * T
                    bar.update(task, rate=f"{computed_tokens / max(seconds, 1e-9):,.0f} tokens/s")
                shards.append({"file": path.name, "start": start, "stop": stop, "bytes": path.stat().st_size})
                bar.update(task, advance=stop - start)
                if on_shard is not None:
                    on_shard(split, index)
            r = rows[split]
            splits[split] = {
                "rows": len(r),
                "tokens": len(r) * T,
                "real_tokens": int((r.doc_ids >= 0).sum()),
                "supervised_tokens": int(r.loss_mask.sum()),
                "shards": shards,
            }

    fingerprint.save(fingerprint.collect(), out)
    total_bytes = sum(s["bytes"] for sp in splits.values() for s in sp["shards"])
    total_tokens = sum(sp["tokens"] for sp in splits.values())
    manifest = {
        **identity,
        "target": {"name": ident["name"], **identity["target"]},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dflashkit_version": __version__,
        "hidden_size": target.hidden_size,
        "feature_dim": target.hidden_size * len(layer_ids),
        "splits": splits,
        "bytes": total_bytes,
        "bytes_per_token": per_token,
        "measured_bytes_per_token": round(total_bytes / max(1, total_tokens), 2),
        "run": {
            "device": str(device),
            "batch_rows": batch_rows,
            "shards_written": written,
            "shards_kept": kept,
            "seconds": round(seconds, 3),
            "tokens_per_second": round(computed_tokens / seconds, 1) if seconds else None,
        },
    }
    _write_json(out / MANIFEST_FILE, manifest)
    return manifest


def last_hidden_plan(
    cfg: Any, layer_ids: list[int], num_layers: int, hidden_size: int, dtype: str
) -> dict[str, Any] | None:
    """The manifest's "target_last_hidden" for a capture made with ``cfg``: None when its loss and metric
    need only the target's argmax; else the last layer, where it is stored ("features" when the drafter
    reads it anyway, else the "last_hidden" tensor), its dtype and its bytes per token."""
    if not cfg.train.reads_target_distribution():
        return None
    last = num_layers - 1
    if last in layer_ids:
        return {"layer": last, "stored": "features", "dtype": dtype, "bytes_per_token": 0}
    kept = last_hidden_dtype(dtype)
    item = torch.empty(0, dtype=FEATURE_DTYPES[kept]).element_size()
    return {"layer": last, "stored": LAST_HIDDEN, "dtype": kept, "bytes_per_token": hidden_size * item}


def check_capture_has_distribution(manifest: Mapping[str, Any], cfg: Any, where: str) -> None:
    """A config whose loss or metric needs the target's whole distribution trains only from a capture
    that stored the target's last hidden state (`last_hidden_plan`), or one clear ConfigError."""
    last = int(manifest["target"]["num_layers"]) - 1
    stored = manifest.get("target_last_hidden") or last in manifest["target_layer_ids"]
    if cfg.train.reads_target_distribution() and not stored:
        t = cfg.train
        why = (
            f"train.loss={t.loss_weights()}"
            if t.serve_temperature <= 0
            else (f"train.loss={t.loss_weights()} with train.serve_temperature={t.serve_temperature:g}")
        )
        raise ConfigError(
            f"{where} holds no target distribution (the target's last hidden state) and {why} needs it; "
            "capture again with this config (dflashkit capture -c CONFIG), or drop data.features_dir to "
            "run the target online"
        )


def _capture_shard(
    target: Any,
    rows: Any,
    start: int,
    stop: int,
    layer_ids: list[int],
    batch_rows: int,
    dtype: str,
    last_hidden: bool = False,
) -> dict[str, Tensor]:
    """The stored tensors of rows [start, stop): features encoded in ``dtype`` (on the target's device,
    ``batch_rows`` rows per target pass), with ``last_hidden`` the target's last layer beside them, labels
    and row data, on the CPU."""
    parts: dict[str, list[Tensor]] = {}
    read = layer_ids + [target.num_layers - 1] if last_hidden else layer_ids
    for s in range(start, stop, batch_rows):
        idx = list(range(s, min(stop, s + batch_rows)))
        f, a = target_pass(target, rows.take(idx, target.device), read)
        if not bool(torch.isfinite(f).all()):
            raise DataError(
                f"the target produced non-finite features for rows {idx[0]}..{idx[-1]}; "
                "capture with target.dtype=float32"
            )
        stored = {"labels": a.to(torch.int32)}
        if last_hidden:  # the last layer comes last in `read`
            H = target.hidden_size
            f, stored[LAST_HIDDEN] = f[..., :-H], f[..., -H:].to(FEATURE_DTYPES[last_hidden_dtype(dtype)])
        for k, v in {**encode_features(f, dtype, len(layer_ids)), **stored}.items():
            parts.setdefault(k, []).append(v.cpu())
    sl = slice(start, stop)
    return {
        **{k: torch.cat(v) for k, v in parts.items()},
        "input_ids": rows.input_ids[sl].to(torch.int32),
        "loss_mask": rows.loss_mask[sl].to(torch.uint8),
        "doc_ids": rows.doc_ids[sl].to(torch.int32),
        "position_ids": rows.position_ids[sl].to(torch.int32),
    }


# --------------------------------------------------------------------------------------------------
# Reading: manifest, verification, the store training reads from


def read_features_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a finished capture (DataError when missing or not a capture)."""
    folder = Path(path)
    file = folder / MANIFEST_FILE
    if not file.is_file():
        hint = (
            "finish it by running the same `dflashkit capture` command"
            if (folder / CAPTURE_FILE).is_file()
            else "make one with `dflashkit capture -c CONFIG`"
        )
        raise DataError(f"{folder} holds no finished feature capture (no {MANIFEST_FILE}); {hint}")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{file}:{e.lineno}: invalid JSON ({e.msg}); run `dflashkit capture` again") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise DataError(
            f"{file} is not a dflashkit feature capture (data.features_dir names a capture folder)"
        )
    if manifest.get("schema") != SCHEMA:
        raise DataError(
            f"{file} has schema {manifest.get('schema')}, this dflashkit reads {SCHEMA}; capture again"
        )
    return manifest


def verify_features(
    path: str | os.PathLike[str], on_shard: Callable[[str, int], None] | None = None
) -> dict[str, int]:
    """Re-read every shard of a finished capture: digest, names, shapes, dtypes, finite features and
    scales, labels inside the vocabulary, and the row data against the recorded rows digest.
    Returns counts; raises DataError naming the first bad shard."""
    folder = Path(path)
    manifest = read_features_manifest(folder)
    T, D = manifest["max_len"], manifest["feature_dim"]
    n = len(manifest["target_layer_ids"])
    vocab = manifest["target"]["vocab_size"]
    want_dtype = FEATURE_DTYPES[manifest["dtype"]]
    names = {"features", "labels", *ROW_FIELDS} | ({"scale"} if manifest["dtype"] == FP8 else set())
    last = manifest.get("target_last_hidden") or {}
    if last.get("stored") == LAST_HIDDEN:
        names.add(LAST_HIDDEN)
    counts = {"shards": 0, "rows": 0, "tokens": 0}
    for split, info in manifest["splits"].items():
        row_parts: dict[str, list[Tensor]] = {k: [] for k in ROW_FIELDS}
        for index, shard in enumerate(info["shards"]):
            file = folder / shard["file"]
            tensors, meta = read_shard(file)
            R = shard["stop"] - shard["start"]

            def bad(what: str, file: Path = file) -> DataError:
                return DataError(f"{file}: {what}; delete it and run `dflashkit capture` again")

            if meta.get("digest") != tensor_digest(tensors):
                raise bad("its tensors do not match their digest (corrupted)")
            if set(tensors) != names:
                raise bad(f"holds tensors {sorted(tensors)}, expected {sorted(names)}")
            shapes = {
                "features": (R, T, D),
                "scale": (R, T, n),
                LAST_HIDDEN: (R, T, manifest["hidden_size"]),
                "labels": (R, T),
            } | dict.fromkeys(ROW_FIELDS, (R, T))
            for k, t in tensors.items():
                if tuple(t.shape) != shapes[k]:
                    raise bad(f"{k} has shape {tuple(t.shape)}, expected {shapes[k]}")
            if tensors["features"].dtype != want_dtype:
                raise bad(f"features are {tensors['features'].dtype}, the manifest says {manifest['dtype']}")
            if not bool(torch.isfinite(decode_features(tensors, torch.float32)).all()):
                raise bad("holds non-finite features")
            if LAST_HIDDEN in tensors and not bool(torch.isfinite(tensors[LAST_HIDDEN]).all()):
                raise bad("holds a non-finite last hidden state")
            if "scale" in tensors and not bool((tensors["scale"] > 0).all()):
                raise bad("holds non-positive fp8 scales")
            labels = tensors["labels"]
            if int(labels.min()) < 0 or int(labels.max()) >= vocab:
                raise bad(f"holds labels outside the vocabulary [0, {vocab})")
            for k in ROW_FIELDS:
                row_parts[k].append(tensors[k])
            counts["shards"] += 1
            counts["rows"] += R
            counts["tokens"] += R * T
            if on_shard is not None:
                on_shard(split, index)
        stacked = {
            k: torch.cat(v) if v else torch.zeros(0, T, dtype=torch.int32) for k, v in row_parts.items()
        }
        stacked["loss_mask"] = stacked["loss_mask"].bool()
        if (
            tensor_digest({k: v.to(torch.int64) for k, v in stacked.items()})
            != manifest["rows_sha256"][split]
        ):
            raise DataError(
                f"{folder}: the {split} rows in the shards differ from the rows recorded in the manifest; "
                "run `dflashkit capture` again"
            )
    return counts


def check_capture_matches(
    manifest: Mapping[str, Any],
    *,
    where: str,
    ident: Mapping[str, Any],
    layer_ids: list[int],
    max_len: int,
    data_manifest: Mapping[str, Any],
    rows: Mapping[str, Any],
) -> None:
    """A capture belongs to this run (target, layer ids, max_len, dataset, template, packed rows), or
    one clear ConfigError saying what differs and what to do."""
    again = "capture again with this config (dflashkit capture -c CONFIG)"
    t = manifest["target"]
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if t.get(key) != ident.get(key):
            raise ConfigError(
                f"{where} was captured from a target of {key}={t.get(key)}, this one has {ident.get(key)}; {again}"
            )
    if t.get("hash") != ident.get("hash"):
        raise ConfigError(
            f"{where} was captured from another target ({t.get('name')}, hash {str(t.get('hash'))[:12]}) than "
            f"{ident.get('name')} (hash {str(ident.get('hash'))[:12]}); {again}"
        )
    if list(manifest["target_layer_ids"]) != list(layer_ids):
        raise ConfigError(
            f"{where} holds target layers {manifest['target_layer_ids']} but the drafter reads {list(layer_ids)}; "
            f"set drafter.num_target_layers={len(manifest['target_layer_ids'])} "
            f"drafter.target_layer_ids={json.dumps(manifest['target_layer_ids'], separators=(',', ':'))} or {again}"
        )
    if manifest["max_len"] != max_len:
        raise ConfigError(
            f"{where} was captured with train.max_len={manifest['max_len']}, this run has {max_len}; "
            f"set train.max_len={manifest['max_len']} or {again}"
        )
    if manifest["dataset"]["manifest_sha256"] != dataset_digest(data_manifest):
        raise ConfigError(
            f"{where} was captured from another dataset than data.dir ({manifest['dataset']['dir']}); {again}"
        )
    check_template_identity(
        manifest["dataset"].get("template") or {},
        data_manifest.get("template") or {},
        f"capture {where} vs data.dir",
    )
    for split, r in rows.items():
        if len(r) and manifest["rows_sha256"].get(split) != rows_digest(r):
            raise ConfigError(f"{where} holds other {split} rows than data.dir packs into; {again}")


class FeatureStore:
    """Rows of a finished capture, read on demand from memory-mapped shards."""

    def __init__(self, path: str | os.PathLike[str]):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.manifest = read_features_manifest(self.path)
        self._fields = ("features", "labels") + (("scale",) if self.manifest["dtype"] == FP8 else ())
        last = self.manifest.get("target_last_hidden") or {}
        self.has_last_hidden = last.get("stored") == LAST_HIDDEN  # a tensor of its own
        if self.has_last_hidden:
            self._fields += (LAST_HIDDEN,)
        self._starts: dict[str, list[int]] = {}
        self._files: dict[str, list[Any]] = {}
        for split, info in self.manifest["splits"].items():
            self._starts[split] = [s["start"] for s in info["shards"]]
            files = []
            for s in info["shards"]:
                try:
                    files.append(safe_open(str(self.path / s["file"]), framework="pt"))
                except (SafetensorError, OSError) as e:
                    raise DataError(
                        f"{self.path / s['file']}: cannot read ({e}); run `dflashkit capture` again"
                    ) from None
            self._files[split] = files

    def rows(self, split: str) -> int:
        return int(self.manifest["splits"][split]["rows"])

    def read(
        self, split: str, idx: list[int], device: torch.device, dtype: torch.dtype, last_hidden: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Features [b, T, n*H] in ``dtype`` and argmax labels [b, T] (long) of rows ``idx`` of a split;
        with ``last_hidden``, the target's last hidden state after them ([b, T, (n + 1) * H]: the layers
        of `sources.feature_layers`)."""
        parts: dict[str, list[Tensor]] = {}
        for i in idx:
            if not 0 <= i < self.rows(split):
                raise DataError(f"{self.path} has {self.rows(split)} {split} rows, row {i} was asked for")
            k = bisect_right(self._starts[split], i) - 1
            f, local = self._files[split][k], i - self._starts[split][k]
            for name in self._fields:
                parts.setdefault(name, []).append(f.get_slice(name)[local : local + 1])
        stored = {k: torch.cat(v).to(device, non_blocking=True) for k, v in parts.items()}
        features = decode_features(stored, dtype)
        if last_hidden:
            if not self.has_last_hidden:
                raise DataError(f"{self.path} holds no last hidden state of the target; capture again")
            features = torch.cat([features, stored[LAST_HIDDEN].to(dtype)], dim=-1)
        return features, stored["labels"].long()

"""Crash-safe folders: write into a temporary folder beside the destination, fsync, then rename.

The one way dflashkit publishes a checkpoint, a drafter or any other folder: a reader never sees a
half-written one, and a failure leaves what was there before.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflashkit.errors import ConfigError, DflashkitError
from dflashkit.integrity import write_checksums


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


@contextmanager
def atomic_dir(final_path: str | Path, *, checksums: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `final_path`; on success fsync it and rename it to `final_path`.

    If the body raises, the temporary folder is removed and nothing at `final_path` changes. An existing
    `final_path` is replaced: moved aside, the new folder renamed in, then the old one deleted.
    ``checksums``: record every file's digest in checksums.json once the body is done
    (`dflashkit.integrity`; checkpoints have them, and readers check them).
    """
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_path.name}.tmp-", dir=final_path.parent))
    try:
        yield tmp
        if checksums:
            write_checksums(tmp)
        umask_modes(tmp)
        _fsync_tree(tmp)
    except BaseException as e:
        written = _tree_bytes(tmp) if is_disk_full(e) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if written is not None:
            raise disk_full_error(final_path, written=written) from e
        raise
    _publish(tmp, final_path)


def _publish(tmp: Path, final_path: Path) -> None:
    """Rename `tmp` to `final_path`; an existing `final_path` is moved aside first and back if that fails."""
    old = None
    if final_path.exists():
        old = final_path.with_name(f".{final_path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        os.rename(final_path, old)
    try:
        os.rename(tmp, final_path)
    except BaseException:
        if old is not None:
            os.rename(old, final_path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(final_path.parent)
    if old is not None:
        shutil.rmtree(old)


@contextmanager
def atomic_file(final_path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path beside `final_path` (``.<name>.tmp-*``); on success fsync it and
    rename it over `final_path`. A failure, or the process dying, never leaves a half-written
    `final_path` (plots: pass the format to the writer, the temporary name has no suffix of its own)."""
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final_path.name}.tmp-", dir=final_path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask_modes(tmp)  # mkstemp makes it 0600: the user's umask decides, as for any new file
        fsync_path(tmp)
        os.replace(tmp, final_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(final_path.parent)


# What `atomic_dir`, `atomic_file` and `_publish` leave behind when their process dies: .<name>.tmp-<id>
# (a half-written folder or file) and .<name>.old-<id> (the earlier folder, moved aside for a moment).
_DEBRIS = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[A-Za-z0-9_]+$")


def clean_debris(folder: str | Path, *, only: str | None = None) -> list[Path]:
    """Remove what interrupted writes left in ``folder`` and its subfolders one level down (only names
    these helpers make; with ``only``, only the debris of ``folder/only``). An earlier folder moved aside
    (.<name>.old-*) whose replacement never arrived is put back instead. Call it holding the folder's
    lock (`dflashkit.lock`): no live writer is then using them. Returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = _clean_one(folder, only)
    if only is None:
        for sub in sorted(folder.iterdir()):
            if sub.is_dir() and not sub.is_symlink() and not _DEBRIS.match(sub.name):
                removed += _clean_one(sub, None)
    return removed


def _clean_one(place: Path, only: str | None) -> list[Path]:
    removed = []
    for entry in sorted(place.iterdir()):
        m = _DEBRIS.match(entry.name)
        if m is None or (only is not None and m["name"] != only):
            continue
        final = place / m["name"]
        if m["kind"] == "old" and not final.exists():
            os.rename(entry, final)  # the replacement never arrived: the earlier folder comes back
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def finite_or_none(data: Any) -> Any:
    """``data`` with every NaN or infinite float replaced by None (JSON's null), in nested dicts and lists."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_or_none(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_none(v) for v in data]
    return data


def json_text(
    data: Any, *, indent: int | None = 2, sort_keys: bool = False, ensure_ascii: bool = True
) -> str:
    """Valid JSON for any parser: a measurement that is not a number (NaN, inf) is written as null."""
    return json.dumps(
        finite_or_none(data), indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=False
    )


def write_json(
    path: str | Path, data: Any, *, indent: int | None = 2, sort_keys: bool = False, ensure_ascii: bool = True
) -> Path:
    """The one way a result or a manifest is written: valid JSON (``json_text``), into a temporary file
    beside ``path``, fsynced, then renamed over it (a reader never sees half a file)."""
    path = Path(path)
    text = json_text(data, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")  # one name: a write killed midway is replaced by the next
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full_error(path, needed=len(text.encode())) from e
        raise
    return path


@functools.cache
def _umask() -> int:
    mask = os.umask(0o022)  # read it (the only way) and put it back at once, once a process
    os.umask(mask)
    return mask


def umask_modes(path: str | Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes the user's umask gives a new
    file or folder: tempfile.mkdtemp makes folders 0700 and safetensors writes files 0600, which a group
    sharing a run could not read."""
    path = Path(path)
    folder_mode, file_mode = 0o777 & ~_umask(), 0o666 & ~_umask()
    if not path.is_dir():
        os.chmod(path, file_mode)
        return
    for dirpath, _, files in os.walk(path):
        os.chmod(dirpath, folder_mode)
        for f in files:
            os.chmod(os.path.join(dirpath, f), file_mode)


def check_folder_can_be_made(path: str | Path, option: str = "--out") -> None:
    """Refuse, before any work starts, an output folder that cannot be made or written: an existing file,
    a path under a file, or a folder this user cannot write in (ConfigError, one line)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a folder; choose a folder")
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:  # the nearest part of the path that exists
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ConfigError(
            f"{option} {path} cannot be made: {nearest} is a file, not a folder; choose another path"
        )
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{option} {path} cannot be written: this user may not write in {nearest}; choose a folder you can write"
        )


def is_disk_full(e: BaseException) -> bool:
    """A write failed because the disk is full: OSError ENOSPC, or a library's error that says so
    (safetensors reports it as its own error holding the OS message)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "StorageFull" in str(e)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full_error(
    path: str | Path, *, needed: int | None = None, written: int | None = None
) -> DflashkitError:
    """The one line for a full disk: which path, how much it needed (or had written) and how much is free;
    what was published before stays, so the same command runs again once there is room."""
    path = Path(path)
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:
        nearest = nearest.parent
    try:
        free = _size(shutil.disk_usage(nearest).free)
    except OSError:
        free = "unknown"
    sizes = [f"{_size(needed)} needed"] if needed is not None else []
    sizes += [f"{_size(written)} written when it filled"] if written is not None else []
    sizes.append(f"{free} free")
    return DflashkitError(
        f"the disk is full writing {path} ({', '.join(sizes)}); nothing written before is lost: free some space "
        "and run the same command again (a training run: with --resume)"
    )


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


@contextmanager
def disk_full_said(path: str | Path, *, needed: int | None = None, tmp: Path | None = None) -> Iterator[None]:
    """Around a write of ``path``: a full disk becomes ``disk_full_error`` (its temporary file ``tmp``
    removed), any other error passes unchanged."""
    try:
        yield
    except BaseException as e:
        if not is_disk_full(e) or isinstance(e, DflashkitError):
            raise
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise disk_full_error(path, needed=needed) from e

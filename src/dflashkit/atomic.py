"""Crash-safe folders: write into a temporary folder beside the destination, fsync, then rename.

The one way dflashkit publishes a checkpoint, a drafter or any other folder: a reader never sees a
half-written one, and a failure leaves what was there before.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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

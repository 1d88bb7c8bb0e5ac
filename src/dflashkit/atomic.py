"""Crash-safe folders: write into a temporary folder beside the destination, fsync, then rename.

The one way dflashkit publishes a checkpoint, a drafter or any other folder: a reader never sees a
half-written one, and a failure leaves what was there before.
"""

from __future__ import annotations

import os
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

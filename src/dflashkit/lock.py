"""One writer per folder: an exclusive lock that every command takes on each folder it writes.

`folder_lock(folder)` holds ``fcntl.flock`` on ``<folder>/.dflashkit.lock`` (a run, a dataset, a capture,
an eval or bench folder), or, with ``beside=True``, on ``<parent>/.<name>.lock`` for a folder that is
replaced whole by a rename (a `convert` or `init` destination). A second writer fails at once with one line
naming the holder's pid and host (written into the lock file). The kernel releases the lock when its
process exits, however it exits (kill -9 included), so a stale lock file never blocks anyone. Once the lock
is taken, the debris an interrupted writer left (`dflashkit.atomic.clean_debris`) is cleaned: no live
process can be writing it.

Commands take their locks with `hold_folder`, held until the command returns (`release_held`, which the
command line calls); code that writes a folder for a while inside one call uses `folder_lock` itself.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from dflashkit.atomic import clean_debris
from dflashkit.errors import DflashkitError

LOCK_FILE = ".dflashkit.lock"

_held: dict[Path, int] = {}  # lock files this process holds, and how many holders share each
_command_locks = ExitStack()  # what `hold_folder` took; `release_held` lets go


class FolderInUseError(DflashkitError):
    """Another process is writing the folder."""


def lock_path(folder: str | Path, *, beside: bool = False) -> Path:
    """The lock file of ``folder``: inside it, or, with ``beside``, next to it (``.<name>.lock``)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.lock" if beside else folder / LOCK_FILE


@contextmanager
def folder_lock(folder: str | Path, *, beside: bool = False) -> Iterator[Path]:
    """Hold the exclusive lock of ``folder`` (made if missing) for the block; raise `FolderInUseError`
    naming the holder when another process holds it. The same process may take it again (nested)."""
    folder = Path(folder)
    path = lock_path(folder, beside=beside).absolute()
    if path in _held:
        _held[path] += 1
        try:
            yield path
        finally:
            _held[path] -= 1
        return
    made = not path.parent.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DflashkitError(
            f"cannot make {path.parent} ({e.strerror}); choose a folder you can write"
        ) from None
    fd = _acquire(path, folder)
    _held[path] = 1
    try:
        clean_debris(folder.parent, only=folder.name) if beside else clean_debris(folder)
        yield path
    finally:
        del _held[path]
        try:
            os.unlink(path)  # while still held: the next writer makes a fresh file (`_acquire` checks)
        except OSError:
            pass
        os.close(fd)
        if made:  # a folder made only to hold the lock (a command that failed before writing) goes again
            try:
                path.parent.rmdir()
            except OSError:
                pass


def hold_folder(folder: str | Path, *, beside: bool = False) -> Path:
    """Take the lock of ``folder`` until the command ends (`release_held`)."""
    return _command_locks.enter_context(folder_lock(folder, beside=beside))


def release_held() -> None:
    """Let go of every lock `hold_folder` took (the command line calls it when a command returns)."""
    _command_locks.close()


def _acquire(path: Path, folder: Path) -> int:
    """Open, lock and sign ``path``; the file must still be the one at ``path`` once locked (a holder
    that just let go unlinks it: the lock on an unlinked file guards nothing)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DflashkitError(
                f"cannot write the lock file {path} ({e.strerror}); choose a folder you can write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise FolderInUseError(
                f"{folder} is being written by another process ({holder}); wait for it to finish or stop it, "
                "or write somewhere else"
            ) from None
        except OSError as e:  # a file system without locks (some network and FUSE mounts): go on, say so
            print(
                f"dflashkit: warning: {path.parent} cannot be locked ({e.strerror}); make sure no other "
                "dflashkit command writes it at the same time",
                file=sys.stderr,
            )
            break
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    signature = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(signature) + "\n").encode())
    return fd


def _read_holder(fd: int) -> str:
    """'pid 123 on host h, since <time>' from a held lock file."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {data['pid']} on host {data['host']}, since {data.get('since', '?')}"
    except (ValueError, KeyError, TypeError, OSError):
        return "its pid not written yet"

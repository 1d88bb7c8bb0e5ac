"""Checksums of checkpoint folders: every file's sha256, recorded when the folder is written and checked
when it is read, so that a truncated or corrupted file is one clear line naming it instead of a traceback
from deep inside safetensors or torch, or, worse, a silently worse drafter.

A folder written by dflashkit (a training checkpoint, ``best/``, ``dflashkit init`` or ``convert``) holds
``checksums.json``: ``{"algorithm": "sha256", "files": {name: hex digest}}``, written last, inside the
temporary folder of `dflashkit.atomic.atomic_dir`, before the folder is published. A folder without one
(written by another tool, or by an older dflashkit) gets the structural checks only: a safetensors file
must be as long as its header says, a torch zip archive must end in its central directory. A folder that
dflashkit wrote (it holds training state, a run config or a fingerprint) and that has lost its
checksums.json is refused (`require_checksums`): a damaged file in it could no longer be found.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path

from dflashkit.errors import CheckpointError

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 20


# Files only a folder dflashkit wrote holds beside a drafter: such a folder was written with checksums.
OWN_FILES = ("training_state.json", "training_state.pt", "run_config.yaml", "fingerprint.json")
# Set to 1 to read a folder of ours that lost its checksums.json with structural checks only.
ALLOW_MISSING_ENV = "DFLASHKIT_ALLOW_MISSING_CHECKSUMS"


class CorruptFileError(CheckpointError):
    """A checkpoint file is truncated, corrupted or missing."""


class MissingChecksumsError(CheckpointError):
    """A folder dflashkit wrote has lost its checksums.json."""


def file_digest(path: str | Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(folder: str | Path) -> Path:
    """Record the digest of every file in ``folder`` (not in subfolders) in ``checksums.json``.

    Call it last, when every other file of the folder is written (inside `atomic_dir`)."""
    folder = Path(folder)
    files = {
        p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS_FILE
    }
    path = folder / CHECKSUMS_FILE
    path.write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=2) + "\n")
    return path


def read_checksums(folder: str | Path) -> dict[str, str] | None:
    """The recorded digests of ``folder`` ({file name: digest}), or None when it has no checksums.json."""
    path = Path(folder) / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"expected algorithm {ALGORITHM} and a files mapping")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path} is corrupted ({e}); the folder cannot be checked") from None
    return {str(k): str(v) for k, v in files.items()}


def require_checksums(folder: str | Path) -> None:
    """Refuse a folder that dflashkit wrote (it holds one of `OWN_FILES`) whose checksums.json is gone,
    unless DFLASHKIT_ALLOW_MISSING_CHECKSUMS=1; a folder another tool wrote (z-lab, speculators) has none
    and passes."""
    folder = Path(folder)
    if os.environ.get(ALLOW_MISSING_ENV) == "1" or (folder / CHECKSUMS_FILE).is_file():
        return
    ours = [n for n in OWN_FILES if (folder / n).is_file()]
    if ours:
        raise MissingChecksumsError(
            f"{folder} was written by dflashkit (it holds {ours[0]}) but its {CHECKSUMS_FILE} is missing, so "
            f"a damaged file in it cannot be found; copy the folder again with its {CHECKSUMS_FILE}, or set "
            f"{ALLOW_MISSING_ENV}=1 to use it with structural checks only"
        )


def verify_files(folder: str | Path, names: Iterable[str] | None = None) -> None:
    """Check the files ``names`` of ``folder`` (every recorded file when None) against checksums.json, or,
    in a folder without one, check that they are structurally whole (a folder dflashkit wrote must have
    one: `require_checksums`). Raises `CorruptFileError` naming the first bad file."""
    folder = Path(folder)
    recorded = read_checksums(folder)
    if recorded is None:
        require_checksums(folder)
    wanted = list(recorded if recorded is not None and names is None else (names or []))
    for name in wanted:
        path = folder / name
        if not path.is_file():
            if recorded is not None and name in recorded:
                raise CorruptFileError(
                    f"{path} is missing (its checksum is recorded in {CHECKSUMS_FILE}); the checkpoint is "
                    "incomplete: copy it again, or use another checkpoint"
                )
            continue
        if recorded is not None and name in recorded:
            if file_digest(path) != recorded[name]:
                raise CorruptFileError(
                    f"{path} is corrupted: its sha256 differs from the one recorded when it was written "
                    f"({CHECKSUMS_FILE}); copy the checkpoint again, or use another checkpoint"
                )
            continue
        check_structure(path)


def check_structure(path: Path) -> None:
    """Whether a weights or state file is whole, from its own structure (no checksum needed)."""
    if path.suffix == ".safetensors":
        problem = _safetensors_problem(path)
    elif path.suffix == ".pt":
        problem = None if zipfile.is_zipfile(path) else "not a complete torch archive"
    else:
        return
    if problem:
        raise CorruptFileError(
            f"{path} is truncated or corrupted ({problem}); copy the checkpoint again, or use another checkpoint"
        )


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing, or None: 8 bytes of header length, a JSON header,
    then exactly the tensor bytes the header describes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"a {n}-byte header in a {size}-byte file"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return "its header is not valid JSON"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{size} bytes where its header describes {expected}"
    return None

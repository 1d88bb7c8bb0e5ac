"""A portable compile cache: torch.compiler's cache artifacts in one file, keyed by the environment.

Compile caches are for speed only. `save_compile_cache` writes everything compiled so far with the
environment's critical fingerprint entries (torch build, CUDA, triton, GPU type); `load_compile_cache`
refuses a file built by another environment, with one line naming what differs. `portable_cache` wraps
a warm-up with both (`run.compile_cache`): a cache that does not fit or cannot be read or written is
reported, never fatal.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import DflashkitError
from dflashkit.runtime import fingerprint


class CompileCacheError(DflashkitError):
    """A portable compile cache is unreadable or was built by another environment."""


CACHE_FORMAT = "dflashkit-compile-cache-1"


def cache_key(fp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fingerprint entries a compiled kernel depends on (torch build, CUDA, triton, GPU type)."""
    if fp is None:
        return fingerprint.critical()
    flat = fingerprint.flatten(fp)
    return {k: flat.get(k) for k in fingerprint.CRITICAL_KEYS}


def save_compile_cache(path: str | os.PathLike[str]) -> Path:
    """Write this process's compile artifacts (everything compiled so far) to one file, keyed by the
    environment. Raises CompileCacheError when nothing was compiled."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise CompileCacheError("nothing to save: no compile has produced cache artifacts in this process")
    return write_keyed(path, CACHE_FORMAT, saved[0])


def write_keyed(path: str | os.PathLike[str], fmt: str, data: bytes) -> Path:
    """``data`` in one file behind a header line (its format, the environment's key, its length), written
    atomically (a temporary file per writer, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": fmt, "key": cache_key(), "bytes": len(data)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # per writer
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_compile_cache(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    return read_keyed(path, CACHE_FORMAT, "a dflashkit compile cache", "write one with save_compile_cache()")


def read_keyed(path: str | os.PathLike[str], fmt: str, what: str, how: str) -> tuple[dict[str, Any], bytes]:
    """The header and payload of a file ``write_keyed`` wrote in format ``fmt`` (``check_environment``
    checks its key). CompileCacheError, in one line, for a missing, foreign or truncated file."""
    path = Path(path)
    if not path.is_file():
        raise CompileCacheError(f"{path} does not exist; {how}")
    with open(path, "rb") as f:
        first = f.readline()
        data = f.read()
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != fmt:
        raise CompileCacheError(f"{path} is not {what}")
    if header.get("bytes") != len(data):
        raise CompileCacheError(f"{path} is truncated ({len(data)} of {header.get('bytes')} bytes)")
    return header, data


def check_environment(path: Path, header: dict[str, Any], fp: dict[str, Any] | None) -> None:
    """CompileCacheError naming the first entry where the file's environment differs from this one."""
    here = cache_key(fp)
    differ = [k for k in here if header["key"].get(k) != here[k]]
    if differ:
        first = differ[0]
        raise CompileCacheError(
            f"{path} was built by another environment ({', '.join(differ)} differ: {first} "
            f"{header['key'].get(first)!r} there, {here[first]!r} here); delete it and let this machine "
            f"compile (caches are for speed only)"
        )


def load_compile_cache(path: str | os.PathLike[str], fp: dict[str, Any] | None = None) -> Any:
    """Load a portable compile cache written by save_compile_cache, after checking that it was built by
    this environment (same torch build, CUDA, triton and GPU type). Returns torch's CacheInfo."""
    header, data = read_compile_cache(path)
    check_environment(Path(path), header, fp)
    try:
        return torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a payload torch cannot read: the cache is only for speed
        raise CompileCacheError(f"{path} could not be loaded by torch ({type(e).__name__}: {e})") from None


def _fx_cache_misses() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def _fx_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


@dataclass
class CacheUse:
    """What ``portable_cache`` saw: the file loaded, and Inductor graphs compiled (cache misses) and found in
    a cache (hits: the loaded file, or this machine's own Inductor cache) during the block."""

    loaded: bool = False
    compiled: int = 0
    cached: int = 0

    @property
    def warm(self) -> bool:
        """Every graph came from a cache: nothing was compiled."""
        return self.cached > 0 and self.compiled == 0


@contextlib.contextmanager
def _count(use: CacheUse) -> Iterator[CacheUse]:
    misses, hits = _fx_cache_misses(), _fx_cache_hits()
    yield use
    use.compiled, use.cached = _fx_cache_misses() - misses, _fx_cache_hits() - hits


@contextlib.contextmanager
def portable_cache(
    path: str | os.PathLike[str] | None, console: Any = None, *, save: bool = True
) -> Iterator[CacheUse]:
    """Around a warm-up: load the cache file first when it exists and fits this environment, and write it
    afterwards when the warm-up compiled anything the file did not hold (``save=False``: never write, e.g.
    ranks other than 0). A cache is for speed only: one that does not fit or cannot be read or written is
    reported, never fatal. Yields a ``CacheUse``, filled in when the block ends."""
    use = CacheUse()
    if path is None:
        with _count(use):
            yield use
        return

    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    if Path(path).is_file():
        t0 = time.perf_counter()
        try:
            load_compile_cache(path)
            use.loaded = True
            say(f"compile cache {path}: loaded in {time.perf_counter() - t0:.1f} s")
        except (CompileCacheError, OSError) as e:
            say(f"[yellow]compile cache not used: {e}[/]")
    with _count(use):
        yield use
    if save and (not use.loaded or use.compiled > 0):
        try:
            save_compile_cache(path)
            say(f"compile cache written to {path} ({Path(path).stat().st_size / 2**20:.1f} MiB)")
        except (CompileCacheError, OSError) as e:
            say(f"[yellow]compile cache not written: {e}[/]")

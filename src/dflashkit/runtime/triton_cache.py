"""The decoder kernels' compiled binaries in the portable compile cache, beside torch.compile's.

Triton compiles each hand-written kernel (``dflashkit.infer.kernels.decoder``, ``dflashkit.infer.kernels.tree``) once
per set of its compile-time sizes, on its first call, and keeps the binary in its own cache folder
(``triton.knobs.cache.dir``, ``~/.triton/cache`` by default): a warm start on the same machine, a cold one
(~30 variants for the graphs engine's Triton layers) on a fresh one. So the graphs engine with Triton layers keeps them in a file of its own
(``dflashkit.infer.engine.kernel_cache_path``, ``FILE.triton``): the cache entries of the named kernels and of their launchers (Triton builds each kernel signature's launcher with the C
compiler, ~0.3-0.5 s apiece, into the same folder: a warm start that found the binaries but not them would still
build ~30; those the warm-up loaded, ``launchers_loaded``, whether it built them or found them there), packed,
keyed by the environment as the compile cache is (the same torch build, CUDA, Triton and GPU type, or it is
refused in one line), and unpacked into Triton's folder before a warm-up (an entry already there is kept).
For speed only: one that does not fit or cannot be read or written is reported, never fatal.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflashkit.runtime.compile_cache import CompileCacheError, check_environment, read_keyed, write_keyed

FORMAT = "dflashkit-triton-cache-1"


def sibling(compile_cache: str | os.PathLike[str]) -> Path:
    """The Triton file beside a portable compile cache file."""
    return Path(f"{os.fspath(compile_cache)}.triton")


def cache_dir() -> Path:
    """Triton's cache folder for kernels compiled in this process (TRITON_CACHE_DIR, else ~/.triton/cache)."""
    try:
        import triton

        return Path(triton.knobs.cache.dir)
    except (ImportError, AttributeError):  # an older Triton: its documented default
        return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def entries(names: Iterable[str], folder: Path | None = None) -> list[Path]:
    """The cache entries (one folder per compiled variant) of the kernels ``names``: those holding a
    ``<name>.json`` (Triton's metadata for it)."""
    folder = folder or cache_dir()
    wanted = {f"{n}.json" for n in names}
    if not folder.is_dir():
        return []
    return sorted(d for d in folder.iterdir() if d.is_dir() and any(f.name in wanted for f in d.iterdir()))


def listing(folder: Path | None = None) -> set[str]:
    """The entries of Triton's cache folder by name (before a warm-up: what it then adds is the rest)."""
    folder = folder or cache_dir()
    return {d.name for d in folder.iterdir() if d.is_dir()} if folder.is_dir() else set()


def launchers(keep: set[str], folder: Path | None = None) -> list[Path]:
    """The entries among ``keep`` (by name) that hold a module Triton builds with the C compiler (a kernel
    signature's ``__triton_launcher``, the driver's ``cuda_utils``): those a warm-up added, or a file held."""
    folder = folder or cache_dir()
    if not folder.is_dir():
        return []
    built = ("__triton_launcher", "cuda_utils")
    return sorted(
        d
        for d in folder.iterdir()
        if d.name in keep and d.is_dir() and any(f.name.startswith(built) for f in d.iterdir())
    )


@contextlib.contextmanager
def launchers_loaded() -> Iterator[set[str]]:
    """The cache entries (by name) of the C modules Triton's CUDA driver loads within this block: a kernel
    signature's launcher (``triton.runtime.build.compile_module_from_src``, wrapped where the driver calls it),
    each named by the folder of the file it was loaded from, as Triton's cache manager named it (a name derived
    from a hash of the source, whose scheme is Triton's own). Those it found in the cache folder, built by an
    earlier process, count too: the folder's new entries alone would miss them, and a file written on a machine
    that had them would make another machine build them again. Empty where this Triton has no such function."""
    loaded: set[str] = set()
    try:
        from triton.backends.nvidia import driver

        original = driver.compile_module_from_src
    except (ImportError, AttributeError):
        yield loaded
        return

    def recording(src: str, name: str, *args, **kwargs):
        module = original(src, name, *args, **kwargs)
        file = getattr(module, "__file__", None)
        if file:
            loaded.add(Path(file).parent.name)
        return module

    driver.compile_module_from_src = recording
    try:
        yield loaded
    finally:
        driver.compile_module_from_src = original


def save(path: str | os.PathLike[str], names: Iterable[str], also: Iterable[Path] = ()) -> int:
    """Pack the cache entries of the kernels ``names``, and the entries ``also`` (their launchers:
    ``launchers``), into ``path`` (keyed by this environment; written atomically). Returns how many;
    CompileCacheError when no kernel of ``names`` is there."""
    kernels = entries(names)
    if not kernels:
        raise CompileCacheError("no compiled kernel of the engine's in Triton's cache folder")
    found = sorted(set(kernels) | set(also))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for d in found:
            tar.add(d, arcname=d.name)
    write_keyed(path, FORMAT, buffer.getvalue())
    return len(found)


def held(path: str | os.PathLike[str]) -> set[str]:
    """The cache entries a file ``save`` wrote holds, by name (empty for one that cannot be read)."""
    try:
        _, data = read_keyed(
            path, FORMAT, "a dflashkit Triton cache", "a warm-up with --layers triton writes one"
        )
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            return {Path(m.name).parts[0] for m in tar.getmembers()}
    except (CompileCacheError, tarfile.TarError, OSError):
        return set()


def load(path: str | os.PathLike[str]) -> int:
    """Unpack ``path`` into Triton's cache folder after checking its environment (CompileCacheError in one
    line otherwise); an entry already there is kept. Returns how many entries it added."""
    header, data = read_keyed(
        path, FORMAT, "a dflashkit Triton cache", "a warm-up with --layers triton writes one"
    )
    check_environment(Path(path), header, None)
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    added = 0
    try:
        with (
            tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar,
            tempfile.TemporaryDirectory(dir=folder, prefix=".dflashkit-") as tmp,
        ):
            members = tar.getmembers()
            for m in members:  # plain files and folders, each inside its entry
                parts = Path(m.name).parts
                if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts:
                    raise CompileCacheError(f"{path} holds {m.name!r}, which is no Triton cache file")
            new = sorted({Path(m.name).parts[0] for m in members} - {d.name for d in folder.iterdir()})
            tar.extractall(tmp, members=[m for m in members if Path(m.name).parts[0] in new])
            for name in new:  # each entry whole, as Triton itself writes one
                try:
                    os.rename(Path(tmp) / name, folder / name)
                    added += 1
                except OSError:  # written meanwhile by another process: keep that one
                    pass
    except (tarfile.TarError, OSError) as e:
        raise CompileCacheError(f"{path} could not be unpacked ({type(e).__name__}: {e})") from None
    return added

"""The environment fingerprint: what exactly ran, so that "what changed?" always has an answer.

A fingerprint is a plain JSON-able dict. `collect()` reads it from the live process, `save()`/`load()`
write and read it, and `diff()` compares two of them, flagging the entries whose change is known to
change compiled-kernel behaviour (torch build, CUDA, triton, GPU type) as critical.

Every run folder and checkpoint holds one as `fingerprint.json` (see `FINGERPRINT_FILE`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from dflashkit.atomic import write_json
from dflashkit.errors import DflashkitError

SCHEMA = 1
FINGERPRINT_FILE = "fingerprint.json"

# Packages whose versions we record by name (the package-set hash covers everything else).
KEY_PACKAGES = (
    "torch",
    "triton",
    "pytorch-triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "gguf",
    "numpy",
    "pydantic",
    "dflashkit",
    "speculators",
)

# Environment variables that change compile or distributed behaviour.
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_", "NCCL_", "CUDA_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "HF_HUB_OFFLINE")

# Dotted keys (after flattening) whose change is critical: a compiled kernel or its cache can differ.
CRITICAL_KEYS = (
    "torch.version",
    "torch.git_version",
    "torch.cuda",
    "packages.triton",
    "packages.pytorch-triton",
    "gpu.names",
    "gpu.capabilities",
)


def _package_versions() -> tuple[dict[str, str], str, int]:
    """Versions of the key packages, a hash of the whole installed set, and its size."""
    everything: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            everything[name] = dist.version
    blob = "\n".join(f"{k}=={v}" for k, v in sorted(everything.items()))
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    key = {name: everything[name] for name in KEY_PACKAGES if name in everything}
    return key, digest, len(everything)


def _torch_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "version": torch.__version__,
        "git_version": torch.version.git_version,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "debug": torch.version.debug,
        "cudnn": None,
        "nccl": None,
        "num_threads": torch.get_num_threads(),
    }
    try:
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # pragma: no cover - depends on the build
        info["cudnn"] = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # pragma: no cover - depends on the build
        info["nccl"] = None
    return info


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out else None


def _gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"count": 0, "names": [], "capabilities": [], "memory_gib": [], "driver": None}
    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    return {
        "count": n,
        "names": [p.name for p in props],
        "capabilities": [f"{p.major}.{p.minor}" for p in props],
        "memory_gib": [round(p.total_memory / 2**30, 1) for p in props],
        "driver": _driver_version(),
    }


def inductor_cache_dir() -> Path:
    """Where Inductor keeps its on-disk cache (the directory need not exist yet)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir())
    except Exception:  # pragma: no cover - older/newer layouts
        import getpass
        import tempfile

        return Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def _cache_info() -> dict[str, Any]:
    path = inductor_cache_dir()
    size = 0
    entries = 0
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for f in files:
                entries += 1
                try:
                    size += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
    return {
        "path": str(path),
        "exists": path.is_dir(),
        "entries": entries,
        "size_mib": round(size / 2**20, 2),
        "state": "warm" if entries else "cold",
    }


def _env_info() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def collect() -> dict[str, Any]:
    """Read the fingerprint of this process's environment."""
    packages, digest, count = _package_versions()
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "torch": _torch_info(),
        "gpu": _gpu_info(),
        "packages": packages,
        "package_set": {"hash": digest, "count": count},
        "env": _env_info(),
        "inductor_cache": _cache_info(),
    }


def save(fp: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a fingerprint as JSON, atomically (a crash never leaves half a file)."""
    path = Path(path)
    if path.is_dir():
        path = path / FINGERPRINT_FILE
    return write_json(path, fp, sort_keys=True)


class FingerprintError(DflashkitError):
    """A fingerprint file is missing or unreadable."""


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a fingerprint from a JSON file, or from a run/checkpoint folder that holds one."""
    p = Path(path)
    if p.is_dir():
        if not (p / FINGERPRINT_FILE).is_file():  # never a subfolder's in its place: say which there are
            inside = sorted(c.parent.name for c in p.glob(f"*/{FINGERPRINT_FILE}"))
            hint = (
                f"its subfolders {', '.join(inside)} have one: pass the one you mean (e.g. {p / inside[0]})"
                if inside
                else "pass a fingerprint file, or a run or checkpoint folder written by dflashkit"
            )
            raise FingerprintError(f"{p} is a folder without a {FINGERPRINT_FILE}; {hint}")
        p = p / FINGERPRINT_FILE
    if not p.is_file():
        raise FingerprintError(f"{p} does not exist; write one with `dflashkit doctor --json {p}`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise FingerprintError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or "torch" not in data:
        raise FingerprintError(f"{p} is not a dflashkit fingerprint (no 'torch' section)")
    return data


@functools.lru_cache(maxsize=1)
def _critical_cached() -> tuple[tuple[str, Any], ...]:
    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    props = (
        [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    found = {
        "torch.version": torch.__version__,
        "torch.git_version": torch.version.git_version,
        "torch.cuda": torch.version.cuda,
        "packages.triton": version("triton"),
        "packages.pytorch-triton": version("pytorch-triton"),
        "gpu.names": [p.name for p in props],
        "gpu.capabilities": [f"{p.major}.{p.minor}" for p in props],
    }
    return tuple((k, found[k]) for k in CRITICAL_KEYS)


def critical() -> dict[str, Any]:
    """The critical entries alone (``CRITICAL_KEYS``: what a compiled kernel depends on), as ``collect()``
    flattened has them, read once a process: the compile caches key their files by them, and a warm start
    checks several files, where the whole fingerprint reads every installed package's metadata and asks
    nvidia-smi each time."""
    return dict(_critical_cached())


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted keys; lists are kept as values (compared whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Entries that differ on every run and say nothing about the environment. TORCHINDUCTOR_CACHE_DIR is set
# in the process itself (torch's cache_dir(), which `inductor_cache_dir` calls, exports its default): the
# cache folder in effect is compared as inductor_cache.path.
IGNORED_IN_DIFF = (
    "created",
    "inductor_cache.size_mib",
    "inductor_cache.entries",
    "env.TORCHINDUCTOR_CACHE_DIR",
)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    critical: bool


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[Change]:
    """Entries that differ between fingerprints a and b, critical ones first."""
    fa, fb = flatten(a), flatten(b)
    changes = []
    for key in sorted(set(fa) | set(fb)):
        if key in IGNORED_IN_DIFF:
            continue
        old, new = fa.get(key), fb.get(key)
        if old != new:
            changes.append(Change(key, old, new, key in CRITICAL_KEYS))
    changes.sort(key=lambda c: (not c.critical, c.key))
    return changes


def has_critical(changes: list[Change]) -> bool:
    return any(c.critical for c in changes)

"""Devices and dtypes: the config's "auto" settings resolved against this machine, in one place.

Every layer that places work asks here: the run's device (`resolve_device`), a device named in a config
(`parse_device`), the target's dtype (`target_dtype`), mixed precision (`autocast_context`), the attention
backend (`resolve_backend`) and whether the drafter's layers and loss chunks run compiled
(`use_compiled_regions`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dflashkit.config import RunConfig
from dflashkit.errors import ConfigError, DeviceError


def resolve_device(cfg: RunConfig) -> torch.device:
    """run.device: "auto" is the GPU when there is one, else the CPU."""
    want = cfg.run.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(want)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"run.device={want} but this machine has no CUDA GPU; use run.device=cpu or auto")
    return dev


def parse_device(text: str, where: str) -> torch.device:
    """A device a config names (``where`` says which setting): cpu, cuda (= cuda:0), cuda:N on this
    machine; one clear error otherwise."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"{where}: {text!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"{where} is {text} but this machine has no CUDA GPU; use cpu or auto")
        dev = torch.device("cuda", dev.index or 0)
        if dev.index >= count:
            raise DeviceError(
                f"{where} is {text} but this machine has {count} GPU(s) (cuda:0..cuda:{count - 1})"
            )
    return dev


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` the current CUDA device for a block (threads keep their own); nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def target_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """target.dtype: "auto" is bfloat16 on a GPU, float32 on the CPU."""
    if cfg.target.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.target.dtype)


def autocast_context(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """train.autocast: bf16 autocast ("auto": on a GPU), or nothing."""
    use = cfg.train.autocast == "bf16" or (cfg.train.autocast == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else contextlib.nullcontext()


def resolve_backend(cfg: RunConfig, device: torch.device) -> str:
    """attention.backend: "auto" is flex on a GPU, sdpa on the CPU (flex has no CPU backward)."""
    backend = cfg.attention.backend
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "attention.backend=flex cannot train on the CPU (flex has no CPU backward); use sdpa"
        )
    return backend


def use_compiled_regions(cfg: RunConfig, backend: str, strategy: str = "single") -> bool:
    """Whether the drafter's layers and the loss chunks run as compiled regions (train.compile)."""
    want = cfg.train.compile
    if want == "off":
        return False
    if backend != "flex" or strategy == "fsdp":
        if want == "on":
            why = "FSDP shards the layers' weights" if strategy == "fsdp" else f"the backend is {backend}"
            raise ConfigError(
                f"train.compile=on needs the flex attention backend without FSDP ({why}); use train.compile=auto"
            )
        return False
    return True

"""Device selection: the one place that turns `run.device` into a torch.device."""

from __future__ import annotations

import torch

from ferry.config.errors import ConfigError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` takes the accelerator torch was built for when one is present, else the CPU."""
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        name = accelerator.type if accelerator is not None else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    module = getattr(torch, name, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        raise ConfigError(f"run.device: {name!r} is not available on this machine")
    return torch.device(name, local_rank % module.device_count())

"""Launching: several local processes through PyTorch's elastic launcher (torchrun's engine)."""

from ferry.launch.local import launch_local

__all__ = ["launch_local"]

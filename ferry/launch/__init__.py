"""Launching: local ranks through PyTorch's elastic launcher (torchrun's engine), and the supervisor that restarts them."""

from ferry.launch.local import launch_local
from ferry.launch.supervisor import supervise

__all__ = ["launch_local", "supervise"]

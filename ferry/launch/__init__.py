"""Launching: local ranks through PyTorch's elastic launcher (torchrun's engine), the supervisor that
restarts them, and the files that start a job on a cluster (torchrun, Slurm, Kubernetes) from one spec."""

from ferry.launch.local import launch_local
from ferry.launch.platform import Platform, load_platform, platform_names
from ferry.launch.render import render_launch, write_launch
from ferry.launch.spec import LaunchSpec, build_launch_spec
from ferry.launch.supervisor import supervise

__all__ = [
    "LaunchSpec",
    "Platform",
    "build_launch_spec",
    "launch_local",
    "load_platform",
    "platform_names",
    "render_launch",
    "supervise",
    "write_launch",
]

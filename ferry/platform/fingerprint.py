"""Environment fingerprint: what a run record needs to say where it ran.

Two runs are only comparable when their fingerprints say what differed
(software, device, driver), so every run and checkpoint carries one.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

import ferry


def environment_fingerprint(device: torch.device) -> dict:
    """Python, torch, device, driver and code version of this process, with the CPU it ran on: its model,
    logical cores and torch's threads, against which a throughput figure is read."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "device_type": device.type,
        "device_name": _device_name(device),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "cuda_runtime": torch.version.cuda,
        "hip_runtime": getattr(torch.version, "hip", None),
        "code": code_version(),
    }
    return info


def code_version() -> dict:
    """The package version, plus the git commit and dirty flag when run from a checkout."""
    root = Path(ferry.__file__).resolve().parent.parent
    version = {"ferry": ferry.__version__, "git_commit": None, "git_dirty": None}
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode == 0:
            version["git_commit"] = commit.stdout.strip()
            status = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            version["git_dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return version


def cpu_model() -> str | None:
    """The CPU's model name ("AMD EPYC 9654 96-Core Processor") from /proc/cpuinfo, where `platform.processor()`
    says only "x86_64" on Linux; `platform.processor()` elsewhere, or None when neither names it."""
    try:
        with Path("/proc/cpuinfo").open(encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return platform.processor() or platform.machine()
    module = getattr(torch, device.type)
    return module.get_device_name(device) if hasattr(module, "get_device_name") else device.type

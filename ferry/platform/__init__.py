"""Platform: which device this process runs on and what the environment is."""

from ferry.platform.device import resolve_device
from ferry.platform.fingerprint import environment_fingerprint

__all__ = ["resolve_device", "environment_fingerprint"]

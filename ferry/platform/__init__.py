"""Platform: which device this process runs on and what the environment is.

The names below load their modules on first use: `ferry.platform.process` (how a process ends when it
is stopped), which the command line imports before it parses anything, must not pull torch in with them.
"""

from __future__ import annotations

from importlib import import_module

_LAZY = {"resolve_device": "ferry.platform.device", "environment_fingerprint": "ferry.platform.fingerprint"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)

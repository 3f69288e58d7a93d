"""Files given the mode an ordinary `open()` gives them, when the library that wrote them chose another.

safetensors' `save_file` (and so transformers' `save_pretrained`) creates its file mode 0600 whatever
the umask, while every other file of a checkpoint or an export (`manifest.json`, `config.json`) takes
the umask: on a shared cluster filesystem another account (an evaluation job) could read the manifest
but not the tensors it lists. ferry writes such files, then gives them `0o666 & ~umask`.
"""

from __future__ import annotations

import os
from pathlib import Path

_STATUS = Path("/proc/self/status")


def process_umask() -> int:
    """The process's umask, read from `/proc/self/status` where the kernel reports it (Linux 4.7 and later).

    The portable way, `os.umask` to set a value and read the old one back, leaves the umask wrong for
    a moment: a file another thread creates then (a checkpoint saved on a helper thread, a metrics
    sink) would take that value instead of the process's. Where it must be used, the value set for that
    moment is 0o077, so such a file is at worst private, never open to others.
    """
    try:
        for line in _STATUS.read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o077)
    os.umask(current)
    return current


def give_ordinary_mode(path: Path) -> None:
    """Set `path`'s permissions to those `open(path, "w")` would have created it with under the umask."""
    os.chmod(path, 0o666 & ~process_umask())

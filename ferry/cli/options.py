"""Option types shared by the commands: a value is checked where it is parsed, and the message names the flag."""

from __future__ import annotations

import argparse


def device_option(name: str) -> str:
    """`--device NAME`: `auto`, `cpu` or an accelerator present here (the error would otherwise speak of
    `run.device`, a setting the command has not got)."""
    from ferry.config.errors import ConfigError
    from ferry.platform import resolve_device

    try:
        resolve_device(name)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not available on this machine (auto, cpu, or an accelerator present here)"
        ) from None
    return name

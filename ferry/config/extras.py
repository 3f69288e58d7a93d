"""The optional libraries a feature stands on (TensorBoard, W&B, MLflow, Ray, datatrove): imported when the config or
a command asks for the feature, and refused, naming the setting and the install command, when missing."""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from ferry.config import UserError


def import_extra(module: str, extra: str, setting: str, library: str) -> ModuleType:
    """`module`, or a `UserError` saying that `setting` asks for `library` and how to install ferry's `extra`."""
    try:
        return import_module(module)
    except ImportError:
        raise UserError(
            f"{setting} asks for {library} but the {extra} package is not installed; install it with: "
            f"pip install 'ferry-moe[{extra}]'"
        ) from None

"""YAML files a command takes by path or by name: environments (`configs/environments/`), benchmark suites
(`benchmarks/suites/`). A name is looked up in the working directory's folder first, then in ferry's own
checkout, so a project can shadow a shipped file with its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

import ferry
from ferry.config.errors import UserError


def named_files(folder: Path) -> dict[str, Path]:
    """Every `*.yaml` of `folder` by its stem, here and in ferry's checkout (here wins)."""
    found: dict[str, Path] = {}
    for root in (Path(ferry.__file__).resolve().parent.parent / folder, folder):
        for path in sorted(root.glob("*.yaml")) if root.is_dir() else ():
            found[path.stem] = path
    return found


def read_named_yaml(spec: str, folder: Path, what: str) -> tuple[Path, dict[str, Any]]:
    """The file `spec` names (a path, or a name in `folder`) and its mapping; anything else is a `UserError`."""
    path = Path(spec)
    if not path.is_file():
        known = named_files(folder)
        if spec not in known:
            names = ", ".join(sorted(known)) or "none"
            raise UserError(f"{what} {spec!r} is neither a file nor a known {what} (known: {names})")
        path = known[spec]
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{what} file {str(path)!r} cannot be read: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{what} file {str(path)!r} must hold a mapping")
    return path, raw

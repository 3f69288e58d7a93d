"""Where a dataset is written: the output claimed (refused when it holds anything but a dataset, or one of the
inputs), the dataset built in a staging directory beside it and renamed into place, so that a failed or
interrupted write leaves nothing half-written and an old dataset stays until the new one is there.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ferry.config.errors import UserError
from ferry.data.manifest import MANIFEST_NAME
from ferry.data.verification import DatasetMismatch, verify_files
from ferry.platform.digests import FAST


def claim_output(
    output: Path, overwrite: bool, settings: dict, is_current: Callable[[dict], bool], inputs: list[str]
) -> tuple[dict | None, Path | None]:
    """May a dataset be written to `output`? (The manifest of the dataset already there when it is up to
    date: the same settings, `is_current`, every file matching its digest; else None. And the file that no
    longer matched, when the same inputs are written again to repair it.) Refuses to replace anything but
    a dataset, a dataset of other inputs without `overwrite`, or a directory holding one of the `inputs`."""
    existing = output / MANIFEST_NAME
    repaired = None
    if existing.is_file():
        manifest = read_json(existing)
        if manifest.get("settings") == settings and is_current(manifest):
            try:
                verify_files(output, manifest, f"output {str(output)!r}", FAST)
                return manifest, None
            except DatasetMismatch as exc:  # the same inputs: writing it again replaces only what it was
                repaired = exc.path
        elif not overwrite:
            raise UserError(
                f"output {str(output)!r} already holds a dataset prepared from other inputs or settings; "
                "pass --overwrite to replace it"
            )
    elif output.exists() and not output.is_dir():
        raise UserError(f"output {str(output)!r} is a file, not a directory")
    elif output.exists() and any(output.iterdir()):  # --overwrite replaces a dataset, never anything else
        raise UserError(f"output {str(output)!r} exists and is not a ferry dataset; choose another directory")
    refuse_inputs_inside(output, inputs)
    return None, repaired


def refuse_inputs_inside(output: Path, inputs: list[str]) -> None:
    inside = [path for path in inputs if Path(path).resolve().is_relative_to(output.resolve())]
    if inside:
        raise UserError(f"output {str(output)!r} holds the input {inside[0]!r}, which replacing it would delete")


def write_staged(output: Path, build: Callable[[Path], dict]) -> dict:
    """`build` the directory in a staging directory beside `output` and rename it into place: an
    interrupted or failed write leaves nothing half-written, and the old directory stays until the new
    one is there."""
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        record = build(staging)
        replace_directory(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def replace_directory(staging: Path, output: Path) -> None:
    """Move the finished dataset into place; an old dataset is removed only after the new one is there."""
    for path in staging.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    output.parent.mkdir(parents=True, exist_ok=True)
    retired = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        output.rename(retired)
    staging.rename(output)
    shutil.rmtree(retired, ignore_errors=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{str(path)!r} cannot be read as JSON: {exc}") from None


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")

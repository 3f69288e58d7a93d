"""`ferry release branch DIR --stage NAME --out RUN_DIR [KEY=VALUE ...]`: a new run from a released stage.

The stage's resolved config, reading its data from the release (`ferry release --data`; else from the paths the
config names, each checked against the manifest digest the release records), starting from the stage's final
checkpoint (its weights, and its optimizer's state, AdamW's or Muon's, where the release carries it) and writing
to RUN_DIR, with the user's overrides last. Every path is taken from the release's directory, so the command works
from inside the release (its model card's `.`) and from anywhere else alike; RUN_DIR may not lie inside the release,
whose every file `ferry release verify` checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.config import ConfigError, UserError, apply_override_mapping, apply_overrides
from ferry.config.loader import validate
from ferry.portability.release.replay import (
    check_verified,
    outside_release,
    read_config,
    refuse_inside,
    released_data,
    released_stage,
)
from ferry.portability.release.verify import read_release
from ferry.train.config import RunConfig


def branch_config(directory: str | Path, stage: str, out: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The run config (plain data, validated) of a branch from `stage` of the release in `directory` (verified
    first) into `out` (default: `outside_release`'s place for it); bad input is a `UserError`."""
    directory = Path(directory).resolve()
    release = read_release(directory)
    entry = released_stage(release, stage)
    check_verified(directory, "a branch")
    name = f"{release['pipeline']['name']}-{stage}"
    out = Path(out) if out is not None else outside_release(directory, "branch", name)
    refuse_inside(directory, out, "--out")
    base = released_data(directory, release, entry, read_config(directory / entry["config"]))
    checkpoint = entry["checkpoint"]
    start = {
        "init_from": str(directory / checkpoint["path"]),
        "init_optimizer": checkpoint["optimizer"],
        "run.dir": str(out),
    }
    try:
        raw = apply_overrides(apply_override_mapping(base, start, "the branch"), overrides)
        validate(RunConfig, raw)
    except ConfigError as exc:
        raise UserError(f"stage {stage}'s config with the branch's overrides: {exc}") from None
    return raw

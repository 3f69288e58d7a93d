"""Named tolerance profiles for comparing two runs, read from `tolerances.yaml` beside this file.

The numbers are data, each with the reason for it written next to it, so that a
tolerance is changed by an argued edit of one file and never inside a test.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from ferry.config import Section, UserError
from ferry.config.loader import validate

TOLERANCES_FILE = Path(__file__).parent / "tolerances.yaml"
# The profile a run of an objective that samples its own training data is judged under (`judging_profile`).
SAMPLED_PROFILE = "sampled"


class ToleranceProfile(Section):
    """Two runs agree when, at each of the first `steps` steps, the trailing means over
    `window` steps differ by at most `atol + rtol * |mean of run A|`, plus, for a profile that
    judges against seed runs (`seeds` > 0), `spread_z` times the spread measured between runs
    that differ from run A only in their seed (`ferry.portability.comparison.compare`)."""

    description: str = Field(min_length=1)
    metric: str = Field(default="loss", min_length=1, description="the metrics.jsonl key the profile judges")
    steps: int = Field(ge=1, description="how many early steps are judged by default")
    window: int = Field(ge=1, description="trailing moving-average window, in steps (1 = raw values)")
    min_steps: int = Field(ge=1, description="the shortest from-scratch window a rehearsal proves a move with")
    rtol: float = Field(ge=0.0)
    atol: float = Field(ge=0.0)
    seeds: int = Field(default=0, ge=0, description="seed runs the reference needs beside it (0: none)")
    spread_z: float = Field(default=0.0, ge=0.0, description="the band, in seed spreads (with seeds > 0)")

    @model_validator(mode="after")
    def _spread_needs_seeds(self) -> ToleranceProfile:
        if (self.seeds > 0) != (self.spread_z > 0):
            raise ValueError("seeds and spread_z go together: a band in seed spreads needs seed runs to measure it")
        return self


@lru_cache(maxsize=1)
def tolerance_profiles() -> dict[str, ToleranceProfile]:
    raw = yaml.safe_load(TOLERANCES_FILE.read_text(encoding="utf-8"))
    return {name: validate(ToleranceProfile, fields) for name, fields in raw.items()}


def tolerance_profile(name: str) -> ToleranceProfile:
    profiles = tolerance_profiles()
    if name not in profiles:
        raise UserError(f"unknown tolerance profile {name!r}; profiles: {', '.join(profiles)}")
    return profiles[name]

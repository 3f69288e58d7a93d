"""Named tolerance profiles for comparing two runs, read from `tolerances.yaml` beside this file.

The numbers are data, each with the reason for it written next to it, so that a
tolerance is changed by an argued edit of one file and never inside a test.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import Field

from ferry.config import Section, UserError
from ferry.config.loader import validate

TOLERANCES_FILE = Path(__file__).parent / "tolerances.yaml"


class ToleranceProfile(Section):
    """Two runs agree when, at each of the first `steps` steps, the trailing means over
    `window` steps differ by at most `atol + rtol * |mean of run A|`."""

    description: str = Field(min_length=1)
    steps: int = Field(ge=1, description="how many early steps are judged by default")
    window: int = Field(ge=1, description="trailing moving-average window, in steps (1 = raw values)")
    min_steps: int = Field(ge=1, description="the shortest from-scratch window a rehearsal proves a move with")
    rtol: float = Field(ge=0.0)
    atol: float = Field(ge=0.0)


@lru_cache(maxsize=1)
def tolerance_profiles() -> dict[str, ToleranceProfile]:
    raw = yaml.safe_load(TOLERANCES_FILE.read_text(encoding="utf-8"))
    return {name: validate(ToleranceProfile, fields) for name, fields in raw.items()}


def tolerance_profile(name: str) -> ToleranceProfile:
    profiles = tolerance_profiles()
    if name not in profiles:
        raise UserError(f"unknown tolerance profile {name!r}; profiles: {', '.join(profiles)}")
    return profiles[name]

"""Base class of every config section.

Sections are strict: an unknown key, a value of the wrong type or a number that is not finite
(YAML's `.inf`, `.nan`) is an error, never silently coerced, so a typo in a 10,000-GPU-hour run
fails at start-up.
"""

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A typed, validated block of configuration (pure data; components `build()` from it)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, frozen=True, allow_inf_nan=False)


def check_unique_names(items: Sequence, what: str) -> None:
    """Refuse a list of named entries (sources, stages) in which a name repeats."""
    names = [item.name for item in items]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{what} names must be unique; repeated: {', '.join(duplicates)}")

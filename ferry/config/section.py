"""Base class of every config section.

Sections are strict: an unknown key or a value of the wrong type is an error,
never silently coerced, so a typo in a 10,000-GPU-hour run fails at start-up.
"""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A typed, validated block of configuration (pure data; components `build()` from it)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, frozen=True)

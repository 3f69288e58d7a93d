"""A combination of settings a run cannot take, reported at the setting it concerns: what the one check of what
composes (`ferry/train/layouts/composition.py`) returns, each with its reason and its fix.

Raised from a config's validation as one pydantic error per refusal, each located at its key, so that the loader
lists them with the other bad keys (`ferry.config.loader.validate`)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

REFUSAL = "refusal"  # the error type the loader names a refusal by


@dataclass(frozen=True)
class Refusal:
    """`key`: the dotted setting it is reported at (`parallel`, `train.loss_chunk`); `message`: why, and the fix."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def refusals_error(title: str, refusals: list[Refusal]) -> ValidationError:
    """One validation error listing every refusal at its key."""
    details = [
        InitErrorDetails(
            type=PydanticCustomError(REFUSAL, "{message}", {"message": refusal.message}),
            loc=tuple(refusal.key.split(".")),
            input=None,
        )
        for refusal in refusals
    ]
    return ValidationError.from_exception_data(title, details)

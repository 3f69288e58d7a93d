"""Which fields of two configs differ, by dotted key: what a user needs to see when a load does not fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: checkpoint {self.saved!r}, this run {self.current!r}"


def config_differences(saved: Any, current: Any, prefix: str = "") -> list[Difference]:
    """Leaf-level differences; mappings and equal-length lists are walked, anything else compared whole."""
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in [*saved, *(k for k in current if k not in saved)]:
            found += config_differences(saved.get(key), current.get(key), f"{prefix}{key}.")
        return found
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        found = []
        for index, (left, right) in enumerate(zip(saved, current)):
            found += config_differences(left, right, f"{prefix}{index}.")
        return found
    return [] if saved == current else [Difference(prefix.rstrip("."), saved, current)]

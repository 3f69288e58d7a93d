"""The data's whole position in a run, which a checkpoint carries: apart from the loaders (which build tensors), so
that what only reads or writes a position needs no torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataCursor:
    """The loader's whole position: steps taken and windows consumed from each source."""

    step: int = 0
    consumed: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "consumed": dict(self.consumed)}

    @classmethod
    def from_dict(cls, data: dict) -> DataCursor:
        return cls(step=int(data["step"]), consumed={str(k): int(v) for k, v in data["consumed"].items()})

"""`model.skip: standard`: each block reads the whole residual stream, x + attn(norm(x)) then + ffn(norm(x))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


@dataclass(frozen=True)
class StandardWiring:
    """The pre-norm residual stream every transformers architecture has: one tensor between blocks."""

    name: ClassVar[str] = "standard"
    pipeline_refusal: ClassVar[str | None] = None
    unfinished_output: ClassVar[str | None] = None
    converts_from: ClassVar[dict[str, str]] = {}

    def stream(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return x_BSD

    def joined(self, stream: torch.Tensor) -> torch.Tensor:
        return stream

    def export_refusals(self, config: ModelShape, arch: str) -> list[str]:
        return []

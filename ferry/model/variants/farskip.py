"""`model.skip: farskip`: a block's attention reads the stream before the previous block's FFN output has joined
(`ferry/model/farskip.py`), so an expert-parallel combine overlaps the next attention. A different function from
the standard model: no transformers architecture computes it, and a pipeline stage cannot hand it over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ferry.model.farskip import FarSkipStream

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


@dataclass(frozen=True)
class FarSkipWiring:
    """The stream between blocks is a `FarSkipStream`: what has arrived, and an FFN output still on its way."""

    name: ClassVar[str] = "farskip"
    pipeline_refusal: ClassVar[str | None] = (
        "a FarSkip stream is two tensors, one still travelling, where a stage hands over one"
    )
    unfinished_output: ClassVar[str | None] = "hands each block's FFN output on unfinished"
    # the FarSkip paper converts trained standard models so (then distils): the start is allowed, and said
    converts_from: ClassVar[dict[str, str]] = {
        "standard": "model.skip: standard -> farskip: the checkpoint's standard model continues with FarSkip wiring, "
        "another function from here (a conversion, as the FarSkip paper's before its distillation)"
    }

    def stream(self, x_BSD: torch.Tensor) -> FarSkipStream:
        return FarSkipStream(x_BSD)

    def joined(self, stream: FarSkipStream) -> torch.Tensor:
        return stream.joined()

    def export_refusals(self, config: ModelShape, arch: str) -> list[str]:
        return [
            f"model.skip: {self.name} wires the residual stream otherwise than any transformers model ({arch} "
            "included): the export would compute another function"
        ]

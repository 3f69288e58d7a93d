"""FarSkip wiring (`model.skip: farskip`): a block's attention does not wait for the previous block's FFN output.

In the standard pre-norm block the attention of block i+1 reads x_{i+1} = h_i + ffn_i(norm(h_i)), so under
expert parallelism it waits for block i's combine all-to-all, and nothing else can run meanwhile. FarSkip
(Dukler et al. 2025, arXiv:2511.11505, the skip wiring AMD pre-trained Instella-MoE with) reads the stream
before that output has arrived:

    a_{i+1} = attn_{i+1}(norm(h_i))                  # runs while ffn_i's rows travel back
    h_{i+1} = h_i + ffn_i(norm(h_i)) + a_{i+1}       # ffn_i joins the stream here
    x_out   = h_{L-1} + ffn_{L-1}(norm(h_{L-1}))     # the last block's FFN joins before the final norm

so the combine of MoE layer i is in flight while block i+1 computes its attention. It is a different function
from the standard model, not an implementation of it: its checkpoints record `model.skip`, transformers has no
such model (export is refused), and a standard model continued with it computes something else from there (the
paper converts trained models by distillation; ferry allows the start and says so).

The stream between blocks is then a pair: what has arrived, and the FFN output still on its way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class LateOutput:
    """An FFN output that may still be travelling: `arrive()` waits for it (once) and returns it."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish = finish

    @classmethod
    def ready(cls, out: torch.Tensor) -> LateOutput:
        """An output computed here and now (a dense FFN, or experts that are all local)."""
        return cls(lambda: out)

    @torch.compiler.disable
    def arrive(self) -> torch.Tensor:
        """The output: waiting on its exchange is a host-side wait, so a compiled block runs it eagerly."""
        return self._finish()


@dataclass
class FarSkipStream:
    """The residual stream between FarSkip blocks: `arrived_BSD`, without `pending`'s FFN output yet."""

    arrived_BSD: torch.Tensor
    pending: LateOutput | None = None

    def joined(self) -> torch.Tensor:
        """The whole stream: what arrived plus the FFN output, now waited for."""
        if self.pending is None:
            return self.arrived_BSD
        return self.arrived_BSD + self.pending.arrive()

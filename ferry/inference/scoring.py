"""A batch the model scores without gradients, and what to keep of its output.

Held-out losses, DPO's answer log-probs and GRPO's reference log-probs each need a few numbers per row, not the
logits: a `ScoringPass` says which inputs to run and how to reduce the output, so that wherever the model is split
over ranks (a pipeline's stages) only the reduction travels. A training run scores through its step context; a
process holding the whole model (`ferry eval`) scores with `score_with(model)`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ferry.model import ModelOutput
from ferry.model.head_loss import HeadTargets


@dataclass(frozen=True)
class ScoringPass:
    """The model's inputs (`document_ids_BS`: attention within documents; `head`: the head and loss computed
    together by chunks, no logits made) and `reduce(output)`, what is kept of its output: figures of whole rows,
    which a sequence split over context-parallel ranks makes whole with `ModelOutput.summed`."""

    tokens_BS: torch.Tensor
    padding_BS: torch.Tensor | None
    reduce: Callable[[ModelOutput], torch.Tensor]
    document_ids_BS: torch.Tensor | None = None
    head: HeadTargets | None = None


Scorer = Callable[[ScoringPass], torch.Tensor]


def score_with(model: torch.nn.Module, autocast: AbstractContextManager | None = None) -> Scorer:
    """Scoring by a whole model in this process, without gradients, under `autocast` if given."""

    @torch.no_grad()
    def score(scoring: ScoringPass) -> torch.Tensor:
        with autocast or nullcontext():
            output = model(
                scoring.tokens_BS,
                document_ids_BS=scoring.document_ids_BS,
                padding_BS=scoring.padding_BS,
                targets=scoring.head,
            )
            return scoring.reduce(output)

    return score

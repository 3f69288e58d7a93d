"""One pipeline stage's module: the embedding (first stage), its consecutive blocks, and the final norm and head
(last stage), as torch.distributed.pipelining runs it.

A stage passes one tensor on, the residual stream `x_BSD`; what every stage needs besides it (document ids, padding,
the head's targets) comes as keyword arguments that the schedule splits into micro-batches on every rank. The
routers' balancing and z losses of a stage's MoE layers enter the step's loss, yet the loss is computed on the last
stage only: each stage adds its routers' share to the residual stream's gradient instead (`_RouterLossGradient`,
an identity forward whose backward also differentiates the stage's router term), so every parameter gets the
gradient of the single process's objective. The layers' statistics are kept per forward for the step's sums.
Under context parallelism every stage takes its rank's positions of the whole rows it is handed
(`ferry.model.sequence_split`), and passes on only those.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ferry.data.targets import IGNORE_INDEX
from ferry.model import ModelOutput, MoEStats, Transformer
from ferry.model.head_loss import HeadLoss, HeadTargets, chunked_head_loss

RouterTerm = Callable[[list[MoEStats], int], torch.Tensor]


class StageModule(nn.Module):
    """Stage `stage_index` of `num_stages`: the blocks `blocks` of `model` (already pruned to this rank's stages),
    with the embedding on the first stage and the norm and head on the last. `router_term(stats, index)` turns the
    stage's MoE statistics of micro-batch `index` (its forwards run in micro-batch order, counted from the last
    `take_kept`) into the (scaled) loss term whose gradient joins the residual stream's;
    `loss_chunk` > 0 computes the head and the loss together by chunks of that many tokens."""

    def __init__(self, model: Transformer, stage_index: int, num_stages: int, blocks: tuple[int, ...], loss_chunk: int):
        super().__init__()
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.blocks = nn.ModuleList(model.layers[index] for index in blocks)
        first_moe = model.config.dense_layers
        self.moe_indices = [index - first_moe for index in blocks if index >= first_moe]
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.loss_chunk = loss_chunk
        self.sequence_split = model.sequence_split
        self.router_term: RouterTerm | None = None
        self.kept_stats: list[list[MoEStats]] = []  # per forward, in order: the step's statistics
        self.kept_correct: list[torch.Tensor] = []  # last stage, chunked head: correct predictions per forward

    def forward(
        self,
        x: torch.Tensor,
        document_ids_BS: torch.Tensor | None = None,
        padding_BS: torch.Tensor | None = None,
        targets_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or the residual stream in; the residual stream out, or on the last stage the
        logits, or with `loss_chunk` the summed cross-entropy of the trained targets."""
        split = self.sequence_split
        if split is None:
            visible_BSS = Transformer.visibility(document_ids_BS)
        else:  # the schedule hands every stage whole rows, padded to whole chunks (`PipelineContext`)
            rows, positions = x.shape[:2]  # the whole rows' tokens (first stage), or this rank's stream
            seq_len = positions if self.is_first else positions * split.degree
            padding_BS, visible_BSS = split.own_masks(rows, seq_len, x.device, document_ids_BS, padding_BS)
            x = split.local(x, 0) if self.is_first else x
            targets_BS = None if targets_BS is None else split.local(targets_BS, IGNORE_INDEX)
        x_BSD = self.tok_embeddings(x) if self.is_first else x
        stats = []
        for block in self.blocks:
            x_BSD, layer_stats = block(x_BSD, None, visible_BSS, padding_BS)
            if layer_stats is not None:
                stats.append(layer_stats)
        index = len(self.kept_stats)
        self.kept_stats.append([_detached(layer) for layer in stats])
        if stats and self.router_term is not None and torch.is_grad_enabled():
            x_BSD = _RouterLossGradient.apply(x_BSD, self.router_term(stats, index))
        if not self.is_last:
            return x_BSD
        h_BSD = self.norm(x_BSD)
        if self.loss_chunk and targets_BS is not None:
            head = chunked_head_loss(h_BSD, self.output.weight, HeadTargets(targets_BS, self.loss_chunk))
            self.kept_correct.append(head.correct)
            return head.lm_loss_sum
        return self.output(h_BSD)

    def take_kept(self) -> tuple[list[list[MoEStats]], list[torch.Tensor]]:
        """What the step's forwards kept, handed over once (the next step starts empty)."""
        kept = (self.kept_stats, self.kept_correct)
        self.kept_stats, self.kept_correct = [], []
        return kept

    def last_output(self, output: torch.Tensor) -> ModelOutput:
        """The last stage's output as the model's own forward returns it (its MoE layers counted elsewhere)."""
        if self.loss_chunk:
            return ModelOutput(None, [], HeadLoss(output, self.kept_correct[-1]), self.sequence_split)
        return ModelOutput(output, [], split=self.sequence_split)


class _RouterLossGradient(torch.autograd.Function):
    """Identity on `x`; its backward passes `x`'s gradient through and gives `term` the gradient one, as if the
    term had been added to the loss whose gradient `x` receives. The output is a copy, not a view: the zero-bubble
    schedules detach a stage's output in place between the two halves of its backward."""

    @staticmethod
    def forward(ctx, x, term):
        ctx.term_dtype = term.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad_x):
        return grad_x, torch.ones((), dtype=ctx.term_dtype, device=grad_x.device)


def _detached(stats: MoEStats) -> MoEStats:
    return MoEStats(
        stats.tokens_per_expert_E.detach(),
        stats.aux_loss.detach(),
        stats.z_loss.detach(),
        stats.mean_prob_E.detach(),
        stats.entropy.detach(),
    )

"""The step context of a pipeline-parallel run: a step's micro-batches go through torch's pipeline schedule instead
of a loop of forwards and backwards, scoring and generation pass from stage to stage, and nothing else an objective
sees changes.

Every rank of a pipeline reads the same rows (the data is split over the pipeline's replicas only) and hands all
its micro-batches to the schedule at once. The schedule exchanges shapes fixed in advance (the objective's
`PassShape`): a shorter micro-batch is padded to them (positions marked padding, which the routers leave out and
causal attention never lets a real position see), and a step with fewer micro-batches than the schedule runs is
filled with passes of padding that weigh nothing. The last stage's loss function is the objective's own loss of
each micro-batch, on its own rows and positions; the routers' losses of every stage enter through their stage's
gradient (`StageModule`), weighted by that micro-batch's share as the single process weights them, and every stage
adds its layers' statistics to the step's sums, which the trainer then reduces over all ranks as usual. Sums an
objective makes itself (rewards, pairs ranked right) are its replica's: every rank of a pipeline computes them
alike, so the last stage's count and the others' are dropped. The stages' busy times give the step's bubble
fraction. Scoring and generation run without the schedule (`ferry.parallel.pipeline_forward`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ferry.data.targets import IGNORE_INDEX
from ferry.inference.scoring import ScoringPass
from ferry.metrics.step import memory_peak_mib
from ferry.model import ModelOutput, MoEConfig, MoEStats
from ferry.model.head_loss import HeadTargets
from ferry.parallel.pipeline_forward import StagedDecoder, StagedForward
from ferry.parallel.pipeline_schedule import Pipeline
from ferry.parallel.plan import ParallelPlan
from ferry.train.objectives.losses import router_objective
from ferry.train.step_context import ContextParts, ForwardPass, PassShape, TrainingContext, evaluating
from ferry.train.step_statistics import LossParts, StepStatistics

if TYPE_CHECKING:
    pass


class PipelineContext(TrainingContext):
    """`TrainingContext` whose micro-batches run through `pipeline`'s schedule. `rank` and `world_size` are this
    rank's place among the ranks a step's rows are split over (one per pipeline replica)."""

    def __init__(
        self,
        parts: ContextParts,
        *,
        pipeline: Callable[[Callable], Pipeline],
        plan: ParallelPlan,
        moe: MoEConfig,
        moe_layers: int,
        shape: PassShape,
        stream_dtype: torch.dtype,
    ):
        """`pipeline(loss)`: the schedule and stages, built with this context's loss of a micro-batch, exchanging
        micro-batches of `shape`; the residual stream passes between stages in `stream_dtype`."""
        super().__init__(parts)
        self.plan = plan
        split = plan.split
        self.last_stage = split.num_stages - 1 in split.stages_of(plan.pp.rank)
        self._split_over(plan, self.last_stage and plan.cp_rank == 0)  # one rank of each context-parallel group
        self._moe = moe
        self._moe_layers = moe_layers
        self._shape = shape
        self._stream_dtype = stream_dtype
        self._passes: list[ForwardPass] = []
        self._statistics: StepStatistics | None = None
        self._figures: dict = {}
        self.pipeline = pipeline(self.loss)
        for module in self.pipeline.modules:
            module.router_term = lambda stats, index: self._router_term(stats, self._passes[index].share)

    def train_passes(self, passes: list[ForwardPass], statistics: StepStatistics) -> None:
        """Every micro-batch through the schedule in one call (the schedule, not the objective, orders forwards and
        backwards), padded to the exchanged shape and filled up to the schedule's count; the stages' router
        statistics and times collected after it."""
        count = self.pipeline.micro_batches
        if len(passes) > count:
            raise ValueError(f"the pipeline runs {count} micro-batches a step, got {len(passes)}")
        passes = passes + [self._filler() for _ in range(count - len(passes))]
        fitted = [self._fitted(forward) for forward in passes]
        if any(forward.padding_BS is not None for forward in fitted):
            fitted = [forward if forward.padding_BS is not None else _unpadded(forward) for forward in fitted]
        self._passes, self._statistics = passes, statistics
        rows = self._shape.rows
        micro_batch_of_row = torch.arange(count, device=self.device).repeat_interleave(rows)
        inputs = {
            "document_ids_BS": _joined([forward.document_ids_BS for forward in fitted]),
            "padding_BS": _joined([forward.padding_BS for forward in fitted]),
            "targets_BS": _joined([forward.head.targets_BS if forward.head else None for forward in fitted]),
        }
        tokens_BS = torch.cat([forward.tokens_BS for forward in fitted])
        self._watch("pipeline schedule")
        started = time.perf_counter()
        try:
            with self.autocast():
                self.pipeline.schedule.step(
                    tokens_BS,
                    target=micro_batch_of_row,
                    return_outputs=False,
                    **{name: value for name, value in inputs.items() if value is not None},
                )
            schedule_s = time.perf_counter() - started
            self._add_stage_statistics(statistics)
        finally:
            self._passes, self._statistics = [], None
        self._figures = self._stage_figures(schedule_s)

    def loss(self, output: torch.Tensor, micro_batch_of_row: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the objective's loss of that micro-batch (on its own rows
        and positions), its sums added to the step's statistics, scaled as a plain backward would scale it."""
        forward = self._passes[int(micro_batch_of_row[0])]
        model_output = self.pipeline.modules[-1].last_output(output)
        if model_output.logits_BSV is not None:
            rows, positions = forward.tokens_BS.shape
            if model_output.split is not None:  # this rank's positions of the exchanged rows: `own` pads to them
                model_output = ModelOutput(model_output.logits_BSV[:rows], [], split=model_output.split)
            else:
                model_output = ModelOutput(model_output.logits_BSV[:rows, :positions], [])
        parts = forward.loss(model_output)
        if forward.counted:
            self._statistics.add(parts, model_output, forward.share)
        return self._scaler.scale_loss(parts.objective)

    @torch.no_grad()
    def score(self, scoring: ScoringPass, model: torch.nn.Module | None = None) -> torch.Tensor:
        model = model or self.model
        with evaluating(model), self.autocast():
            return self._staged(model)(
                scoring.tokens_BS,
                scoring.reduce,
                padding_BS=scoring.padding_BS,
                document_ids_BS=scoring.document_ids_BS,
                head=scoring.head,
            )

    def _decoder(self) -> StagedDecoder:
        return StagedDecoder(self._staged(self.model))

    def _staged(self, model: torch.nn.Module) -> StagedForward:
        """`model`'s forwards without gradients, stage to stage over this rank's pipeline."""
        return StagedForward(model, self.plan.split, self.plan.pp, self._stream_dtype)

    def _fitted(self, forward: ForwardPass) -> ForwardPass:
        """`forward`'s inputs padded to the exchanged shape: more positions and rows, all marked padding."""
        rows, positions = forward.tokens_BS.shape
        shape = self._shape
        if (rows, positions) == (shape.rows, shape.seq_len):
            return forward
        if rows > shape.rows or positions > shape.seq_len:
            raise ValueError(
                f"a micro-batch of {rows} x {positions} tokens exceeds the pipeline's {shape.rows} x {shape.seq_len}"
            )
        grow = (0, shape.seq_len - positions, 0, shape.rows - rows)
        padding_BS = torch.ones((shape.rows, shape.seq_len), dtype=torch.bool, device=self.device)
        padding_BS[:rows, :positions] = False if forward.padding_BS is None else forward.padding_BS
        head = forward.head
        if head is not None:
            head = HeadTargets(F.pad(head.targets_BS, grow, value=IGNORE_INDEX), head.chunk_tokens)
        documents = forward.document_ids_BS
        return replace(
            forward,
            tokens_BS=F.pad(forward.tokens_BS, grow),
            padding_BS=padding_BS,
            head=head,
            document_ids_BS=None if documents is None else F.pad(documents, grow, value=-1),
        )

    def _filler(self) -> ForwardPass:
        """A micro-batch of padding that weighs nothing: the schedule runs a fixed count a step."""
        shape = self._shape
        tokens_BS = torch.zeros((shape.rows, shape.seq_len), dtype=torch.long, device=self.device)
        padding_BS = torch.ones_like(tokens_BS, dtype=torch.bool)
        head = HeadTargets(torch.full_like(tokens_BS, IGNORE_INDEX), shape.loss_chunk) if shape.loss_chunk else None
        return ForwardPass(tokens_BS, None, padding_BS, head, 0.0, _nothing, counted=False)

    def step_figures(self) -> dict:
        return self._figures

    def _router_term(self, stats: list[MoEStats], share: float) -> torch.Tensor:
        """A stage's routers' part of one micro-batch's loss: the single process's mean over all MoE layers,
        restricted to this stage's layers, times the loss scale its backward would carry."""
        aux, z = self._stage_router_losses(stats)
        return self._scaler.scale_loss(share * router_objective(self._moe, aux, z))

    def _stage_router_losses(self, stats: list[MoEStats]) -> tuple[torch.Tensor, torch.Tensor]:
        """A stage's layers' part of the step's router losses, each a mean over all the model's MoE layers."""
        aux = torch.stack([layer.aux_loss for layer in stats]).sum() / self._moe_layers
        z = torch.stack([layer.z_loss for layer in stats]).sum() / self._moe_layers
        return aux, z

    def _add_stage_statistics(self, statistics: StepStatistics) -> None:
        """Each stage's routing of the counted micro-batches (a stage's forwards run in micro-batch order)."""
        for module in self.pipeline.modules:
            kept, _ = module.take_kept()
            for forward, stats in zip(self._passes, kept, strict=True):
                if not stats or not forward.counted:
                    continue
                aux, z = self._stage_router_losses(stats)
                statistics.add_router(aux, z, stats, forward.share, layers=module.moe_indices)

    def _stage_figures(self, schedule_s: float) -> dict:
        """Each stage's busy seconds and the peak memory of the rank running it (summed over the pipeline's ranks,
        each stage held by one), and the bubble: the share of the schedule's time a rank was not computing,
        averaged over the ranks."""
        times = self.pipeline.take_times()
        forward_s = sum(stage.forward_s for stage in times)
        backward_s = sum(stage.backward_s for stage in times)
        self._timer.add("forward", forward_s)
        self._timer.add("backward", backward_s)
        split = self.plan.split
        stages = split.num_stages
        figures_F = torch.zeros(2 * stages + 1, dtype=torch.float64)  # busy per stage, peak per stage, bubble
        peak_mib = memory_peak_mib(self.device)
        for stage_index, stage_times in zip(split.stages_of(self.plan.pp.rank), times):
            figures_F[stage_index] = stage_times.busy_s
            figures_F[stages + stage_index] = peak_mib
        figures_F[-1] = 1.0 - (forward_s + backward_s) / schedule_s
        summed = self.plan.pp.all_reduce(figures_F.to(self.device)).cpu().tolist()
        return {
            "pp.stage_busy_s": [round(value, 6) for value in summed[:stages]],
            "pp.stage_mem_peak_mib": summed[stages : 2 * stages],
            "pp.bubble": summed[-1] / self.plan.pp.size,
            "pp.schedule_s": schedule_s,
        }


def _joined(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


def _unpadded(forward: ForwardPass) -> ForwardPass:
    """`forward` with its padding stated (none) where another micro-batch of the step has some."""
    return replace(forward, padding_BS=torch.zeros_like(forward.tokens_BS, dtype=torch.bool))


def _nothing(output: ModelOutput) -> LossParts:
    """A filler's loss: zero, yet joined to the output's graph so the schedule's backward runs through it."""
    produced = output.logits_BSV if output.logits_BSV is not None else output.head_loss.lm_loss_sum
    zero = produced.sum() * 0.0
    return LossParts.of_objective(zero, zero, zero)

"""The step context of a pipeline-parallel run: a step's micro-batches go through torch's pipeline schedule instead
of a loop of forwards and backwards, and nothing else an objective sees changes.

Every rank of a pipeline reads the same rows (the data is split over the pipeline's replicas only) and hands all
its micro-batches to the schedule at once. The last stage's loss function is the objective's own loss of each
micro-batch; the routers' losses of every stage enter through their stage's gradient (`StageModule`), weighted
as the single process weights them, and every stage adds its layers' statistics to the step's sums, which the
trainer then reduces over all ranks as usual. The stages' busy times give the step's bubble fraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ferry.metrics.step import memory_peak_mib
from ferry.model import MoEConfig, MoEStats
from ferry.parallel.pipeline_schedule import ExchangedShapes, Pipeline, build_pipeline
from ferry.parallel.plan import ParallelPlan
from ferry.train.objectives.losses import router_objective
from ferry.train.step_context import ForwardPass, TrainingContext
from ferry.train.step_statistics import StepStatistics

if TYPE_CHECKING:
    from ferry.precision import PrecisionPolicy
    from ferry.train.assembly import Job, ModelParts


class PipelineContext(TrainingContext):
    """`TrainingContext` whose micro-batches run through `pipeline`'s schedule. `rank` and `world_size` are this
    rank's place among the ranks a step's rows are split over (one per pipeline replica)."""

    def __init__(
        self, *args, pipeline: Callable[[Callable], Pipeline], plan: ParallelPlan, moe: MoEConfig, moe_layers: int,
        **kwargs,
    ):
        """`pipeline(loss)`: the schedule and stages, built with this context's loss of a micro-batch."""
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.rank = plan.data_rank
        self.world_size = plan.data_world_size
        self._moe = moe
        self._moe_layers = moe_layers
        self._passes: list[ForwardPass] = []
        self._statistics: StepStatistics | None = None
        self._figures: dict = {}
        self.pipeline = pipeline(self.loss)

    def train_passes(self, passes: list[ForwardPass], statistics: StepStatistics) -> None:
        """Every micro-batch through the schedule in one call (the schedule, not the objective, orders forwards and
        backwards); the stages' router statistics and times collected after it."""
        if len(passes) != self.pipeline.micro_batches:
            raise ValueError(f"the pipeline runs {self.pipeline.micro_batches} micro-batches a step, got {len(passes)}")
        self._passes, self._statistics = passes, statistics
        share = passes[0].share
        for module in self.pipeline.modules:
            module.router_term = lambda stats, share=share: self._router_term(stats, share)
        rows = passes[0].tokens_BS.shape[0]
        micro_batch_of_row = torch.arange(len(passes), device=self.device).repeat_interleave(rows)
        inputs = {
            "document_ids_BS": _joined([forward.document_ids_BS for forward in passes]),
            "padding_BS": _joined([forward.padding_BS for forward in passes]),
            "targets_BS": _joined([forward.head.targets_BS if forward.head else None for forward in passes]),
        }
        tokens_BS = torch.cat([forward.tokens_BS for forward in passes])
        self._watch("pipeline schedule")
        started = time.perf_counter()
        try:
            with self.autocast():
                self.pipeline.schedule.step(
                    tokens_BS, target=micro_batch_of_row, return_outputs=False,
                    **{name: value for name, value in inputs.items() if value is not None},
                )
        finally:
            self._passes, self._statistics = [], None
        schedule_s = time.perf_counter() - started
        self._add_stage_statistics(statistics, share)
        self._figures = self._stage_figures(schedule_s)

    def loss(self, output: torch.Tensor, micro_batch_of_row: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the objective's loss of that micro-batch, its sums added
        to the step's statistics, scaled as a plain backward would scale it."""
        forward = self._passes[int(micro_batch_of_row[0])]
        model_output = self.pipeline.modules[-1].last_output(output)
        parts = forward.loss(model_output)
        self._statistics.add(parts, model_output, forward.share)
        return self._scaler.scale_loss(parts.objective)

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

    def _add_stage_statistics(self, statistics: StepStatistics, share: float) -> None:
        for module in self.pipeline.modules:
            kept, _ = module.take_kept()
            for stats in kept:
                if not stats:
                    continue
                aux, z = self._stage_router_losses(stats)
                statistics.add_router(aux, z, stats, share, layers=module.moe_indices)

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


def step_context(
    job: Job, parts: ModelParts, precision: PrecisionPolicy, seq_len: int, *context_args, step_weights=None
) -> TrainingContext:
    """The run's step context: plain accumulation, or the pipeline's schedule when `parallel.pp` > 1 (its stages
    built here, exchanging the shapes of the run's micro-batches of `seq_len` tokens)."""
    plan = parts.plan
    if not plan.pipelined:
        return TrainingContext(*context_args, step_weights=step_weights)
    config = job.config
    model = config.model
    shapes = ExchangedShapes(
        rows=config.train.micro_batch, seq_len=seq_len,
        dim=model.dim, vocab_size=model.vocab_size, activation_dtype=precision.torch_param_dtype,
        logits_dtype=precision.torch_compute_dtype if precision.autocast else precision.torch_param_dtype,
        loss_chunk=config.train.loss_chunk,
    )
    micro_batches = config.train.global_batch // (plan.data_world_size * config.train.micro_batch)

    def pipeline(loss) -> Pipeline:
        return build_pipeline(
            parts.model, plan.split, plan.pp.rank, plan.pp.group, job.device, config.parallel.pp_schedule,
            micro_batches, shapes, loss,
        )

    return PipelineContext(
        *context_args, step_weights=step_weights, pipeline=pipeline, plan=plan, moe=model.moe,
        moe_layers=model.n_layers - model.dense_layers,
    )

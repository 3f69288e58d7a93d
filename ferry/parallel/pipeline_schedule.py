"""The stages of this rank and the schedule that runs a step's micro-batches through them, both torch's own
(torch.distributed.pipelining): ferry chooses the schedule by name, gives each stage the shapes it exchanges
(static metadata, so no forward is spent inferring them), and times every stage's forward and backward work so a
step can report each stage's busy time and the pipeline's bubble.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from ferry.model import Transformer
from ferry.parallel.pipeline_split import StageSplit
from ferry.parallel.pipeline_stage import StageModule

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


@dataclass
class StageTimes:
    """Seconds a stage spent computing in one step: forwards, and backwards (input and weight halves)."""

    forward_s: float = 0.0
    backward_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.forward_s + self.backward_s


class TimedStage(PipelineStage):
    """torch's pipeline stage, adding the wall time of each forward and backward chunk to `times`."""

    times: StageTimes

    def forward_one_chunk(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.times.forward_s += time.perf_counter() - started

    def backward_one_chunk(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.times.backward_s += time.perf_counter() - started

    def backward_weight_one_chunk(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.times.backward_s += time.perf_counter() - started


@dataclass(frozen=True)
class ExchangedShapes:
    """What the stages pass each other per micro-batch: `rows` sequences of `seq_len` positions, the residual
    stream of `dim` in `activation_dtype`; the last stage's output (logits in `logits_dtype`, or the loss). Under
    context parallelism (`cp` > 1) the first stage takes whole rows and every stage passes on its rank's 1/cp of
    the positions."""

    rows: int
    seq_len: int
    dim: int
    vocab_size: int
    activation_dtype: torch.dtype
    logits_dtype: torch.dtype
    loss_chunk: int
    cp: int = 1

    @property
    def positions(self) -> int:
        """The positions of a row each stage passes on: its rank's share under context parallelism."""
        return self.seq_len // self.cp


@dataclass
class Pipeline:
    """This rank's stage modules (in stage order), torch's stages wrapping them, and the schedule."""

    modules: list[StageModule]
    stages: list[TimedStage]
    schedule: object
    micro_batches: int
    times: list[StageTimes] = field(default_factory=list)

    def take_times(self) -> list[StageTimes]:
        """Each local stage's times of the step, reset for the next."""
        taken = [StageTimes(times.forward_s, times.backward_s) for times in self.times]
        for times in self.times:
            times.forward_s = times.backward_s = 0.0
        return taken


def build_pipeline(
    model: Transformer,
    split: StageSplit,
    pp_rank: int,
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    schedule_name: str,
    micro_batches: int,
    shapes: ExchangedShapes,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """The stages pipeline rank `pp_rank` runs over `group` and the named schedule of `micro_batches`; its losses
    are already normalised over the step, so gradients are not scaled again by the micro-batch count."""
    modules, stages, times = [], [], []
    for stage_index in split.stages_of(pp_rank):
        module = StageModule(model, stage_index, split.num_stages, split.blocks[stage_index], shapes.loss_chunk)
        stage = TimedStage(
            module,
            stage_index,
            split.num_stages,
            device,
            input_args=_stage_input(module, shapes),
            output_args=_stage_output(module, shapes),
            group=group,
        )
        stage.times = StageTimes()
        modules.append(module)
        stages.append(stage)
        times.append(stage.times)
    schedule_class = SCHEDULES[schedule_name]
    single = schedule_class in (ScheduleGPipe, Schedule1F1B)
    schedule = schedule_class(stages[0] if single else stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(modules, stages, schedule, micro_batches, times)


def _stage_input(module: StageModule, shapes: ExchangedShapes) -> torch.Tensor:
    """An example of what the stage receives (on the meta device: only its shape, dtype and need of a gradient
    are read)."""
    if module.is_first:
        return torch.zeros((shapes.rows, shapes.seq_len), dtype=torch.int64, device="meta")
    return _residual_stream(shapes)


def _stage_output(module: StageModule, shapes: ExchangedShapes) -> torch.Tensor:
    if not module.is_last:
        return _residual_stream(shapes)
    if shapes.loss_chunk:
        return torch.zeros((), dtype=torch.float32, device="meta", requires_grad=True)
    logits_shape = (shapes.rows, shapes.positions, shapes.vocab_size)
    return torch.zeros(logits_shape, dtype=shapes.logits_dtype, device="meta", requires_grad=True)


def _residual_stream(shapes: ExchangedShapes) -> torch.Tensor:
    residual_shape = (shapes.rows, shapes.positions, shapes.dim)
    return torch.zeros(residual_shape, dtype=shapes.activation_dtype, device="meta", requires_grad=True)

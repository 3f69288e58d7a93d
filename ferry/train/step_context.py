"""The narrow view of a run through which an objective trains a step.

An objective says what a step computes: its batches, forwards, losses and figures. The context says how that
runs on this job: every pass of the model an objective makes goes through it (training passes over a step's
micro-batches, scoring without gradients, generation), with the named phases a step passes through (each a timer
region and the hang watchdog's phase at once), the optimizer update, reductions over the ranks, and a heartbeat for
long work. The trainer builds it from the run's parts; a test builds a fake one. A way of running the model other
than one process holding all of it (a pipeline's stages, checkpointed activations) goes behind these same methods,
so no objective changes for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ferry.comm.reductions import RankReductions
from ferry.inference import GenerationConfig
from ferry.inference.generate import GenerationResult, GenerationSync, generate
from ferry.inference.scoring import ScoringPass, score_with
from ferry.metrics.timer import StepTimer
from ferry.model import ModelOutput
from ferry.model.head_loss import HeadTargets
from ferry.precision import LossScaler
from ferry.precision.step_weights import StepWeights

if TYPE_CHECKING:
    from ferry.train.step_statistics import LossParts, StepStatistics


@dataclass
class ForwardPass:
    """One micro-batch of a step, `share` of its global batch: the model's inputs, and the loss of its output
    (`loss(output)`, the micro-batch's part of the step's objective). `head`: the head and loss computed together
    (None: logits first)."""

    tokens_BS: torch.Tensor
    document_ids_BS: torch.Tensor | None
    padding_BS: torch.Tensor | None
    head: HeadTargets | None
    share: float
    loss: Callable[[ModelOutput], LossParts]
    counted: bool = True  # its losses and routing enter the step's statistics (not a filler's, nor a repeat's)


@dataclass(frozen=True)
class PassShape:
    """The largest micro-batch an objective trains on (`rows` of `seq_len` positions), and whether its head and loss
    are computed together by chunks (`loss_chunk` tokens; 0: logits first): what a pipeline's stages exchange."""

    rows: int
    seq_len: int
    loss_chunk: int


class StepContext(Protocol):
    """What an objective may use of the run. `rank` and `world_size` place this rank among the ranks a step's
    records are split over; `reductions` count every replica of the model once. `update(step)` runs after the
    backwards of an update: the fault hooks, then reduce, unscale, clip and step; it returns the gradient norm and
    whether the optimizer stepped."""

    model: torch.nn.Module
    device: torch.device
    rank: int
    world_size: int
    reductions: RankReductions

    def phase(self, name: str) -> AbstractContextManager: ...

    def train_passes(self, passes: list[ForwardPass], statistics: StepStatistics) -> None:
        """Forward and backward every micro-batch, however this job runs them, adding the counted ones to
        `statistics`."""

    def score(self, scoring: ScoringPass, model: torch.nn.Module | None = None) -> torch.Tensor:
        """`scoring.reduce` of the output of the trained model (or `model`, a frozen one laid out alike), without
        gradients, the same on every rank that holds a part of the model."""

    def generate(
        self,
        prompts: list,
        config: GenerationConfig,
        end_ids: list[int],
        row_seeds: list[int],
        progress: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """The trained model's completions of this rank's `prompts`, every rank decoding in step."""

    def zero_grad(self) -> None: ...

    def update(self, step: int) -> tuple[float, bool]: ...

    def progress(self) -> None: ...


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """`model` in evaluation mode inside (a scoring pass is not a training forward), back as it was after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class ContextParts:
    """What a step context runs a step with. `watch(name)` names the phase the hang watchdog reports, `touch()`
    restarts its clock, `after_backward(step, model)` runs the hooks at that point, `apply_gradients(step)` reduces,
    unscales, clips and steps; `step_weights`, the weights cast once a step, are put in place by the first training
    forward and taken out before the update."""

    model: torch.nn.Module
    device: torch.device
    reductions: RankReductions
    autocast: Callable[[], AbstractContextManager]
    timer: StepTimer
    scaler: LossScaler
    optimizer: torch.optim.Optimizer
    watch: Callable[[str], None]
    touch: Callable[[], None]
    after_backward: Callable[[int, torch.nn.Module], None]
    apply_gradients: Callable[[int], tuple[float, bool]]
    step_weights: StepWeights | None = None


class TrainingContext:
    """The step context of a training run: plain gradient accumulation over the micro-batches an objective
    runs, one optimizer update when it asks."""

    def __init__(self, parts: ContextParts):
        self.model = parts.model
        self.device = parts.device
        self.reductions = parts.reductions
        self.rank = parts.reductions.context.rank
        self.world_size = parts.reductions.context.world_size
        self._autocast = parts.autocast
        self._timer = parts.timer
        self._scaler = parts.scaler
        self._optimizer = parts.optimizer
        self._watch = parts.watch
        self._touch = parts.touch
        self._after_backward = parts.after_backward
        self._apply_gradients = parts.apply_gradients
        self._step_weights = parts.step_weights
        self.counts_whole = True

    def _split_over(self, plan, counts_whole: bool) -> None:
        """This rank placed among the ranks a step's rows are split over (`plan`'s data ranks: the ranks of a
        pipeline, and of a context-parallel group, read the same rows), and what those ranks compute alike counted
        by one of them only, the one `counts_whole` says."""
        self.rank = plan.data_rank
        self.world_size = plan.data_world_size
        self.counts_whole = counts_whole
        whole = self.reductions
        self.reductions = RankReductions(
            whole.context,
            whole.device,
            lambda tensor: whole.sum_tensor(tensor if self.counts_whole else tensor.zero_()),
        )

    def autocast(self) -> AbstractContextManager:
        """The run's autocast; in a training forward (gradients on), with the step's compute-dtype weights in place."""
        if self._step_weights is not None and torch.is_grad_enabled():
            self._step_weights.hold()
        return self._autocast()

    def release_weights(self) -> None:
        """The parameters back in the model's place of the step's weight copies (the trainer's at a step's end)."""
        if self._step_weights is not None:
            self._step_weights.release()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._watch(name)
        with self._timer.region(name):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        with self.phase("backward"):
            self._scaler.scale_loss(loss).backward()

    def train_passes(self, passes: list[ForwardPass], statistics: StepStatistics) -> None:
        """Plain gradient accumulation: each micro-batch's forward, then its backward."""
        for forward in passes:
            with self.phase("forward"), self.autocast():
                output = self.model(
                    forward.tokens_BS,
                    document_ids_BS=forward.document_ids_BS,
                    padding_BS=forward.padding_BS,
                    targets=forward.head,
                )
                parts = forward.loss(output)
            self.backward(parts.objective)
            if forward.counted:
                statistics.add(parts, output, forward.share)

    @torch.no_grad()
    def score(self, scoring: ScoringPass, model: torch.nn.Module | None = None) -> torch.Tensor:
        model = model or self.model
        with evaluating(model):
            return score_with(model, self.autocast())(scoring)

    def generate(
        self,
        prompts: list,
        config: GenerationConfig,
        end_ids: list[int],
        row_seeds: list[int],
        progress: Callable[[], None] | None = None,
    ) -> GenerationResult:
        return generate(
            self._decoder(),
            prompts,
            config,
            end_ids=end_ids,
            row_seeds=row_seeds,
            sync=self._generation_sync(),
            progress=progress,
        )

    def keep_replica_sums(self, statistics: StepStatistics) -> None:
        """Before the step's statistics are summed over the ranks: an objective's own sums are its replica's, kept
        by the rank that counts what its group computes alike (each rank's own, without such a group)."""
        if not self.counts_whole:
            statistics.own.vector.zero_()

    def _decoder(self) -> Any:
        """What generation decodes with: the model, or a pipeline's stages in turn (`StagedDecoder`)."""
        return self.model

    def _generation_sync(self) -> GenerationSync | None:
        """Ranks decoding in step (expert parallelism and pipeline stages need every rank in every forward): the
        longest prompt, and whether every rank has finished."""
        reductions = self.reductions
        if reductions.context.world_size == 1:
            return None
        return GenerationSync(
            longest=lambda value: int(reductions.largest([float(value)])[0]),
            all_finished=lambda finished: reductions.largest([0.0 if finished else 1.0])[0] == 0.0,
        )

    def zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def step_figures(self) -> dict:
        """What the way micro-batches ran adds to the step's record (a pipeline's stage times and bubble)."""
        return {}

    def update(self, step: int) -> tuple[float, bool]:
        self.release_weights()
        self._after_backward(step, self.model)
        with self.phase("optimizer"):
            return self._apply_gradients(step)

    def progress(self) -> None:
        self._touch()

    @contextmanager
    def reporting(self, progress: Callable[[], None]) -> Iterator[None]:
        """Inside, `progress()` calls `progress` instead of restarting the watchdog's clock alone: an objective's
        held-out evaluation counts its forwards where the evaluation hook says how far it is (and that function
        restarts the clock too)."""
        touch, self._touch = self._touch, progress
        try:
            yield
        finally:
            self._touch = touch

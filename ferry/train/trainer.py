"""The training loop: a run assembled from its config (`ferry.train.assembly`), steps on every rank, and hooks
around them (`ferry.train.hooks`) for what is not the step.

One program runs on every rank (torchrun or `ferry train --nproc N`). Each optimizer
step consumes exactly one global batch; ranks take contiguous slices of it and
gradient accumulation over micro-batches absorbs any split, so the data a step sees
does not depend on world size or layout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ferry.checkpoint import CheckpointManager, Found
from ferry.comm import tier_figures
from ferry.comm.process_group import shutdown
from ferry.data import DataCursor
from ferry.data.loader import realised_counts
from ferry.inference import eval_record
from ferry.metrics import MetricsHub, TorchTrace, moe_diagnostics
from ferry.model import Transformer
from ferry.model.compilation import compile_seconds
from ferry.parallel.expert_parallel import EP_EXCHANGES
from ferry.parallel.zero import optimizer_state_bytes
from ferry.train.announcements import announce, describe, describe_hardware
from ferry.train.assembly import RunParts, assemble
from ferry.train.attention_logits import AttentionLogits
from ferry.train.checkpoint_hook import CheckpointHook
from ferry.train.config import RunConfig
from ferry.train.hook_points import Hook, Hooks, RunEnd
from ferry.train.hooks import EvaluationHook, RecordsHook, TraceHook
from ferry.train.layouts.base import PlacedRun
from ferry.train.opening import open_run, report_set_aside
from ferry.train.optimizer import learning_rate
from ferry.train.overlap_trial import choose_overlap
from ferry.train.resilience.core import Resilience
from ferry.train.restore import checkpoint_state, draw_deferred_weights, initialize_from, restore, resume_from
from ferry.train.run_dir.lock import RunDirLock
from ferry.train.state import TrainState
from ferry.train.step_context import ContextParts, TrainingContext
from ferry.train.step_statistics import StepStatistics
from ferry.train.update import apply_gradients


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float]
    final_record: dict


class Trainer:
    """One run: its parts, assembled from the config; its train state; the resilience hook, which watches from
    the load on; and the step context its objective trains through. `fit()` opens the run and loops.

    `hooks` are the user's (`ferry.train.Hook` subclasses, `ferry.train.hook_points` names their points): they
    act inside the run's records and outside its checkpoints, evaluation and resilience, so a hook's
    `after_step(step, record)` sees the step's record with its held-out figures and what it adds to the record
    is written with it (to metrics.jsonl and every sink); points that open call them in the order given, points
    that close in reverse. Every rank calls them (rank 0's record is the one the sinks get)."""

    def __init__(self, config: RunConfig, hooks: Sequence[Hook] = ()):
        self.parts: RunParts = assemble(config, started_unix=time.time())
        self.config = config = self.parts.job.config  # with its micro-batch decided
        job, model = self.parts.job, self.parts.model
        self.resilience = Resilience(
            config, job.rank, job.world_size, job.started_unix, model.reductions.largest, model.plan.local
        )
        self.attention_logits = (
            AttentionLogits(model.model, model.reductions, config.optim.muon.qk_clip)
            if config.tracks_attention_logits
            else None
        )
        self.hooks = Hooks([self.resilience])
        self.user_hooks = list(hooks)
        self.state = TrainState(self.parts.data.loader.new_cursor())
        self.initial_weights = model.initial_weights
        self.hub: MetricsHub | None = None
        self._run_lock: RunDirLock | None = None
        shape = self.parts.data.kind.pass_shape(config, self.parts.data.loader)
        placed = PlacedRun(config, job.device, model.plan, model.model, self.parts.numerics.precision)
        self.context: TrainingContext = job.kinds.step_context(
            placed,
            shape,
            ContextParts(
                model=model.model,
                device=job.device,
                reductions=model.reductions,
                autocast=partial(self.parts.numerics.autocast, job.device),
                timer=self.parts.instruments.metrics.timer,
                scaler=self.parts.numerics.scaler,
                optimizer=model.optimizer,
                watch=self.resilience.phase,
                touch=self.resilience.watchdog.touch,
                after_backward=self._after_backward,
                apply_gradients=self._apply_gradients,
                step_weights=model.step_weights,
            ),
        )

    @property
    def model(self) -> Transformer:
        return self.parts.model.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.model.optimizer

    @property
    def cursor(self) -> DataCursor:
        return self.state.cursor

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train to `train.steps`, or stop after step `stop_at` (default `train.stop_at`; checkpointed,
        to be resumed later).

        With `resume` set, the train state is restored first and the run's records
        continue from the checkpoint's step. The hang watchdog watches from the start, the load
        included, and stops however the run ends.
        """
        train = self.config.train
        try:
            self._open()
            return self._loop(min(stop_at or train.stop_at or train.steps, train.steps))
        finally:
            self.resilience.watchdog.stop()
            if self._run_lock is not None:
                self._run_lock.release()

    def _loop(self, stop_at: int) -> TrainResult:
        losses: list[float] = []
        last: dict = {}
        end = None
        try:
            self.hooks.before_training()
            while self.state.step < stop_at:
                step = self.state.step + 1
                self.hooks.before_step(step)
                last = self.train_step()
                self.hooks.after_step(step, last)
                losses.append(last["loss"])
            self.hooks.after_training(self.state.step)
            end = RunEnd(self.state.step, stop_at, last, trained=bool(losses))
        except BaseException as exc:
            self.hooks.on_error(exc, last)
            raise
        finally:
            self.hooks.at_close(end)
        return TrainResult(self.config.run.path, losses, last)

    def _open(self) -> None:
        """Restore or initialise the weights, prepare the objective, open the run directory (locked) and its
        sinks, say what the run is, and set up the hooks around its steps."""
        config, parts, resilience = self.config, self.parts, self.resilience
        resume = parts.start.resume
        resilience.watch_loading()
        resilience.note_agent_restart(list(parts.start.restart_counts))
        restore_found = partial(
            restore,
            parts.job,
            parts.numerics,
            parts.model,
            parts.data,
            parts.objective,
            parts.instruments.tokens_per_step,
        )
        found, self.state, notes, resume_times = resume_from(parts.job, parts.model, resume, self.state, restore_found)
        notes += self._weights_if_not_resumed(found)
        notes += parts.objective.prepare(self.context)
        overlap = parts.model.plan.ep_overlap
        if config.parallel.ep_overlap == "auto":
            overlap = choose_overlap(self, config.parallel.ep_overlap_trial_steps)
        # `latest` with nothing to resume from is a run resumed at step 0: its records are its own
        resumed_step = found.checkpoint.step if found and found.checkpoint else (0 if resume == "latest" else None)
        description = describe(
            parts.job, parts.numerics, parts.model, parts.instruments, parts.data.loader, self.initial_weights, overlap
        )
        opened = open_run(parts.job, description, self.state, found, resumed_step, resume_times)
        self.hub, self._run_lock = opened.hub, opened.lock
        checkpoints = self._checkpoints(resumed_step)
        step_size = parts.data.kind.step_unit(config, parts.instruments.tokens_per_step)
        announce(
            parts.job, parts.numerics, parts.model, parts.instruments.size, step_size, opened.hub, found, notes, overlap
        )
        report_set_aside(opened, checkpoints, resumed_step, config.train.steps)
        resume_info = {
            **resume_times,
            "skipped": [str(path) for path, _ in found.skipped] if found else [],
            "removed_unfinished_saves": [str(path) for path in checkpoints.removed_leftovers],
        }
        resilience.begin(resumed_step, resume_info, opened.record, say=opened.hub.message)
        self.hooks = Hooks(self._hooks(opened.hub, opened.record, checkpoints, resumed_step))

    def _weights_if_not_resumed(self, found: Found | None) -> list[str]:
        """A run that restored no checkpoint: the seed's weights if it deferred drawing them, then its init_from's."""
        config, resilience = self.config, self.resilience
        resumed = bool(found and found.checkpoint)
        if self.parts.model.draw_deferred and not resumed:
            resilience.watchdog.phase("initial weights draw")
            parts = self.parts
            self.initial_weights = draw_deferred_weights(
                parts.job, parts.numerics.kernels, parts.model, resilience.watchdog.touch
            )
            resilience.watchdog.phase("checkpoint load")
        if config.init_from is None or resumed:
            return []
        carried, notes = initialize_from(self.parts.job, self.parts.model, Path(config.init_from))
        self.state = self.state.with_carried(carried)
        return notes

    def _after_backward(self, step: int, model: torch.nn.Module) -> None:
        """The hooks of the run as it stands: resilience's alone while it loads (an overlap trial's steps), all of
        them once the run is open."""
        self.hooks.after_backward(step, model)

    def _checkpoint_state(self):
        """What a save of the run as it stands holds: this rank's pieces and the manifest's metadata."""
        parts = self.parts
        return checkpoint_state(
            parts.job,
            parts.numerics,
            parts.model,
            parts.data,
            parts.objective,
            parts.instruments.environment,
            self.state,
        )

    def _checkpoints(self, resumed_step: int | None) -> CheckpointManager:
        config, parts = self.config, self.parts
        return CheckpointManager(
            config.checkpoint,
            config.checkpoint.path(config.run.path),
            last_step=resumed_step,
            rank=parts.job.rank,
            world_size=parts.job.world_size,
            agree=self.resilience.agree,
        )

    def _hooks(self, hub: MetricsHub, record, checkpoints: CheckpointManager, resumed_step: int | None) -> list:
        """In the order they wrap each other (see `ferry.train.hook_points`)."""
        config, parts, resilience = self.config, self.parts, self.resilience
        trace = TorchTrace(config.profile, config.run.path, parts.job.device, parts.job.rank)
        saves = CheckpointHook(
            config.checkpoint,
            resilience.job_mtbf_s,
            checkpoints,
            self._checkpoint_state,
            resilience.watchdog,
            resilience.injector,
            resilience.agree,
            hub.message,
            parts.job.is_main,
            resumed_step or 0,
        )
        records = RecordsHook(
            hub,
            record,
            parts.instruments.metrics,
            lambda: {**resilience.finish(), **saves.summary()},
            checkpoints,
            config.run.path,
            config.train.steps,
            config.train.stop_at,
            lambda: describe_hardware(parts.numerics, parts.instruments.metrics.peak),
            data_realised=lambda: realised_counts(parts.data.loader, self.state.cursor),
        )
        evaluation = EvaluationHook(resilience.watchdog, self._evaluation_due, self.evaluate, hub.message)
        return [TraceHook(trace), records, *self.user_hooks, saves, evaluation, resilience]

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the step's metrics record."""
        config, parts = self.config, self.parts
        metrics = parts.instruments.metrics
        model, objective = parts.model, parts.objective
        timer = metrics.timer
        timer.start()
        lr = learning_rate(config.optim, self.state.step, config.train.steps)
        for group in model.optimizer.param_groups:
            group["lr"] = lr
        model.model.train()
        statistics = StepStatistics(
            config.model.moe_layer_count,
            config.model.moe.num_experts,
            parts.job.device,
            objective=objective.statistics,
        )
        compiled_before = compile_seconds() if model.compiled["mode"] != "none" else 0.0
        try:
            outcome = objective.step(self.context, self.state.cursor, statistics)
            self.context.keep_replica_sums(statistics)
        finally:
            self.context.release_weights()
        compiling_s = compile_seconds() - compiled_before if model.compiled["mode"] != "none" else 0.0
        with timer.region("optimizer"):
            model.plan.sum_over_ranks(statistics.totals)
            if outcome.stepped:  # the layers this rank holds (under pipeline parallelism, its stages')
                for index, layer in model.model.moe_layers_by_index().items():
                    layer.router.update_bias(statistics.counts_LE[index])
        cursor = parts.data.loader.advance(self.state.cursor)
        for collectives in model.plan.collectives:
            collectives.flush()
        times = timer.stop()
        exchanged = model.plan.stats.take()
        comm_bytes = sum(op.bytes for op in exchanged.values())
        ep_comm_s = sum(exchanged[op].seconds for op in EP_EXCHANGES if op in exchanged)
        _, _, aux, z = statistics.losses()
        figures = objective.figures(statistics, outcome)
        self.state = self.state.advanced(cursor, outcome.tokens)
        moe = config.model.moe
        scaler = parts.numerics.scaler
        return {
            "step": self.state.step,
            "loss": figures.pop("loss") + moe.aux_loss_coef * aux + moe.z_loss_coef * z,
            **figures,
            "aux_loss": aux,
            "z_loss": z,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "tokens": self.state.tokens_seen,
            **metrics.record(times, tokens=outcome.tokens),
            "comm_bytes": comm_bytes,
            **tier_figures(exchanged),
            "ep_comm_s": ep_comm_s,
            "ep_exchanges": sum(exchanged[op].calls for op in EP_EXCHANGES if op in exchanged),
            "ep_overlap_share": max(0.0, 1.0 - times.ep_wait_s / ep_comm_s) if ep_comm_s > 0 else None,
            **self.parts.job.kinds.figures(model.plan, exchanged),
            "optimizer_state_mib": optimizer_state_bytes(model.optimizer) / 2**20,
            "loss_scale": scaler.scale,
            "skipped_steps": scaler.skipped_steps,
            **({"compile_s": compiling_s} if compiling_s else {}),
            **self.context.step_figures(),
            **(self.attention_logits.figures() if self.attention_logits is not None else {}),
            **self._moe_diagnostics(statistics),
        }

    def _moe_diagnostics(self, statistics: StepStatistics) -> dict:
        """Routing health of the step's training forwards; none when nothing was trained (a GRPO step whose
        groups all had equal rewards)."""
        if statistics.counts_LE.numel() and not bool((statistics.counts_LE.sum(dim=1) > 0).all()):
            return {}
        ep_degree = self.parts.job.layout.ep_degree
        return moe_diagnostics(statistics.counts_LE, statistics.mean_prob_LE, statistics.entropy_L, ep_degree=ep_degree)

    def _apply_gradients(self, step: int) -> tuple[float, bool]:
        config, parts = self.config, self.parts
        model = parts.model
        raise_on_nonfinite = config.fault.on_nonfinite == "raise"
        grad_norm, stepped = apply_gradients(
            model.plan,
            parts.numerics.scaler,
            model.optimizer,
            model.model,
            parts.job.device,
            config.optim.grad_clip,
            raise_on_nonfinite,
            step,
        )
        if self.attention_logits is not None:
            self.attention_logits.after_update(stepped)
        return grad_norm, stepped

    def evaluate(self, progress) -> dict:
        """Held-out loss and perplexity of every `eval` source, and the objective's own held-out figures when due:
        the same figures on every rank. `progress` is called after each forward. Its collectives are left out of
        the next step's `comm_bytes`."""
        parts, context = self.parts, self.context
        model, evaluation = parts.model, parts.data.evaluation
        record = {}
        if evaluation.sources:
            losses = evaluation.run(
                context.score,
                context.device,
                context.rank,
                context.world_size,
                context.reductions.sum_tensor,
                progress,
            )
            record = eval_record(losses)
        if parts.objective.evaluation_due(self.state.step, self.config.train.steps):
            with self.context.reporting(progress):
                record.update(parts.objective.evaluate(self.context))
        for collectives in model.plan.collectives:
            collectives.flush()
        model.plan.stats.take()
        return record

    def _evaluation_due(self, step: int) -> bool:
        last = self.config.train.steps
        return self.parts.data.evaluation.due(step, last) or self.parts.objective.evaluation_due(step, last)


def train(config: RunConfig, hooks: Sequence[Hook] = ()) -> TrainResult:
    """Build a trainer from `config` (with the user's `hooks`, see `Trainer`) and run it to `train.steps`.

    A finished multi-rank run leaves its process group in order: all ranks meet, then the group
    is destroyed, so no rank ends while a peer's collective threads still talk to it (an abort at
    exit would read as a failure to whoever supervises the job).
    """
    result = Trainer(config, hooks).fit()
    if dist.is_initialized():
        dist.barrier()
        shutdown()
    return result

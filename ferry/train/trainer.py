"""The training loop: build everything from config, run steps on every rank, record on rank 0.

One program runs on every rank (torchrun or `ferry train --nproc N`). Each optimizer
step consumes exactly one global batch; ranks take contiguous slices of it and
gradient accumulation over micro-batches absorbs any split, so the data a step sees
does not depend on world size or layout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ferry.checkpoint import CheckpointManager, list_checkpoints
from ferry.comm import init_distributed, launcher_ranks
from ferry.comm.process_group import shutdown
from ferry.config import UserError
from ferry.data import DataCursor, document_ids
from ferry.data.tokenizer import encoding_digest, load_tokenizer
from ferry.inference import HeldOutEvaluation, eval_record
from ferry.kernels import select_kernels
from ferry.metrics import MetricsHub, StepMetrics, TorchTrace, moe_diagnostics
from ferry.model import Transformer, count_model
from ferry.model.compilation import compile_blocks
from ferry.model.digest import weights_digest
from ferry.parallel import build_plan
from ferry.parallel.zero import optimizer_state_bytes
from ferry.platform import environment_fingerprint, resolve_device
from ferry.platform.allocator import apply_host_allocator
from ferry.platform.process import Stopped
from ferry.platform.hardware import HardwareProfile, MfuPeak, measured_cpu_profile, resolve_profile
from ferry.precision import resolve_precision
from ferry.precision.kernels import low_precision_op, with_low_precision_experts
from ferry.train.checkpointing import save_on_all_ranks
from ferry.train.announcements import announce, describe_hardware, eval_line
from ferry.train.config import RunConfig
from ferry.train.objectives import build_loader, build_objective
from ferry.train.optimizer import decayed_parameter_names, learning_rate
from ferry.train.resilience import Resilience, restarted_by_torchrun
from ferry.train.run_lock import RunDirLock
from ferry.train.run_opening import open_run, report_set_aside
from ferry.train.step_statistics import StepStatistics
from ferry.train.train_state import checkpoint_state, draw_deferred_weights, initialize_from, resume_from



@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float]
    final_record: dict


class Trainer:
    """Owns the model, its parallel plan, optimizer, loss scaler, data loader and metrics of one run."""

    def __init__(self, config: RunConfig):
        started_unix = time.time()
        self.config = config
        train = config.train
        self.device = resolve_device(config.run.device, launcher_ranks()[2])
        self.context = init_distributed(config.comm, self.device)
        self.rank, self.world_size = self.context.rank, self.context.world_size
        self.resilience = Resilience(config, self.rank, self.world_size, started_unix)
        self.resilience.agree = self.largest_over_ranks
        config.check_world_size(self.world_size)
        self.profile = _profile(config.hardware, self.device)
        allocator = config.run.host_allocator
        self.host_allocator = apply_host_allocator(self.profile.host_allocator if allocator == "profile" else allocator)
        self.precision = resolve_precision(config.precision, self.profile)
        self.loader = build_loader(config)
        tokenizer_vocab = self.loader.tokenizer["vocab_size"]
        if config.model.vocab_size < tokenizer_vocab:
            raise UserError(
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({tokenizer_vocab}) of {self.loader.datasets[0].label}; a model that will learn added "
                "tokens (the chat tokens of SFT) needs the rows from pre-training on: init_from keeps vocab_size"
            )
        token_eval = config.eval if train.objective == "lm" else config.eval.model_copy(update={"sources": []})
        self.evaluation = HeldOutEvaluation(
            token_eval, config.data.seq_len, config.eval.batch_size or train.global_batch, train.micro_batch,
            document_eos=self.loader.tokenizer["eos_id"] if config.data.document_masking else None,
            loss_chunk=train.loss_chunk,
        )
        first = self.loader.datasets[0]
        # what decides the ids of the run's text (None for synthetic ids): recorded in every checkpoint
        self.tokenizer_digest = (
            encoding_digest(load_tokenizer(first.path / first.tokenizer["file"])) if first.tokenizer["file"] else None
        )
        if self.evaluation.sources:
            self.evaluation.check_tokenizer(self.tokenizer_digest, config.model.vocab_size, first.label)
        self.kernels = select_kernels(config.kernels, self.device, self.precision.torch_compute_dtype)
        if self.precision.recipe is not None:
            self.kernels = with_low_precision_experts(self.kernels, self.precision.recipe)
            low = self.kernels.choices[low_precision_op(self.precision.recipe)].implementation
            self.precision.record_experts_kernel(low.key, native=not low.portable)
        torch.manual_seed(config.run.seed)
        # A run started from a checkpoint's weights (`init_from`, or its own checkpoint when it resumes) loads
        # every one of them, strictly: drawing them first would only cost time (minutes for billions). A run
        # asked to resume draws on the host only if it finds nothing to resume from (`draw_deferred_weights`).
        drawn = config.init_from is None
        on_host = config.run.init_device == "host"
        self.draw_deferred = drawn and on_host and (config.resume is not None or restarted_by_torchrun())
        drawn_now = drawn and on_host and not self.draw_deferred
        model = Transformer(config.model, self.kernels, initialise=drawn_now)
        self.initial_weights = weights_digest(model) if drawn_now and self.is_main else None
        self.model: Transformer = model.to(self.device, dtype=self.precision.torch_param_dtype)
        if drawn and not on_host:
            self.model.reset_parameters()
            self.initial_weights = weights_digest(self.model) if self.is_main else None
        self.decayed = decayed_parameter_names(self.model)
        expert_parallel = config.parallel.mode == "ep" and config.parallel.ep > 1
        self.compiled = compile_blocks(self.model, train.compile, expert_parallel)
        self.plan = build_plan(
            config.parallel, self.context, self.model, self.device, self.precision.torch_reduce_dtype
        )
        optim = config.optim
        self.optimizer = self.plan.build_optimizer(
            self.decayed, optim.weight_decay, optim.zero, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps
        )
        self.scaler = self.precision.build_scaler(config.precision)
        self.cursor: DataCursor = self.loader.new_cursor()
        self.size = count_model(config.model, self._sequence_length())
        self.tokens_per_step = train.global_batch * config.data.seq_len
        self.environment = environment_fingerprint(self.device)
        self.metrics = StepMetrics(
            self.device, self.world_size, self.size.flops_per_token,
            MfuPeak.of_profile(self.profile, self.precision.mfu_dtype),
        )
        self.plan.attach_timer(self.metrics.timer)
        self.hub: MetricsHub | None = None
        self.run_lock: RunDirLock | None = None
        self.carried: dict[str, str] = {}
        self.tokens_seen = 0
        self.objective = build_objective(self)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train to `train.steps`, or stop after step `stop_at` (default `train.stop_at`; checkpointed,
        to be resumed later).

        With `resume` set, the train state is restored first and the run's records
        continue from the checkpoint's step. The hang watchdog watches from the start, the load
        included, and stops however the run ends.
        """
        try:
            return self._fit(stop_at)
        finally:
            self.resilience.watchdog.stop()
            if self.run_lock is not None:
                self.run_lock.release()

    def _fit(self, stop_at: int | None) -> TrainResult:
        config = self.config
        stop_at = stop_at or config.train.stop_at or config.train.steps
        stop_at = min(stop_at, config.train.steps)
        resume = config.resume
        self.resilience.watch_loading()
        if restarted_by_torchrun() and (list_checkpoints(config.checkpoint.path(config.run.path)) or resume is None):
            resume = "latest"  # restarted by torchrun's agent: the run's own newest checkpoint, or step 0
        self.resilience.note_agent_restart()
        found, notes, resume_times = resume_from(self, resume)
        if self.draw_deferred and not (found and found.checkpoint):
            self.resilience.watchdog.phase("initial weights draw")
            self.initial_weights = draw_deferred_weights(self, self.resilience.watchdog.touch)
            self.resilience.watchdog.phase("checkpoint load")
        self.draw_deferred = False  # the weights are the checkpoint's or the seed's from here on
        if config.init_from is not None and not (found and found.checkpoint):
            notes += initialize_from(self, Path(config.init_from))
        notes += self.objective.prepare(self)
        # `latest` with nothing to resume from is a run resumed at step 0: its records are its own
        resumed_step = found.checkpoint.step if found and found.checkpoint else (0 if resume == "latest" else None)
        run_dir = config.run.path
        opened = open_run(self, found, resumed_step, resume_times)
        record, self.hub, self.run_lock = opened.record, opened.hub, opened.lock
        writes = {"write": partial(save_on_all_ranks, plan=self.plan)} if self.context.is_distributed else {}
        checkpoints = CheckpointManager(
            config.checkpoint,
            config.checkpoint.path(run_dir),
            last_step=resumed_step,
            is_main=self.is_main,
            **writes,
        )
        trace = TorchTrace(config.profile, run_dir, self.device, self.rank)
        announce(self, run_dir, found, notes)
        report_set_aside(opened, checkpoints, resumed_step, config.train.steps)
        resilience = self.resilience
        save_state = partial(checkpoint_state, self)
        resume_info = {
            **resume_times,
            "skipped": [str(path) for path, _ in found.skipped] if found else [],
            "removed_unfinished_saves": [str(path) for path in checkpoints.removed_leftovers],
        }
        resilience.begin(resumed_step, resume_info, record, say=self.hub.message)
        losses: list[float] = []
        last: dict = {}
        try:
            while self.cursor.step < stop_at:
                step = self.cursor.step + 1
                trace.step_started(step)
                resilience.before_step(step)
                last = self.train_step()
                resilience.after_step(last)
                if self._evaluation_due(self.cursor.step):
                    last.update(resilience.evaluate(self.evaluate))
                losses.append(last["loss"])
                if resilience.save_due(self.cursor.step, checkpoints):
                    resilience.save(self.cursor.step, checkpoints, save_state, last)
                self.hub.write(last)
                for note in self.metrics.take_notes():
                    self.hub.message(note)
                if any(key.startswith("eval") for key in last):
                    self.hub.message(eval_line(last))
                trace.step_finished(last["step"])
            if config.checkpoint.enabled and checkpoints.last_step != self.cursor.step:
                resilience.save(self.cursor.step, checkpoints, save_state, {})
            resilience.wait_for_saves(checkpoints)
        except BaseException as exc:
            resilience.failed(exc)
            # A save still in flight is of an earlier, good step: let it finish, but report the first failure.
            with contextlib.suppress(Exception):
                checkpoints.wait()
            if record is not None:
                if isinstance(exc, (KeyboardInterrupt, Stopped)):  # stopped from outside: no failure of the run
                    stopped_by = exc.args[0] if isinstance(exc, Stopped) else "SIGINT"
                    record.finish("interrupted", signal=stopped_by, last_step=last, **resilience.finish())
                else:
                    record.finish("failed", error=f"{type(exc).__name__}: {exc}", last_step=last, **resilience.finish())
            raise
        finally:
            resilience.watchdog.stop()
            self.hub.close()
            trace.close()
        status = "completed" if self.cursor.step >= config.train.steps else "stopped"
        outcome = resilience.finish()
        if record is not None:
            record.finish(
                status, last_step=last, checkpoints=[str(path) for path in checkpoints.saved],
                hardware=describe_hardware(self), **outcome
            )
        if self.is_main and outcome.get("restarts"):
            good = outcome["goodput"]
            self.hub.message(
                f"ferry: {len(outcome['restarts'])} restart(s), {good['lost_steps']} step(s) lost; goodput "
                f"{good['goodput']:.1%} ({good['productive_s']:.1f} s of steps in {good['wall_s']:.1f} s)"
            )
        if not losses:
            self.hub.message(
                f"ferry: nothing to train: the run is at step {self.cursor.step} and stops at {stop_at} "
                f"(train.steps {config.train.steps}, train.stop_at {config.train.stop_at}); run in {run_dir}"
            )
        else:
            ending = "done" if status == "completed" else f"stopped at step {self.cursor.step}"
            self.hub.message(f"ferry: {ending} — final loss {last['loss']:.4f}; run in {run_dir}")
        return TrainResult(run_dir, losses, last)

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the step's metrics record."""
        config = self.config
        timer = self.metrics.timer
        timer.start()
        step = self.cursor.step
        lr = learning_rate(config.optim, step, config.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        moe_layers = self.model.moe_layers()
        statistics = StepStatistics(
            len(moe_layers), config.model.moe.num_experts, self.device, extra=self.objective.extra_statistics
        )
        outcome = self.objective.step(self, statistics)
        with timer.region("optimizer"):
            self.plan.sum_over_ranks(statistics.totals)
            if outcome.stepped:
                for layer, layer_counts_E in zip(moe_layers, statistics.counts_LE):
                    layer.router.update_bias(layer_counts_E)
        self.cursor = self.loader.advance(self.cursor)
        for collectives in self.plan.collectives:
            collectives.flush()
        times = timer.stop()
        comm_bytes = sum(op.bytes for op in self.plan.stats.take().values())
        _, _, aux, z = statistics.losses()
        figures = self.objective.figures(statistics, outcome)
        self.tokens_seen += outcome.tokens
        moe = config.model.moe
        return {
            "step": self.cursor.step,
            "loss": figures.pop("loss") + moe.aux_loss_coef * aux + moe.z_loss_coef * z,
            **figures,
            "aux_loss": aux,
            "z_loss": z,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "tokens": self.tokens_seen,
            **self.metrics.record(times, tokens=outcome.tokens),
            "comm_bytes": comm_bytes,
            "optimizer_state_mib": optimizer_state_bytes(self.optimizer) / 2**20,
            "loss_scale": self.scaler.scale,
            "skipped_steps": self.scaler.skipped_steps,
            **self._moe_diagnostics(statistics),
        }

    def _moe_diagnostics(self, statistics: StepStatistics) -> dict:
        """Routing health of the step's training forwards; none when nothing was trained (a GRPO step whose
        groups all had equal rewards)."""
        if statistics.counts_LE.numel() and not bool((statistics.counts_LE.sum(dim=1) > 0).all()):
            return {}
        return moe_diagnostics(
            statistics.counts_LE, statistics.mean_prob_LE, statistics.entropy_L, ep_degree=self._ep_degree()
        )

    def apply_update(self, step: int) -> tuple[float, bool]:
        """After the backwards of an update: fault hooks, then reduce, unscale, clip and step (see
        `_apply_gradients`); the gradient norm and whether the optimizer stepped."""
        self.resilience.after_backward(step, self.model)
        self.resilience.phase("optimizer")
        with self.metrics.timer.region("optimizer"):
            return self._apply_gradients(self.config.optim.grad_clip, step)

    def evaluate(self, progress: Callable[[], None]) -> dict:
        """Held-out loss and perplexity of every `eval` source, the same figures on every rank.

        Its collectives are left out of the next step's `comm_bytes`.
        """
        record = {}
        if self.evaluation.sources:
            losses = self.evaluation.run(
                self.model, self.device, self.rank, self.world_size, self.autocast(), self.plan.sum_over_ranks, progress
            )
            record = eval_record(losses)
        if self.objective.evaluation_due(self.cursor.step, self.config.train.steps):
            record.update(self.objective.evaluate(self, progress))
        for collectives in self.plan.collectives:
            collectives.flush()
        self.plan.stats.take()
        return record

    def _evaluation_due(self, step: int) -> bool:
        last = self.config.train.steps
        return self.evaluation.due(step, last) or self.objective.evaluation_due(step, last)

    def documents(self, inputs_BS: torch.Tensor) -> torch.Tensor | None:
        """Each position's document when `data.document_masking` is on (None: plain causal attention)."""
        if not self.config.data.document_masking:
            return None
        return document_ids(inputs_BS, self.loader.tokenizer["eos_id"]).to(self.device)

    def autocast(self) -> torch.autocast:
        precision = self.precision
        return torch.autocast(self.device.type, dtype=precision.torch_compute_dtype, enabled=precision.autocast)

    def _apply_gradients(self, grad_clip: float, step: int) -> tuple[float, bool]:
        """Reduce, unscale, check, clip and step; a step whose gradients overflowed is skipped
        on every rank, leaving parameters and optimizer state untouched (or, with
        `fault.on_nonfinite: raise` and no dynamic loss scaling, fails on every rank)."""
        self.plan.sync_gradients()
        finite = self.scaler.unscale_and_check(self.model.parameters())
        if self.plan.world is not None:
            overflow = torch.tensor([0.0 if finite else 1.0], device=self.device)
            finite = self.plan.world.all_reduce(overflow, op=dist.ReduceOp.MAX).item() == 0.0
        if not finite and self.config.fault.on_nonfinite == "raise" and self.scaler.kind != "dynamic":
            raise NonFiniteGradients(
                f"step {step}: the gradients hold inf or NaN (fault.on_nonfinite: raise); a supervised run "
                "resumes from its last checkpoint"
            )
        grad_norm = self.plan.clip_gradients(self.model, grad_clip) if finite else float("nan")
        if finite:
            self.optimizer.step()
        self.scaler.update(finite)
        return grad_norm, finite

    def largest_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (the value itself in a single process)."""
        if not self.context.is_distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _ep_degree(self) -> int:
        return self.config.parallel.ep if self.config.parallel.mode == "ep" else 1

    def _barrier(self) -> None:
        if self.context.is_distributed:
            dist.barrier()

    def _sequence_length(self) -> int:
        """The sequence length FLOPs are counted at: the windows of token data; for DPO and GRPO, whose records
        are far shorter than `data.seq_len`, the longest record (with GRPO's completions)."""
        train = self.config.train
        if train.objective == "lm":
            return self.config.data.seq_len
        completions = self.config.grpo.max_new_tokens if train.objective == "grpo" else 0
        return self.loader.dataset.longest + completions

    def layout(self) -> dict:
        mode = self.config.parallel.mode if self.context.is_distributed else "single"
        return {"world_size": self.world_size, "ep_degree": self._ep_degree(), "mode": mode}


class NonFiniteGradients(RuntimeError):
    """A step's gradients hold inf or NaN where no loss scaling expects them."""


def _profile(name: str, device: torch.device) -> HardwareProfile:
    """The hardware profile of the run; a CPU's peak is measured (once per machine, cached)."""
    profile = resolve_profile(name, device)
    return measured_cpu_profile() if profile.measure_peak and device.type == "cpu" else profile


def train(config: RunConfig) -> TrainResult:
    """Build a trainer from `config` and run it to `train.steps`.

    A finished multi-rank run leaves its process group in order: all ranks meet, then the group
    is destroyed, so no rank ends while a peer's collective threads still talk to it (an abort at
    exit would read as a failure to whoever supervises the job).
    """
    result = Trainer(config).fit()
    if dist.is_initialized():
        dist.barrier()
        shutdown()
    return result

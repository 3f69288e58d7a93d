"""The single-program training loop: build from config, run steps, record everything."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.checkpoint import (
    Checkpoint,
    CheckpointManager,
    CheckpointMeta,
    Found,
    Layout,
    TensorPiece,
    find_resume_point,
)
from ferry.config import UserError
from ferry.data import DataCursor, MixedLoader
from ferry.metrics import ConsoleProgress, JsonlSink
from ferry.model import Transformer, count_model
from ferry.platform import environment_fingerprint, resolve_device
from ferry.train.checkpointing import (
    check_config,
    optimizer_record,
    restore_model,
    restore_optimizer,
    restore_rng,
    train_state_pieces,
)
from ferry.train.config import RunConfig
from ferry.train.losses import compute_loss
from ferry.train.optimizer import build_optimizer, learning_rate
from ferry.train.run_record import METRICS_NAME, RunRecord, prepare_run_dir


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float]
    final_record: dict


class Trainer:
    """Owns the model, optimizer, data loader and sinks of one run.

    Each optimizer step consumes exactly one global batch; gradient accumulation
    over micro-batches keeps the result independent of how the batch is split.
    """

    def __init__(self, config: RunConfig, rank: int = 0, world_size: int = 1):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        train = config.train
        if train.global_batch % (train.micro_batch * world_size):
            raise UserError(
                f"train.global_batch ({train.global_batch}) must be a multiple of "
                f"train.micro_batch x world size ({train.micro_batch} x {world_size})"
            )
        self.device = resolve_device(config.run.device, rank)
        self.loader = MixedLoader(config.data, seed=config.run.seed, global_batch=train.global_batch)
        tokenizer_vocab = self.loader.tokenizer["vocab_size"]
        if config.model.vocab_size < tokenizer_vocab:
            raise UserError(
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({tokenizer_vocab}) of {self.loader.datasets[0].label}"
            )
        torch.manual_seed(config.run.seed)
        self.model: Transformer = config.model.build().to(self.device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.cursor: DataCursor = self.loader.new_cursor()
        self.size = count_model(config.model, config.data.seq_len)
        self.tokens_per_step = train.global_batch * config.data.seq_len
        self.environment = environment_fingerprint(self.device)

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train to `train.steps`, or stop after step `stop_at` (checkpointed, to be resumed later).

        With `resume` set, the train state is restored first and the run's records
        continue from the checkpoint's step.
        """
        config = self.config
        stop_at = config.train.steps if stop_at is None else min(stop_at, config.train.steps)
        found, notes = self._resume()
        resumed_step = found.checkpoint.step if found and found.checkpoint else None
        run_dir = prepare_run_dir(config, resume_step=resumed_step)
        checkpoints = CheckpointManager(config.checkpoint, config.checkpoint.path(run_dir), last_step=resumed_step)
        record = RunRecord(run_dir, {**self._describe(), "resumed_from": _resume_record(found)})
        sink = JsonlSink(run_dir / METRICS_NAME)
        console = ConsoleProgress(config.train.steps, config.train.log_every, first_step=self.cursor.step)
        self._announce(console, run_dir, found, notes)
        losses: list[float] = []
        last: dict = {}
        try:
            while self.cursor.step < stop_at:
                last = self.train_step()
                losses.append(last["loss"])
                sink.write(last)
                console.update(last)
                if checkpoints.due(self.cursor.step):
                    checkpoints.save(*self.checkpoint_state())
            if checkpoints.last_step != self.cursor.step:
                checkpoints.save(*self.checkpoint_state())
            checkpoints.wait()
        except BaseException as exc:
            # A save still in flight is of an earlier, good step: let it finish, but report the first failure.
            with contextlib.suppress(Exception):
                checkpoints.wait()
            record.finish("failed", error=f"{type(exc).__name__}: {exc}", last_step=last)
            raise
        finally:
            sink.close()
            console.close()
        status = "completed" if self.cursor.step >= config.train.steps else "stopped"
        record.finish(status, last_step=last, checkpoints=[str(path) for path in checkpoints.saved])
        ending = "done" if status == "completed" else f"stopped at step {self.cursor.step}"
        console.message(f"ferry: {ending} — final loss {last.get('loss', float('nan')):.4f}; run in {run_dir}")
        return TrainResult(run_dir, losses, last)

    def checkpoint_state(self) -> tuple[dict[str, TensorPiece], CheckpointMeta]:
        """The whole train state now: tensors under logical names, and the manifest's metadata."""
        config = self.config
        step = self.cursor.step
        pieces = train_state_pieces(self.model, self.optimizer, self.device, self.rank, self.world_size)
        train_state = {
            "data_cursor": self.cursor.to_dict(),
            "schedule": {
                "kind": "warmup_cosine",
                "step": step,
                "total_steps": config.train.steps,
                "warmup_steps": config.optim.warmup_steps,
                "next_lr": learning_rate(config.optim, step, config.train.steps),
            },
            "optimizer": optimizer_record(self.model, self.optimizer),
        }
        meta = CheckpointMeta(
            step=step,
            tokens_seen=step * self.tokens_per_step,
            layout=Layout(**self._layout()),
            model_config=config.model.model_dump(mode="json"),
            run_config=config.model_dump(mode="json"),
            environment=self.environment,
            train_state=train_state,
        )
        return pieces, meta

    def restore(self, checkpoint: Checkpoint) -> list[str]:
        """Continue from `checkpoint`: weights, optimizer state, RNG and data position.

        Returns notes for the user: config fields that differ from the checkpoint's
        (a different model is refused) and states that could not be carried over.
        """
        notes = [f"config differs from the checkpoint's: {line}" for line in check_config(checkpoint, self.config)]
        with checkpoint:
            restore_model(checkpoint, self.model)
            restore_optimizer(checkpoint, self.model, self.optimizer)
            notes += restore_rng(checkpoint, self.device, self.rank, self.world_size)
        self.cursor = DataCursor.from_dict(checkpoint.manifest.train_state["data_cursor"])
        return notes

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the step's metrics record."""
        config = self.config
        started = time.perf_counter()
        step = self.cursor.step
        lr = learning_rate(config.optim, step, config.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        moe_layers = self.model.moe_layers()
        counts_LE = torch.zeros(len(moe_layers), config.model.moe.num_experts, dtype=torch.long, device=self.device)
        lm_sum = aux = z = 0.0
        micro_batches = self.loader.micro_batches(self.cursor, self.rank, self.world_size, config.train.micro_batch)
        for batch in micro_batches:
            share = batch.inputs_BS.shape[0] / config.train.global_batch
            output = self.model(batch.inputs_BS.to(self.device))
            parts = compute_loss(
                output, batch.targets_BS.to(self.device), config.model.moe, self.tokens_per_step, share
            )
            parts.objective.backward()
            lm_sum += parts.lm_loss_sum.item()
            aux += share * parts.aux_loss.item()
            z += share * parts.z_loss.item()
            for index, stats in enumerate(output.moe_stats):
                counts_LE[index] += stats.tokens_per_expert_E
        max_norm = config.optim.grad_clip if config.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        for layer, counts_E in zip(moe_layers, counts_LE):
            layer.router.update_bias(counts_E)
        self.cursor = self.loader.advance(self.cursor)
        elapsed = time.perf_counter() - started
        lm_loss = lm_sum / self.tokens_per_step
        moe = config.model.moe
        return {
            "step": self.cursor.step,
            "loss": lm_loss + moe.aux_loss_coef * aux + moe.z_loss_coef * z,
            "lm_loss": lm_loss,
            "aux_loss": aux,
            "z_loss": z,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.cursor.step * self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step / elapsed,
            "step_s": elapsed,
            "expert_load_max_over_mean": _imbalance(counts_LE),
        }

    def _resume(self) -> tuple[Found | None, list[str]]:
        """Restore the checkpoint `resume` points to, if any; None when the run does not resume."""
        config = self.config
        if config.resume is None:
            return None, []
        found = find_resume_point(config.resume, config.checkpoint.path(config.run.path))
        return found, self.restore(found.checkpoint) if found.checkpoint else []

    def _announce(self, console: ConsoleProgress, run_dir: Path, found: Found | None, notes: list[str]) -> None:
        for path, reason in found.skipped if found else []:
            console.message(f"ferry: warning: skipping checkpoint {path}: {reason}")
        for note in notes:
            console.message(f"ferry: note: {note}")
        console.message(
            f"ferry: training {self.config.run.name} on {self.device} — {self.size.total_params / 1e6:.2f}M params "
            f"({self.size.active_params / 1e6:.2f}M active), {self.config.train.steps} steps of "
            f"{self.tokens_per_step:,} tokens, writing to {run_dir}"
        )
        if found and found.checkpoint:
            console.message(f"ferry: resuming from {found.checkpoint.path} at step {found.checkpoint.step}")
        elif found:
            console.message(f"ferry: no checkpoint to resume from in {self.config.checkpoint.path(run_dir)}; step 0")

    def _describe(self) -> dict:
        return {
            "name": self.config.run.name,
            "config": self.config.model_dump(mode="json"),
            "data_mix": self.loader.mix_record(),
            "tokenizer": self.loader.tokenizer,
            "model_size": self.size.as_dict(),
            "layout": self._layout(),
            "environment": self.environment,
        }

    def _layout(self) -> dict:
        return {"world_size": self.world_size, "ep_degree": 1, "mode": "single"}


def _resume_record(found: Found | None) -> dict | None:
    """What run.json says about where the run continued from, and which newer checkpoints were unusable."""
    if found is None or found.checkpoint is None:
        return None
    return {
        "checkpoint": str(found.checkpoint.path),
        "step": found.checkpoint.step,
        "skipped": [{"checkpoint": str(path), "reason": reason} for path, reason in found.skipped],
    }


def _imbalance(counts_LE: torch.Tensor) -> float:
    """Mean over MoE layers of max/mean expert load (1.0 = perfectly even)."""
    if counts_LE.numel() == 0:
        return 1.0
    load_LE = counts_LE.double()
    return (load_LE.max(dim=1).values / load_LE.mean(dim=1)).mean().item()


def train(config: RunConfig) -> TrainResult:
    """Build a trainer from `config` and run it to `train.steps`."""
    return Trainer(config).fit()

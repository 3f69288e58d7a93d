"""What a run says about itself: the console lines it starts with, the description run.json opens with, the
line of each held-out evaluation, and where a resumed run continued from.

Kept apart from the trainer, which trains; these functions only read its state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ferry.checkpoint import Found

if TYPE_CHECKING:
    from ferry.train.trainer import Trainer


def announce(trainer: Trainer, run_dir: Path, found: Found | None, notes: list[str]) -> None:
    """The console lines a run starts with: skipped checkpoints, notes, precision, kernels, what it trains
    where, and where it resumes from."""
    say = trainer.hub.message
    for path, reason in found.skipped if found else []:
        say(f"ferry: warning: skipping checkpoint {path}: {reason}")
    for note in notes:
        say(f"ferry: note: {note}")
    say(f"ferry: precision: {'; '.join(trainer.precision.decisions)}")
    say(f"ferry: {trainer.kernels.describe()}")
    if trainer.compiled["mode"] != "none":
        eager = trainer.compiled["eager_ops"]
        say(
            f"ferry: compile: {trainer.compiled['regions']} blocks compiled on the first step"
            + (f"; eager inside them: {', '.join(eager)}" if eager else "")
        )
    layout = trainer.layout()
    say(
        f"ferry: training {trainer.config.run.name} on {trainer.device} x {trainer.world_size} "
        f"({layout['mode']}, ep {layout['ep_degree']}, {trainer.context.backend or 'no'} collectives, "
        f"profile {trainer.profile.name}) — {trainer.size.total_params / 1e6:.2f}M params "
        f"({trainer.size.active_params / 1e6:.2f}M active), {trainer.config.train.steps} steps of "
        f"{step_size(trainer)}, writing to {run_dir}"
    )
    if trainer.hub.prometheus is not None:
        say(f"ferry: Prometheus metrics at {trainer.hub.prometheus.url}")
    if found and found.checkpoint:
        say(f"ferry: resuming from {found.checkpoint.path} at step {found.checkpoint.step}")
    elif found:
        weights = "the init_from weights above" if trainer.config.init_from is not None else "the seed's weights"
        say(
            f"ferry: no checkpoint to resume from in {trainer.config.checkpoint.path(run_dir)} (this run has saved "
            f"none yet): it starts at step 0 with {weights}"
        )


def step_size(trainer: Trainer) -> str:
    """What one step takes, in the objective's unit."""
    train = trainer.config.train
    if train.objective == "dpo":
        return f"{train.global_batch} preference pairs"
    if train.objective == "grpo":
        return f"{train.global_batch} prompts x {trainer.config.grpo.group_size} sampled completions"
    return f"{trainer.tokens_per_step:,} tokens"


def describe(trainer: Trainer) -> dict:
    """What run.json says about a run before it trains: config, data, model, layout, hardware, numerics."""
    return {
        "name": trainer.config.run.name,
        "config": trainer.config.model_dump(mode="json"),
        "data_mix": trainer.loader.mix_record(),
        "tokenizer": trainer.loader.tokenizer,
        "model_size": trainer.size.as_dict(),
        "initial_weights_xxh3": trainer.initial_weights,
        "layout": trainer.layout(),
        "hardware": describe_hardware(trainer),
        "precision": trainer.precision.as_dict(),
        "kernels": trainer.kernels.as_dict(),
        "compile": trainer.compiled,
        "environment": {**trainer.environment, "comm_backend": trainer.context.backend},
    }


def describe_hardware(trainer: Trainer) -> dict:
    """The hardware section of run.json: the profile, and the peak MFU is computed against with its source (a
    measured CPU peak may be measured again during the run, so the run's end writes this section again)."""
    return {
        "profile": trainer.profile.name,
        "peak_tflops": trainer.profile.peak_tflops,
        "mfu_dtype": trainer.precision.mfu_dtype,
        "mfu_peak": trainer.metrics.peak.provenance,
        "price_per_device_hour_usd": trainer.profile.price_per_device_hour_usd,
        "host_allocator": trainer.host_allocator,
    }


def eval_line(record: dict) -> str:
    """The console line of a step that evaluated: every held-out figure of every source."""
    figures = [
        f"{name} loss {loss:.4f} (perplexity {record['eval.perplexity'][name]:.2f})"
        for name, loss in record.get("eval.loss", {}).items()
    ]
    for key, label, form in _OBJECTIVE_EVAL:
        figures += [f"{name} {label} {form.format(value)}" for name, value in record.get(key, {}).items()]
    return f"ferry: held-out at step {record['step']}: {', '.join(figures)}"


# held-out figures of the preference and RL objectives: record key, console label, format
_OBJECTIVE_EVAL = (
    ("eval/rewards/accuracy", "reward accuracy", "{:.1%}"),
    ("eval/rewards/margin", "reward margin", "{:.3f}"),
    ("eval/solve_rate", "solve rate", "{:.1%}"),
    ("eval/greedy_solve_rate", "greedy", "{:.1%}"),
)


def resume_record(found: Found | None, carried: dict[str, str], times: dict[str, float]) -> dict | None:
    """What run.json says about where the run continued from, which newer checkpoints were unusable,
    which parts of the train state came over, and what verifying and restoring cost."""
    if found is None or found.checkpoint is None:
        return None
    return {
        "checkpoint": str(found.checkpoint.path),
        "step": found.checkpoint.step,
        "skipped": [{"checkpoint": str(path), "reason": reason} for path, reason in found.skipped],
        "carried": carried,
        **times,
    }

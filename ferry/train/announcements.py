"""What a run says about itself: the console lines it starts with, the description run.json opens with, the
line of each held-out evaluation, and where a resumed run continued from.

Kept apart from the training loop; these functions only read the records of the run they are given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.checkpoint import Found
from ferry.metrics import MetricsHub
from ferry.train.optimizer import schedule_warning

if TYPE_CHECKING:
    from ferry.data import MixedLoader
    from ferry.data.records import RecordLoader
    from ferry.model import ModelSize
    from ferry.platform.hardware import MfuPeak
    from ferry.precision import PrecisionPolicy
    from ferry.precision.step_weights import StepWeights
    from ferry.train.assembly import Instruments, Job, ModelParts, Numerics


def announce(
    job: Job,
    numerics: Numerics,
    model: ModelParts,
    size: ModelSize,
    step_size: str,
    hub: MetricsHub,
    found: Found | None,
    notes: list[str],
    overlap: dict,
) -> None:
    """The console lines a run starts with: skipped checkpoints, notes, precision, kernels, what it trains
    where (a model of `size`, steps of `step_size`), and where it resumes from."""
    config = job.config
    run_dir = config.run.path
    say = hub.message
    for path, reason in found.skipped if found else []:
        say(f"ferry: warning: skipping checkpoint {path}: {reason}")
    for note in notes:
        say(f"ferry: note: {note}")
    decisions = numerics.precision.decisions
    say(f"ferry: precision: {'; '.join(d for d in decisions if not d.startswith('warning: '))}")
    for decision in decisions:
        if decision.startswith("warning: "):
            say(f"ferry: {decision}")
    say(f"ferry: {numerics.kernels.describe()}")
    schedule = schedule_warning(config.optim, config.train.steps)
    if schedule is not None:
        say(f"ferry: warning: {schedule}")
    compiled = model.compiled
    if compiled["mode"] != "none":
        eager = compiled["eager_ops"]
        say(
            f"ferry: compile: {compiled['regions']} blocks compiled on the first step (its compile_s says how long)"
            + (f"; eager inside them: {', '.join(eager)}" if eager else "")
        )
    casts = weight_casts(model.step_weights, numerics.precision)
    say(f"ferry: step shape: {step_shape_line(job.micro_batch, model.recompute, casts)}")
    if "candidates" in overlap:
        measured = ", ".join(
            f"{name} {1000 * figure['step_s']:.1f} ms ({figure['ep_overlap_share']:.0%} overlapped)"
            for name, figure in overlap["candidates"].items()
        )
        steps = overlap["trial_steps"]
        say(f"ferry: ep_overlap auto: {overlap['chosen']}, the fastest of {measured} ({steps} steps each)")
    layout = job.layout.record()
    preset = f"model {config.run.model_preset}, " if config.run.model_preset else ""
    say(
        f"ferry: training {config.run.name} on {job.device} x {job.world_size} "
        f"({layout['mode']}, {job.kinds.banner(job.layout)}, {job.context.backend or 'no'} collectives, "
        f"profile {numerics.profile.name}) — {preset}{size.total_params / 1e6:.2f}M params "
        f"({size.active_params / 1e6:.2f}M active), {config.train.steps} steps of {step_size}, writing to {run_dir}"
    )
    for line in job.kinds.announcements(config, job.layout):
        say(line)
    if hub.prometheus is not None:
        say(f"ferry: Prometheus metrics at {hub.prometheus.url}")
    for tracker in hub.trackers:
        say(tracker.announcement())
    if found and found.checkpoint:
        say(f"ferry: resuming from {found.checkpoint.path} at step {found.checkpoint.step}")
    elif found:
        weights = "the init_from weights above" if config.init_from is not None else "the seed's weights"
        say(
            f"ferry: no checkpoint to resume from in {config.checkpoint.path(run_dir)} (this run has saved "
            f"none yet): it starts at step 0 with {weights}"
        )


def describe(
    job: Job,
    numerics: Numerics,
    model: ModelParts,
    instruments: Instruments,
    loader: MixedLoader | RecordLoader,
    initial_weights: str | None,
    overlap: dict,
) -> dict:
    """What run.json says about a run before it trains: config, data, model, layout, hardware, numerics."""
    return {
        "name": job.config.run.name,
        "config": job.config.model_dump(mode="json"),
        "data_mix": loader.mix_record(),
        "tokenizer": loader.tokenizer,
        "model_size": instruments.size.as_dict(),
        "initial_weights_xxh3": initial_weights,
        "layout": job.layout.record(),
        "hardware": describe_hardware(numerics, instruments.metrics.peak),
        "precision": numerics.precision.as_dict(),
        "kernels": numerics.kernels.as_dict(),
        "compile": model.compiled,
        "micro_batch": job.micro_batch,
        "activation_checkpointing": model.recompute,
        "weight_casts": weight_casts(model.step_weights, numerics.precision),
        "ep_overlap": overlap,
        "environment": {**instruments.environment, "comm_backend": job.context.backend},
    }


def step_shape_line(choice: dict, recompute: dict, casts: dict) -> str:
    """How a step runs: its micro-batch (and how it was `choice`n), what the backward recomputes, how often the
    weights are cast."""
    micro = f"micro-batch {choice['chosen']}"
    if choice["requested"] == "auto":
        micro += (
            f" (auto: the largest whose estimate, {choice['estimate_gib']} GiB, fits {choice['headroom']:.0%} of "
            f"{choice['device_gib']} GiB on {choice['device']})"
        )
    return (
        f"{micro}; activation checkpointing {recompute['mode']}"
        + (f" (keeps {recompute['kept']})" if recompute["mode"] != "none" else "")
        + f"; weights cast {casts['mode']}"
    )


def weight_casts(step_weights: StepWeights | None, precision: PrecisionPolicy) -> dict:
    """When the weights are cast to the compute dtype: once a step (`step_weights`), per use, or never."""
    if step_weights is None:
        mode = "per use by autocast" if precision.autocast else "never (compute in the parameter dtype)"
        return {"mode": mode}
    return {"mode": "once a step", "parameters": step_weights.parameters, "dtype": str(step_weights.dtype)}


def describe_hardware(numerics: Numerics, peak: MfuPeak) -> dict:
    """The hardware section of run.json: the profile, and the `peak` MFU is computed against with its source (a
    measured CPU peak may be measured again during the run, so the run's end writes this section again)."""
    return {
        "profile": numerics.profile.name,
        "peak_tflops": numerics.profile.peak_tflops,
        "mfu_dtype": numerics.precision.mfu_dtype,
        "mfu_peak": peak.provenance,
        "price_per_device_hour_usd": numerics.profile.price_per_device_hour_usd,
        "host_allocator": numerics.host_allocator,
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

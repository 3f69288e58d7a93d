"""Which parameters the optimizer decays, and the learning-rate schedule."""

from __future__ import annotations

import math

from torch import nn

from ferry.model.parameter_kinds import is_bias
from ferry.train.config import OptimConfig


def decayed_parameter_names(model: nn.Module) -> set[str]:
    """Weight matrices and expert tensors decay; norms, biases (an expert's too: a matrix), attention sinks and the
    token embedding do not."""
    return {
        name
        for name, param in model.named_parameters()
        if param.requires_grad and param.ndim >= 2 and not name.startswith("tok_embeddings") and not is_bias(name)
    }


def learning_rate(config: OptimConfig, step: int, total_steps: int) -> float:
    """The learning rate of the 0-based `step` of `total_steps`.

    Every schedule warms up linearly over `warmup_steps` and, when it decays, reaches
    `min_lr_ratio * lr` at the last step. `wsd` (warm-up, stable, decay; Hu et al. 2024,
    MiniCPM) holds `lr` until the last `decay_fraction` of the steps and decays linearly
    over them (each a step lower, the last at the floor), so a run can be extended from
    any checkpoint of its stable phase.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    floor = config.lr * config.min_lr_ratio
    if config.schedule == "constant":
        return config.lr
    if config.schedule == "wsd":
        decay_steps = max(1, round(config.decay_fraction * total_steps))
        decay_start = max(config.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return config.lr
        progress = min(1.0, (step - decay_start + 1) / (total_steps - decay_start))
        return config.lr - (config.lr - floor) * progress
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    if config.schedule == "linear":
        return config.lr - (config.lr - floor) * progress
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_warning(config: OptimConfig, total_steps: int) -> str | None:
    """What a run should hear before it trains when its schedule cannot run its course in `total_steps`: a warm-up
    as long as the run ends it still rising, and a decaying schedule whose warm-up leaves it no step to decay
    over ends at the peak. None when the schedule runs its course."""
    last = learning_rate(config, total_steps - 1, total_steps)
    fix = "lower optim.warmup_steps or raise train.steps"
    if config.warmup_steps >= total_steps:
        decay = "" if config.schedule == "constant" else f", and the {config.schedule} decay never starts"
        return (
            f"optim.warmup_steps ({config.warmup_steps}) is not below train.steps ({total_steps}): the whole run is "
            f"warm-up, its last step at learning rate {last:.2e} (optim.lr {config.lr:.2e}){decay}; {fix}"
        )
    floor = config.lr * config.min_lr_ratio
    if config.schedule != "constant" and not math.isclose(last, floor, rel_tol=1e-6):
        return (
            f"optim.schedule {config.schedule} ends at {last:.2e}, not at its floor {floor:.2e}: optim.warmup_steps "
            f"({config.warmup_steps}) leaves it no step of train.steps ({total_steps}) to decay over; {fix}"
        )
    return None

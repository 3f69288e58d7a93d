"""Which parameters AdamW decays, and the learning-rate schedule."""

from __future__ import annotations

import math

from torch import nn

from ferry.train.config import OptimConfig


def decayed_parameter_names(model: nn.Module) -> set[str]:
    """Weight matrices and expert tensors decay; norms, biases and the token embedding do not."""
    return {
        name
        for name, param in model.named_parameters()
        if param.requires_grad and param.ndim >= 2 and not name.startswith("tok_embeddings")
    }


def learning_rate(config: OptimConfig, step: int, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

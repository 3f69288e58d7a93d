"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ferry.train.config import OptimConfig


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """Decay every weight matrix and expert tensor; not norms, biases or the token embedding.

    Parameter groups are keyed by name order, so the optimizer state maps onto
    parameter names the same way on every run.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.startswith("tok_embeddings"):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps)


def learning_rate(config: OptimConfig, step: int, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

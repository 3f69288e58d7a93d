"""Inputs and targets of windows: targets that are not trained carry the index the loss ignores."""

from __future__ import annotations

import torch

# what `torch.nn.functional.cross_entropy` skips by default
IGNORE_INDEX = -100


def split_windows(windows_BS1: torch.Tensor, trained_BS1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of `seq_len + 1` tokens as (inputs, targets); with `trained_BS1`, untrained targets
    (prompts, padding, end-of-text in packed conversations) become IGNORE_INDEX."""
    inputs_BS = windows_BS1[:, :-1].contiguous()
    targets_BS = windows_BS1[:, 1:].clone()
    if trained_BS1 is not None:
        targets_BS[~trained_BS1[:, 1:]] = IGNORE_INDEX
    return inputs_BS, targets_BS

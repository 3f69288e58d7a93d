"""Inputs and targets of windows: targets that are not trained carry the index the loss ignores."""

from __future__ import annotations

import numpy as np
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


def completion_batch(
    prompts: list[np.ndarray], completions: list[np.ndarray], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt followed by its completion, right-padded to the longest, as (inputs, targets); only the
    completion's tokens are targets. Padding sits after every real token, so causal attention never sees it."""
    lengths = [len(prompt) + len(completion) for prompt, completion in zip(prompts, completions)]
    rows_BS1 = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    trained_BS1 = torch.zeros_like(rows_BS1, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        rows_BS1[row, : lengths[row]] = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))
        trained_BS1[row, len(prompt) : lengths[row]] = True
    return split_windows(rows_BS1, trained_BS1)

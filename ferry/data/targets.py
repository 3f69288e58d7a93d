"""Inputs and targets of windows: targets that are not trained carry the index the loss ignores, and
positions that only pad a row are marked, so that the routers' statistics leave them out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# what `torch.nn.functional.cross_entropy` skips by default
IGNORE_INDEX = -100


@dataclass
class Batch:
    """Input and target token ids of a slice of a global batch (untrained targets: IGNORE_INDEX), and
    `padding_BS`, True at the positions that only pad their row (None when no position does)."""

    inputs_BS: torch.Tensor
    targets_BS: torch.Tensor
    padding_BS: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        padding_BS = None if self.padding_BS is None else self.padding_BS.to(device)
        return Batch(self.inputs_BS.to(device), self.targets_BS.to(device), padding_BS)


def split_windows(windows_BS1: torch.Tensor, trained_BS1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of `seq_len + 1` tokens as (inputs, targets); with `trained_BS1`, untrained targets
    (prompts, padding, end-of-text in packed conversations) become IGNORE_INDEX."""
    inputs_BS = windows_BS1[:, :-1].contiguous()
    targets_BS = windows_BS1[:, 1:].clone()
    if trained_BS1 is not None:
        targets_BS[~trained_BS1[:, 1:]] = IGNORE_INDEX
    return inputs_BS, targets_BS


def completion_batch(prompts: list[np.ndarray], completions: list[np.ndarray], pad_id: int) -> Batch:
    """Each prompt followed by its completion, right-padded to the longest; only the completion's tokens
    are targets. Padding sits after every real token, so causal attention never sees it."""
    lengths = [len(prompt) + len(completion) for prompt, completion in zip(prompts, completions)]
    rows_BS1 = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    trained_BS1 = torch.zeros_like(rows_BS1, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        rows_BS1[row, : lengths[row]] = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))
        trained_BS1[row, len(prompt) : lengths[row]] = True
    inputs_BS, targets_BS = split_windows(rows_BS1, trained_BS1)
    padding_BS = torch.arange(inputs_BS.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    return Batch(inputs_BS, targets_BS, padding_BS if bool(padding_BS.any()) else None)


def packing_padding(inputs_BS: torch.Tensor, eos_id: int) -> torch.Tensor | None:
    """Where packed rows are padded: a row's final run of end-of-text tokens after its first, which ends
    the row's last document (`RowPacker` fills a row's rest so). None when no row is padded."""
    eos_BS = inputs_BS == eos_id
    final_run_BS = eos_BS.flip(1).cumprod(dim=1).flip(1).bool()
    padding_BS = torch.zeros_like(final_run_BS)
    padding_BS[:, 1:] = final_run_BS[:, 1:] & final_run_BS[:, :-1]
    return padding_BS if bool(padding_BS.any()) else None

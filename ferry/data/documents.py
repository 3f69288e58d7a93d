"""Documents inside a packed window: every document ends with the end-of-text token."""

from __future__ import annotations

import torch


def document_ids(tokens_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The index, within its row, of the document each position belongs to; an end-of-text token
    belongs to the document it ends, the token after it starts the next one."""
    ends_BS = (tokens_BS == eos_id).long()
    return ends_BS.cumsum(dim=1) - ends_BS

"""`moe.grouped_mm` as one batched matmul over groups padded to the largest group.

One `bmm` call instead of one matmul per expert, paid for with padding: every
expert computes as many rows as the busiest one, and the rows are copied into and
out of the padded layout, and the largest group's size is read on the host (one
device sync). It suits devices where a kernel launch costs more than the padding
(many small, even groups).
"""

from __future__ import annotations

import torch

from ferry.kernels.amp import outside_autocast
from ferry.kernels.dispatch import reads_group_sizes_on_host


@reads_group_sizes_on_host
@outside_autocast
def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    num_experts, rows = w_EOI.shape[0], x_NI.shape[0]
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    capacity = int(counts_E.max())
    expert_of_N = torch.repeat_interleave(torch.arange(num_experts, device=x_NI.device), counts_E, output_size=rows)
    first_row_E = offsets_E - counts_E
    rank_in_group_N = torch.arange(rows, device=x_NI.device) - first_row_E[expert_of_N]
    padded_row_N = expert_of_N * capacity + rank_in_group_N
    x_ECI = x_NI.new_zeros(num_experts * capacity, x_NI.shape[1]).index_copy(0, padded_row_N, x_NI)
    y_ECO = torch.bmm(x_ECI.view(num_experts, capacity, -1), w_EOI.transpose(1, 2))
    return y_ECO.view(num_experts * capacity, -1).index_select(0, padded_row_N)

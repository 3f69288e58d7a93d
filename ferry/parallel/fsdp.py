"""The FSDP2 baseline: every block's weights (experts included) sharded and gathered per use.

FSDP2's own all-gather and reduce-scatter are routed through ferry's collectives
interface (its custom-comm hooks), so the baseline's traffic is measured exactly
like expert parallelism's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from ferry.comm import Collectives
from ferry.model import Transformer


class _TimedAllGather(DefaultAllGather):
    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with self.collectives.timed("fsdp_all_gather", output_tensor.numel() * output_tensor.element_size()):
            return super().__call__(output_tensor, input_tensor, group, async_op)


class _TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with self.collectives.timed("fsdp_reduce_scatter", input_tensor.numel() * input_tensor.element_size()):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def apply_fsdp(model: Transformer, device: torch.device, collectives: Collectives) -> None:
    """Shard each block, then the root; gradients are summed (the loss is already globally normalised)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    units = [*model.layers, model]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_custom_all_gather(_TimedAllGather(collectives))
        unit.set_custom_reduce_scatter(_TimedReduceScatter(collectives))
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)

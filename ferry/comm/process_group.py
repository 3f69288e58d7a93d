"""Process groups and the device mesh, from config and the launcher's environment.

torchrun (and `ferry train --nproc`) describe the job in RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR; a process started without them is a world of one and
creates no process group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ferry.comm.config import CommConfig
from ferry.config import UserError


@dataclass
class DistContext:
    """Who this process is in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) as the launcher set them; (0, 1, 0) for a plain process."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        if name == "nccl" and device.type != "cuda":
            raise UserError(f"comm.backend: nccl needs a CUDA or ROCm device, the run is on {device.type}")
        if not dist.is_backend_available(name):
            raise UserError(f"comm.backend: {name} is not available in this torch build")
        return name
    if device.type == "cuda":
        return "nccl"
    if device.type == "xpu":
        return "xccl"
    return "gloo"


def init_distributed(config: CommConfig, device: torch.device) -> DistContext:
    """Join the job's default process group when launched as several processes."""
    rank, world_size, local_rank = launcher_ranks()
    if world_size == 1 and not dist.is_initialized():
        return DistContext(0, 1, 0, None)
    backend = resolve_backend(config.backend, device)
    if device.type != "cpu":
        # Object collectives (`all_gather_object`, `gather_object`) stage their bytes on the current
        # device of the backend's type, not the group's bound device: without this, every rank of a
        # node would use device 0.
        torch.get_device_module(device.type).set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=config.timeout_s),
            device_id=device if device.type != "cpu" else None,
        )
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def build_mesh(context: DistContext, ep: int, device: torch.device) -> DeviceMesh | None:
    """A 2-D (dp, ep) mesh: EP groups are runs of `ep` consecutive ranks, each holding all experts once."""
    if not context.is_distributed:
        return None
    return init_device_mesh(device.type, (context.world_size // ep, ep), mesh_dim_names=("dp", "ep"))


@dataclass(frozen=True)
class PipelineGroups:
    """The groups of a (pp, dp, ep) layout: this rank's pipeline (one rank per stage), the ranks of its stage
    (`replicas`: they hold the same dense weights), and inside them its EP group and the ranks holding its experts."""

    pp: dist.ProcessGroup
    replicas: dist.ProcessGroup
    ep: dist.ProcessGroup
    dp: dist.ProcessGroup


def build_pipeline_mesh(context: DistContext, pp: int, ep: int, device: torch.device) -> PipelineGroups:
    """A 3-D (pp, dp, ep) mesh: a stage's ranks are a run of world / pp consecutive ranks, laid out inside as the
    (dp, ep) mesh of `build_mesh`; a pipeline takes the rank at the same place in each stage."""
    replicas = context.world_size // pp
    mesh = init_device_mesh(device.type, (pp, replicas // ep, ep), mesh_dim_names=("pp", "dp", "ep"))
    stage_ranks = [list(range(stage * replicas, (stage + 1) * replicas)) for stage in range(pp)]
    stage_group, _ = dist.new_subgroups_by_enumeration(stage_ranks)
    return PipelineGroups(mesh["pp"].get_group(), stage_group, mesh["ep"].get_group(), mesh["dp"].get_group())


def build_context_group(context: DistContext, cp: int) -> dist.ProcessGroup:
    """This rank's context-parallel group: a run of `cp` consecutive ranks, which read the same rows and split every
    sequence (`cp` divides a pipeline stage's run of ranks, so the runs lie inside the stages)."""
    ranks = list(range(context.world_size))
    group, _ = dist.new_subgroups_by_enumeration([ranks[start : start + cp] for start in range(0, len(ranks), cp)])
    return group


def build_exchange_groups(context: DistContext, ep: int, node_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's groups for the hierarchical expert exchange, its rail and its node: EP groups are runs of `ep`
    consecutive ranks made of whole nodes of `node_size`; a rail takes the rank at one place of each node of an EP
    group, in node order. Every rank creates every group, in one order, as torch asks."""
    world = context.world_size
    nodes = [list(range(start, start + node_size)) for start in range(0, world, node_size)]
    rails = [
        list(range(base + place, base + ep, node_size)) for base in range(0, world, ep) for place in range(node_size)
    ]
    rail_group, _ = dist.new_subgroups_by_enumeration(rails)
    node_group, _ = dist.new_subgroups_by_enumeration(nodes)
    return rail_group, node_group


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

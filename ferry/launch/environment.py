"""The environment a launched rank sees, and where each variable comes from (`ferry launch --explain`).

ferry sets only the platform preset, each variable with its cited source; the launcher and the
scheduler set the rest, and the variables a vendor plugin owns are listed as deliberately unset.
"""

from __future__ import annotations

import textwrap

from ferry.launch.platform import PLATFORM_DIR
from ferry.launch.spec import LaunchSpec
from ferry.launch.torchrun_form import LAUNCHER_ENV, LAUNCHER_ENV_SOURCE
from ferry.train.memory import gib, memory_estimate

TORCHRUN_SETS = {
    "RANK": "global rank of the worker",
    "LOCAL_RANK": "rank within the node: ferry picks the device from it",
    "WORLD_SIZE": "number of workers in the job",
    "LOCAL_WORLD_SIZE": "workers on this node",
    "MASTER_ADDR": "address of the store the workers meet at",
    "MASTER_PORT": "port of that store",
    "TORCHELASTIC_RESTART_COUNT": "how many times the agent restarted the workers",
    "OMP_NUM_THREADS": "1 per worker when a node runs several and it is unset (torchrun's default)",
}

SCHEDULER_SETS = {
    "slurm": {
        "SLURM_JOB_NODELIST": "the job's hosts: the first one hosts the c10d rendezvous",
        "SLURM_NNODES": "number of nodes, passed to torchrun --nnodes",
        "SLURM_JOB_ID": "the rendezvous id, unique per job",
    },
    "k8s": {
        "PET_NNODES": "TrainJob: numNodes, read by torchrun as --nnodes",
        "PET_MASTER_ADDR": "TrainJob: the first pod's address: the c10d endpoint $(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
        "PET_MASTER_PORT": "TrainJob: the rendezvous port",
        "PET_NPROC_PER_NODE": "TrainJob and PyTorchJob: numProcPerNode (the rendered --nproc-per-node says the same)",
        "MASTER_ADDR (PyTorchJob)": "the master pod's service: the c10d endpoint $(MASTER_ADDR):$(MASTER_PORT)",
        "MASTER_PORT (PyTorchJob)": "the master pod's port",
    },
}


def preset(spec: LaunchSpec) -> dict[str, str]:
    """The variables ferry exports on every node: the platform's preset."""
    return {variable.name: variable.value for variable in spec.platform.env}


def explain(spec: LaunchSpec, width: int = 100) -> str:
    """Every variable of the job with its value and origin, for a person to check before submitting."""
    platform = spec.platform
    lines = [
        f"{spec.job_name}: {spec.nodes} node(s) of {platform.name} x {spec.nproc_per_node} process(es), "
        f"{spec.platform.comm_backend}, hardware profile {platform.hardware}",
        *_pipeline_layout(spec),
        *_context_layout(spec),
        _memory_line(spec),
        "",
        "set by ferry for torchrun:",
        *(f"  {name}={value}" for name, value in LAUNCHER_ENV.items()),
        *textwrap.wrap(
            LAUNCHER_ENV_SOURCE,
            width,
            initial_indent="      ",
            subsequent_indent="      ",
            break_on_hyphens=False,
            break_long_words=False,
        ),
        "",
        f"set by ferry from the platform preset ({PLATFORM_DIR.name}/{platform.name}.yaml):",
    ]
    if not platform.env:
        lines.append("  (none: the defaults of torch and the collective library are right on this platform)")
    for variable in platform.env:
        lines.append(f"  {variable.name}={variable.value}")
        lines.extend(
            textwrap.wrap(
                variable.source,
                width,
                initial_indent="      ",
                subsequent_indent="      ",
                break_on_hyphens=False,
                break_long_words=False,
            )
        )
    if platform.left_to_plugin:
        lines += ["", "left unset on purpose (a vendor plugin or runtime sets them):"]
        for variable in platform.left_to_plugin:
            lines.append(f"  {variable.name}")
            lines.extend(
                textwrap.wrap(
                    variable.reason,
                    width,
                    initial_indent="      ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                    break_long_words=False,
                )
            )
    lines += ["", "set per worker by torchrun:"]
    lines += [f"  {name:<28} {meaning}" for name, meaning in TORCHRUN_SETS.items()]
    for scheduler in spec.schedulers:
        if scheduler in SCHEDULER_SETS:
            lines += ["", f"set by {scheduler} and read by the rendered files:"]
            lines += [f"  {name:<28} {meaning}" for name, meaning in SCHEDULER_SETS[scheduler].items()]
    return "\n".join(lines)


def _memory_line(spec: LaunchSpec) -> str:
    """What one rank holds at a step's peak by the memory model (`ferry/train/memory.py`), with the optimizer's
    state as the config chooses it (AdamW's two moments, or Muon's one buffer for the matrices)."""
    device = "cuda" if spec.platform.accelerator_resource else "cpu"
    estimate = memory_estimate(spec.config, spec.world_size, device)
    return f"memory per rank: about {gib(estimate.total_bytes)} GiB at a step's peak ({estimate.describe()})"


def _context_layout(spec: LaunchSpec) -> list[str]:
    """Where a context-parallel group falls: a run of consecutive ranks, inside a node when it fits, since every
    attention layer gathers keys and values across the group."""
    cp = spec.config.parallel.cp
    if cp == 1:
        return []
    inside = spec.nproc_per_node % cp == 0
    placement = "inside a node" if inside else "across nodes: every attention layer's gather crosses the network"
    return [
        f"context parallelism: groups of {cp} consecutive ranks split every sequence ({placement}); the data is split "
        f"over {spec.world_size // (cp * spec.config.parallel.pp)} data rank(s)"
    ]


def _pipeline_layout(spec: LaunchSpec) -> list[str]:
    """Where a pipeline's stages fall: each stage is a run of consecutive ranks, so with whole nodes per stage the
    expert all-to-alls and gradient reductions stay inside a node and only activations cross between nodes."""
    pp = spec.config.parallel.pp
    if pp == 1:
        return []
    per_stage = spec.world_size // pp
    placement = (
        f"{per_stage // spec.nproc_per_node} whole node(s) each: only the stages' activations cross the network"
        if per_stage % spec.nproc_per_node == 0
        else "stages share nodes: the expert exchanges of a stage may cross the network"
    )
    return [f"pipeline: {pp} stages ({spec.config.parallel.pp_schedule}) of {per_stage} consecutive ranks, {placement}"]

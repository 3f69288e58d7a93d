"""Platforms: what a node of a cluster offers a job (accelerators, network devices, the variables its
collectives need), as data beside the hardware profiles, so moving clusters means naming another file.

A platform file lives in `ferry/launch/platforms/<name>.yaml`. Every variable it sets carries the
source that justifies it; the variables a vendor plugin already sets (aws-ofi-nccl chooses the EFA
provider and NCCL's buffer and chunk sizes itself) are listed under `left_to_plugin` with the reason,
so nobody adds them back by hand.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from ferry.config import Section, UserError
from ferry.config.loader import validate
from ferry.platform.hardware import load_profile

PLATFORM_DIR = Path(__file__).parent / "platforms"


class PresetVariable(Section):
    """One environment variable a platform sets, and why (a URL and what it says)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str
    source: str = Field(min_length=10, description="where the value comes from: a URL and the sentence that says so")


class PluginVariable(Section):
    """A variable deliberately left unset because a vendor plugin or runtime sets it."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    reason: str = Field(min_length=10)


class Network(Section):
    """The inter-node fabric of one node: how many devices, their Kubernetes resource, their bandwidth."""

    fabric: Literal["efa", "infiniband", "roce", "ethernet"]
    devices: int = Field(ge=0, description="network devices per node (EFA interfaces, HCAs); 0 when none is requested")
    resource: str | None = Field(
        None, description="Kubernetes extended resource for the devices, e.g. vpc.amazonaws.com/efa"
    )
    bandwidth_gbps: float = Field(gt=0, description="inter-node bandwidth of one node")

    @model_validator(mode="after")
    def _resource_needs_devices(self) -> Network:
        if self.resource is not None and self.devices < 1:
            raise ValueError("a network resource is requested per device: devices must be at least 1")
        return self


class LinkTier(Section):
    """One tier of the links between a node's accelerators (inside the node) or between nodes: its one-way bandwidth
    per accelerator, what kind of figure that is, the time a small collective takes on it, and the source of both.
    What a planner prices a collective on."""

    link: str = Field(min_length=2, description="what carries it: NVLink4 via NVSwitch, xGMI, EFA, RoCE, loopback")
    gbytes_per_s: float | None = Field(
        None, gt=0, description="one way, per accelerator, to all its peers at once (GB/s); none where unmeasured"
    )
    pair_gbytes_per_s: float | None = Field(
        None, gt=0, description="one way between one pair, where less than the whole (a point-to-point mesh: xGMI)"
    )
    figure: Literal["datasheet", "derived", "measured", "unmeasured"] = Field(
        description="datasheet: the vendor's peak; derived: arithmetic on a cited figure; measured: a published "
        "measurement; unmeasured: no citable figure (a host's loopback, measured where it runs)"
    )
    latency_us: float | None = Field(
        None, gt=0, description="a small collective's time on it (a measured floor, not the wire's latency)"
    )
    source: str = Field(min_length=20, description="where each figure comes from, with the sentence that says it")

    @model_validator(mode="after")
    def _a_figure_or_none(self) -> LinkTier:
        if (self.gbytes_per_s is None) != (self.figure == "unmeasured"):
            raise ValueError("gbytes_per_s is given exactly when the figure is not unmeasured")
        return self


class Links(Section):
    """A node's two tiers: between its accelerators, and to other nodes."""

    intra_node: LinkTier
    inter_node: LinkTier


class Platform(Section):
    """One node type: accelerators, the hardware profile of each, network, shared memory and the variable preset."""

    name: str
    description: str
    hardware: str = Field(description="hardware profile of one accelerator (ferry/platform/profiles)")
    accelerators_per_node: int = Field(ge=1, description="processes per node at most; CPU nodes: cores to give ranks")
    accelerator_resource: str | None = Field(
        None, description="Kubernetes resource for one accelerator (nvidia.com/gpu, amd.com/gpu); none on CPU nodes"
    )
    slurm_gres: str | None = Field(None, description="Slurm generic resource of one accelerator, e.g. gpu")
    comm_backend: Literal["gloo", "nccl"]
    cpus_per_node: int = Field(ge=1)
    memory_gib_per_node: float = Field(gt=0)
    shm_gib: float = Field(
        gt=0, description="size of the memory-backed /dev/shm volume (NCCL and data loaders need it)"
    )
    network: Network
    links: Links
    env: list[PresetVariable] = Field(default_factory=list)
    left_to_plugin: list[PluginVariable] = Field(default_factory=list)
    sources: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> Platform:
        names = [variable.name for variable in self.env]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"env sets {', '.join(repeated)} more than once")
        both = sorted(set(names) & {variable.name for variable in self.left_to_plugin})
        if both:
            raise ValueError(f"{', '.join(both)} is both set and left to the plugin")
        if (self.accelerator_resource is None) != (self.slurm_gres is None):
            raise ValueError("accelerator_resource and slurm_gres go together: both for accelerators, neither for CPUs")
        inter = self.links.inter_node
        share = self.network.bandwidth_gbps / 8 / self.accelerators_per_node
        if inter.figure == "derived" and abs(inter.gbytes_per_s - share) > 0.01 * share:
            raise ValueError(
                f"links.inter_node.gbytes_per_s {inter.gbytes_per_s} is derived, so it is the node's "
                f"network.bandwidth_gbps / 8 / accelerators_per_node ({share:.3g})"
            )
        return self


def platform_names() -> list[str]:
    return sorted(path.stem for path in PLATFORM_DIR.glob("*.yaml"))


@cache
def load_platform(name: str) -> Platform:
    """The platform called `name`; an unknown name or a bad file is a `UserError` naming it."""
    path = PLATFORM_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"--platform: unknown platform {name!r}; available: {', '.join(platform_names())}")
    platform = validate(Platform, yaml.safe_load(path.read_text(encoding="utf-8")))
    if platform.name != name:
        raise UserError(f"platform file {path} names itself {platform.name!r}")
    load_profile(platform.hardware)
    return platform

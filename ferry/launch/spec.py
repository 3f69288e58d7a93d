"""What `ferry launch` renders from: the run config, the platform, and the job's shape.

Everything a scheduler file needs is decided here once, so the torchrun scripts, the sbatch script
and the Kubernetes manifests cannot disagree about the number of nodes, processes, the rendezvous
or the restart policy. Bad input is refused here, before any file is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ferry.config import UserError
from ferry.launch.platform import Platform, load_platform
from ferry.train.config import RunConfig, load_run_config

SCHEDULERS = ("torchrun", "slurm", "k8s")
DEFAULT_IMAGE = "ferry:latest"
DEFAULT_RUNS_CLAIM = "ferry-runs"
# the options that only one form reads
FORM_OF_OPTION = {
    "--rendezvous": "torchrun",
    "--master-addr": "torchrun",
    "--image": "k8s",
    "--runs-claim": "k8s",
    "--partition": "slurm",
    "--time": "slurm",
}
Rendezvous = Literal["c10d", "static"]

# What every launched run adds below the user's overrides (which win): a run on a cluster resumes
# from its newest valid checkpoint after any restart, and serves its metrics to the cluster's Prometheus.
CLUSTER_DEFAULTS = (
    "resume=latest",
    "metrics.sinks.prometheus.enabled=true",
    "metrics.sinks.prometheus.host=0.0.0.0",
)


@dataclass(frozen=True)
class LaunchSpec:
    """One job: a config on `nodes` nodes of `platform`, `nproc_per_node` ranks each."""

    config_file: Path
    config: RunConfig
    platform: Platform
    nodes: int
    nproc_per_node: int
    schedulers: tuple[str, ...]
    job_name: str
    rendezvous: Rendezvous = "c10d"
    master_addr: str | None = None
    port: int = 29500
    max_restarts: int = 3
    image: str = DEFAULT_IMAGE
    runs_claim: str = DEFAULT_RUNS_CLAIM
    slurm_partition: str | None = None
    slurm_time: str | None = None
    user_overrides: tuple[str, ...] = ()
    workdir: Path = Path("/")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def metrics_port(self) -> int | None:
        """The Prometheus port rank 0 serves, or None when the run serves none."""
        prometheus = self.config.metrics.sinks.prometheus
        return prometheus.port if prometheus.enabled else None

    def cluster_config(self, run_dir: str) -> RunConfig:
        """The run config as the job on a cluster runs it, its run directory at `run_dir` (a shared volume)."""
        return load_run_config(
            self.config_file, [*platform_defaults(self.platform), f"run.dir={run_dir}", *self.user_overrides]
        )


def platform_defaults(platform: Platform) -> list[str]:
    """The cluster defaults plus what the platform decides: its device and hardware profile (the user's
    overrides still win, and a contradiction is refused by `build_launch_spec`)."""
    device = "cpu" if platform.accelerator_resource is None else "cuda"  # ROCm builds answer to cuda too
    return [*CLUSTER_DEFAULTS, f"run.device={device}", f"hardware={platform.hardware}"]


def build_launch_spec(
    config_file: str,
    overrides: list[str],
    *,
    platform: str,
    nodes: int,
    nproc_per_node: int | None = None,
    scheduler: str | None = None,
    job_name: str | None = None,
    rendezvous: str | None = None,
    master_addr: str | None = None,
    port: int = 29500,
    max_restarts: int = 3,
    image: str | None = None,
    runs_claim: str | None = None,
    slurm_partition: str | None = None,
    slurm_time: str | None = None,
    workdir: str | Path | None = None,
) -> LaunchSpec:
    """Check the job's shape against the platform and the config; every refusal names the option. An option
    left None takes its default; one given for a form that is not rendered is refused, not ignored."""
    chosen = load_platform(platform)
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    nproc = chosen.accelerators_per_node if nproc_per_node is None else nproc_per_node
    if nproc < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {nproc}")
    if nproc > chosen.accelerators_per_node:
        raise UserError(
            f"--nproc-per-node {nproc}: a {chosen.name} node has {chosen.accelerators_per_node} accelerators, "
            "one process drives one"
        )
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise UserError(f"--scheduler {scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
    if rendezvous is not None and rendezvous not in ("c10d", "static"):
        raise UserError(f"--rendezvous {rendezvous!r}: choose c10d or static")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {max_restarts}")
    schedulers = SCHEDULERS if scheduler is None else (scheduler,)
    given = {
        "--rendezvous": rendezvous,
        "--master-addr": master_addr,
        "--image": image,
        "--runs-claim": runs_claim,
        "--partition": slurm_partition,
        "--time": slurm_time,
    }
    for option, value in given.items():
        if value is not None and FORM_OF_OPTION[option] not in schedulers:
            raise UserError(
                f"{option} sets the {FORM_OF_OPTION[option]} form, which --scheduler {scheduler} does not render; "
                "leave it out, or render that form too"
            )
    rendezvous = "c10d" if rendezvous is None else rendezvous
    image = DEFAULT_IMAGE if image is None else image
    runs_claim = DEFAULT_RUNS_CLAIM if runs_claim is None else runs_claim
    if "torchrun" in schedulers and master_addr is None:
        if nodes > 1:
            raise UserError("--master-addr: the torchrun form needs the address of the first node when --nodes > 1")
        master_addr = "127.0.0.1"
    if rendezvous == "static" and max_restarts > 0:
        raise UserError(
            "--rendezvous static cannot re-form the job after torchrun restarts a node's workers; "
            "use --rendezvous c10d, or --max-restarts 0"
        )
    _check_words(
        master_addr=master_addr, image=image, runs_claim=runs_claim, partition=slurm_partition, time=slurm_time
    )
    config = load_run_config(config_file, [*platform_defaults(chosen), *overrides])
    wanted_device = "cpu" if chosen.accelerator_resource is None else "cuda"
    if config.run.device != wanted_device:
        raise UserError(f"run.device {config.run.device!r}: a {chosen.name} node runs on {wanted_device}")
    config.check_world_size(nodes * nproc)
    name = _job_name(job_name or config.run.name)
    if "k8s" in schedulers and config.metrics.sinks.prometheus.enabled and config.metrics.sinks.prometheus.port == 0:
        raise UserError("metrics.sinks.prometheus.port: Kubernetes scrape annotations need a fixed port, not 0")
    return LaunchSpec(
        config_file=Path(config_file),
        config=config,
        platform=chosen,
        nodes=nodes,
        nproc_per_node=nproc,
        schedulers=schedulers,
        job_name=name,
        rendezvous=rendezvous,
        master_addr=master_addr,
        port=port,
        max_restarts=max_restarts,
        image=image,
        runs_claim=runs_claim,
        slurm_partition=slurm_partition,
        slurm_time=slurm_time,
        user_overrides=tuple(overrides),
        workdir=Path(workdir or Path.cwd()).resolve(),
    )


MAX_JOB_NAME = 45  # JobSet names its pods <name>-node-0-<i>-<5 chars>, which must stay a 63-character label


def _job_name(name: str) -> str:
    """A name Kubernetes (a DNS-1035 label once the Trainer's suffixes are added) and Slurm both accept."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", label) or len(label) > MAX_JOB_NAME:
        raise UserError(
            f"--job-name {name!r}: a job name starts with a letter, holds letters, digits and '-', "
            f"and has at most {MAX_JOB_NAME} characters"
        )
    return label


_WORDS = {
    "master_addr": (r"[A-Za-z0-9][A-Za-z0-9.:-]*", "--master-addr"),
    "image": (r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", "--image"),
    "runs_claim": (r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", "--runs-claim"),
    "partition": (r"[A-Za-z0-9_.,-]+", "--partition"),
    "time": (r"(\d+-)?\d+(:\d{1,2}){0,2}", "--time"),
}


def _check_words(**values: str | None) -> None:
    """Free text that lands in a script or a manifest: one plain word of the form each place expects."""
    for key, value in values.items():
        if value is None:
            continue
        pattern, option = _WORDS[key]
        if not re.fullmatch(pattern, value):
            raise UserError(f"{option} {value!r} is not a valid value here")

"""The Kubernetes form: a Kubeflow Trainer v2 `TrainJob` and, for clusters still on the training
operator, a `PyTorchJob`, each with the run config and the Grafana dashboard as ConfigMaps.

Both run the same torchrun command as the other forms. The run config travels in a ConfigMap so the
pods run exactly what was rendered; the run directory is a shared volume (a ReadWriteMany claim) so a
restarted pod finds the checkpoints; `/dev/shm` is memory-backed because the container runtime's
64 MiB default is too small for NCCL and data loaders. Rank 0 serves Prometheus metrics; the pod
annotations let a cluster's Prometheus find them, and the dashboard's ConfigMap carries the label
Grafana's dashboard sidecar looks for.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ferry.launch.spec import LaunchSpec
from ferry.launch.torchrun_form import CONFIG_NAME, LAUNCHER_ENV, ferry_train_argv
from ferry.metrics.dashboard import DASHBOARD_PATH

CONFIG_MOUNT = "/etc/ferry"
RUNS_MOUNT = "/workspace/runs"
TRAINJOB_NAME = "trainjob.yaml"
PYTORCHJOB_NAME = "pytorchjob.yaml"
# The torch runtime of Kubeflow Trainer names its replicated job and its training container `node`;
# the training operator requires the container of a PyTorchJob to be called `pytorch`.
TRAINER_CONTAINER = "node"
OPERATOR_CONTAINER = "pytorch"


def run_dir(spec: LaunchSpec) -> str:
    return f"{RUNS_MOUNT}/{spec.job_name}"


def labels(spec: LaunchSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "ferry", "app.kubernetes.io/instance": spec.job_name}


def config_map(spec: LaunchSpec, run_config_yaml: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{spec.job_name}-config", "labels": labels(spec)},
        "data": {CONFIG_NAME: run_config_yaml},
    }


def dashboard_config_map(spec: LaunchSpec) -> dict[str, Any] | None:
    """The Grafana dashboard, labelled `grafana_dashboard: "1"` for the sidecar of Grafana's Helm chart;
    None in an installation without the checkout's `dashboards/`."""
    if not DASHBOARD_PATH.is_file():
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{spec.job_name}-dashboard",
            "labels": {**labels(spec), "grafana_dashboard": "1"},
        },
        "data": {"ferry.json": json.dumps(json.loads(DASHBOARD_PATH.read_text(encoding="utf-8")), indent=1)},
    }


def scrape_annotations(spec: LaunchSpec) -> dict[str, str]:
    """The `prometheus.io/*` annotations Prometheus's Kubernetes pod discovery is commonly configured to follow."""
    if spec.metrics_port is None:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.metrics_port),
        "prometheus.io/path": "/metrics",
    }


def node_resources(spec: LaunchSpec) -> dict[str, dict[str, Any]]:
    """What one node's pod asks for: its accelerators and the network devices (extended resources go in limits)."""
    platform = spec.platform
    limits: dict[str, Any] = {}
    if platform.accelerator_resource is not None:
        limits[platform.accelerator_resource] = str(spec.nproc_per_node)
    if platform.network.resource is not None:
        limits[platform.network.resource] = str(platform.network.devices)
    if not limits:  # a CPU node: one core per rank at least
        return {"requests": {"cpu": str(spec.nproc_per_node)}}
    return {"limits": limits, "requests": dict(limits)}


def volumes(spec: LaunchSpec) -> list[dict[str, Any]]:
    return [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{spec.platform.shm_gib:g}Gi"}},
        {"name": "config", "configMap": {"name": f"{spec.job_name}-config"}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": spec.runs_claim}},
    ]


def volume_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_MOUNT},
    ]


def env_list(spec: LaunchSpec) -> list[dict[str, str]]:
    launcher = [{"name": name, "value": value} for name, value in LAUNCHER_ENV.items()]
    return launcher + [{"name": variable.name, "value": variable.value} for variable in spec.platform.env]


def train_job(spec: LaunchSpec) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob (API 2.3: `runtimePatches`) on the `torch-distributed` runtime; the
    nodes meet by c10d at the first pod's address, which the runtime sets as PET_MASTER_ADDR/PORT."""
    pod_metadata = {"annotations": scrape_annotations(spec)} if spec.metrics_port is not None else {}
    pod_patch = {
        **({"metadata": pod_metadata} if pod_metadata else {}),
        "spec": {
            "volumes": volumes(spec),
            "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": volume_mounts()}],
        },
    }
    args = [
        "--nnodes",
        str(spec.nodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
        "--rdzv-id",
        spec.job_name,
        "--max-restarts",
        str(spec.max_restarts),
        *ferry_train_argv(f"{CONFIG_MOUNT}/{CONFIG_NAME}"),
    ]
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": ["torchrun"],
        "args": args,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.nproc_per_node,
        "resourcesPerNode": node_resources(spec),
    }
    trainer["env"] = env_list(spec)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": spec.job_name, "labels": labels(spec)},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "ferry",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": TRAINER_CONTAINER, "template": {"spec": {"template": pod_patch}}}
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def pytorch_job(spec: LaunchSpec) -> dict[str, Any]:
    """A training-operator PyTorchJob: a Master and nodes-1 Workers meeting by c10d at the master's service,
    whose MASTER_ADDR and MASTER_PORT the operator sets and Kubernetes substitutes into the arguments."""
    args = [
        "--nnodes",
        str(spec.nodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "$(MASTER_ADDR):$(MASTER_PORT)",
        "--rdzv-id",
        spec.job_name,
        "--max-restarts",
        str(spec.max_restarts),
        *ferry_train_argv(f"{CONFIG_MOUNT}/{CONFIG_NAME}"),
    ]
    container: dict[str, Any] = {
        "name": OPERATOR_CONTAINER,
        "image": spec.image,
        "command": ["torchrun"],
        "args": args,
        "resources": node_resources(spec),
        "volumeMounts": volume_mounts(),
    }
    container["env"] = env_list(spec)
    template: dict[str, Any] = {
        "metadata": {
            "labels": labels(spec),
            **({"annotations": scrape_annotations(spec)} if spec.metrics_port else {}),
        },
        "spec": {"containers": [container], "volumes": volumes(spec)},
    }
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if spec.nodes > 1:
        replicas["Worker"] = {
            "replicas": spec.nodes - 1,
            "restartPolicy": "OnFailure",
            "template": copy.deepcopy(template),
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.job_name, "labels": labels(spec)},
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "runPolicy": {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def manifests(spec: LaunchSpec, run_config_yaml: str) -> dict[str, list[dict[str, Any]]]:
    """The objects of each file: the ConfigMaps first, then the job that mounts them."""
    shared = [config_map(spec, run_config_yaml)]
    dashboard = dashboard_config_map(spec)
    if dashboard is not None:
        shared.append(dashboard)
    return {TRAINJOB_NAME: [*shared, train_job(spec)], PYTORCHJOB_NAME: [*shared, pytorch_job(spec)]}

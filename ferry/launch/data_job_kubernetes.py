"""A Kubernetes Indexed Job that prepares a corpus on many pods: `ferry data prepare ... --tasks N --render DIR
--render-for kubernetes`, the Kubernetes form of the Slurm array (`ferry.launch.data_job`).

Three files: `prepare-job.yaml`, an Indexed Job of N completions whose pod I runs `ferry data prepare --task I
--tasks N` into the partial dataset `<output>.tasks/task-I` with `--workers` processes on as many CPUs (the
index comes from the Job controller's completion-index annotation, through the downward API); `merge-job.yaml`,
one pod running `ferry data merge` of the N partial datasets into `<output>`; and `submit.sh`, which applies
the first, waits for it to complete (stopping if it failed) and applies the second. A failed index is retried
alone (`backoffLimitPerIndex`); a partial dataset already written is kept, so a retried pod redoes only what
is missing. Kubernetes schedules; ferry only writes the manifests.

Every pod mounts one ReadWriteMany claim at the directory the render ran in, and works there: the inputs, the
tokenizer and the output must lie inside that directory, and are passed as the paths they have there.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from ferry.config import UserError
from ferry.launch.data_job import task_directory

PREPARE_JOB_NAME = "prepare-job.yaml"
MERGE_JOB_NAME = "merge-job.yaml"
SUBMIT_NAME = "submit.sh"
DEFAULT_DATA_CLAIM = "ferry-data"
_INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_BACKOFF_PER_INDEX = 3
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?")


def render_kubernetes_data_job(
    prepare_argv: list[str],
    paths: list[str],
    output: str,
    tasks: int,
    workers: int,
    job_name: str,
    image: str,
    claim: str,
) -> dict[str, str]:
    """File name to content. `prepare_argv`: the `ferry data prepare` arguments every task shares (inputs,
    tokenizer, text field, shard size), without --output, --task, --tasks or --workers; `paths`, the files and
    directories among them, and `output` must lie in the working directory, which every pod mounts from the
    claim `claim`."""
    workdir = Path.cwd().resolve()
    name = _job_name(job_name)
    for path in [*paths, output]:
        _inside(Path(path), workdir)
    partials = task_directory(output)
    prepare_args = [
        "data",
        "prepare",
        *prepare_argv,
        "--output",
        f"{partials}/task-$(TASK)",
        "--task",
        "$(TASK)",
        "--tasks",
        str(tasks),
        "--workers",
        str(workers),
    ]
    merge_args = ["data", "merge", *(f"{partials}/task-{task}" for task in range(tasks)), "--output", output]
    prepare = _job(name, "prepare", image, claim, workdir, prepare_args, workers, indexed=tasks)
    merge = _job(f"{name}-merge", "merge", image, claim, workdir, merge_args, 1, indexed=None)
    submit = [
        "#!/bin/bash",
        f"# Apply the Indexed Job of the {tasks} preparing pods, wait until it completed (stop if it failed), then the",
        "# merge.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"kubectl apply -f {PREPARE_JOB_NAME}",
        "while true; do",
        f"  state=$(kubectl get job {name} -o jsonpath='{{.status.conditions[?(@.status==\"True\")].type}}')",
        '  case "$state" in',
        f'    *Failed*) echo "job {name} failed; see kubectl describe job {name}" >&2; exit 1 ;;',
        "    *Complete*) break ;;",
        "  esac",
        "  sleep 10",
        "done",
        f"kubectl apply -f {MERGE_JOB_NAME}",
        "",
    ]
    return {
        PREPARE_JOB_NAME: _yaml(prepare, f"ferry data prepare: {tasks} task(s) of {workers} worker(s), one per index"),
        MERGE_JOB_NAME: _yaml(merge, f"ferry data merge: the {tasks} partial datasets into {output}"),
        SUBMIT_NAME: "\n".join(submit),
    }


def _job(
    name: str,
    container_name: str,
    image: str,
    claim: str,
    workdir: Path,
    args: list[str],
    cpus: int,
    indexed: int | None,
) -> dict[str, Any]:
    """A batch/v1 Job of one container running `ferry *args` in `workdir` (the claim mounted there); an Indexed
    Job of `indexed` completions, each pod's index in the container's `TASK` variable, when given."""
    container: dict[str, Any] = {
        "name": container_name,
        "image": image,
        "command": ["ferry"],
        "args": args,
        "workingDir": str(workdir),
        "resources": {"requests": {"cpu": str(cpus)}},
        "volumeMounts": [{"name": "data", "mountPath": str(workdir)}],
    }
    if indexed is not None:
        container["env"] = [{"name": "TASK", "valueFrom": {"fieldRef": {"fieldPath": _INDEX_ANNOTATION}}}]
    spec: dict[str, Any] = {
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "ferry-data", "ferry/job": name}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [container],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
            },
        },
    }
    if indexed is not None:
        spec = {
            "completionMode": "Indexed",
            "completions": indexed,
            "parallelism": indexed,
            "backoffLimitPerIndex": _BACKOFF_PER_INDEX,
            **spec,
        }
    else:
        spec = {"backoffLimit": _BACKOFF_PER_INDEX, **spec}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}


def _yaml(document: dict, comment: str) -> str:
    return f"# {comment}\n" + yaml.safe_dump(document, sort_keys=False, width=120)


def _job_name(job_name: str) -> str:
    """A Job's name is a DNS label (with room for `-merge` and the pods' suffixes)."""
    name = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")
    if not _DNS_LABEL.fullmatch(name):
        raise UserError(f"--render-for kubernetes: cannot make a Job name from {job_name!r}; name the output simply")
    return name


def _inside(path: Path, workdir: Path) -> None:
    if not path.resolve().is_relative_to(workdir):
        raise UserError(
            f"--render-for kubernetes: {shlex.quote(str(path))} lies outside {workdir}, the directory the pods mount "
            "from the claim; render from a directory holding the inputs, the tokenizer and the output"
        )

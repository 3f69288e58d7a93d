"""The torchrun form: one shell script per node, the same `torchrun` command the other forms wrap.

With c10d rendezvous every node runs the same command and the nodes meet at the first node's
address; with the static form each node also names its rank and the master's address and port.
torchrun's elastic agent restarts every worker of a node after a failure (`--max-restarts`), and
the run resumes from its newest valid checkpoint because the launched config says `resume=latest`.
"""

from __future__ import annotations

import shlex
import textwrap

from ferry.launch.environment import preset
from ferry.launch.spec import LaunchSpec

CONFIG_NAME = "run.yaml"


def ferry_train_argv(config_path: str) -> list[str]:
    """What each worker runs: the launched config, nothing else (every override is inside it)."""
    return ["-m", "ferry", "train", config_path]


def rendezvous_argv(spec: LaunchSpec, node_rank: int) -> list[str]:
    """torchrun's options that place one node in the job."""
    shape = ["--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.nproc_per_node)]
    if spec.rendezvous == "c10d":
        meet = [
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{spec.master_addr}:{spec.port}",
            "--rdzv-id", spec.job_name,
        ]
    else:
        meet = [
            "--node-rank", str(node_rank),
            "--master-addr", str(spec.master_addr),
            "--master-port", str(spec.port),
        ]
    return [*shape, *meet, "--max-restarts", str(spec.max_restarts)]


def torchrun_argv(spec: LaunchSpec, node_rank: int, config_path: str) -> list[str]:
    return ["torchrun", *rendezvous_argv(spec, node_rank), *ferry_train_argv(config_path)]


def export_lines(spec: LaunchSpec) -> list[str]:
    """`export NAME=value` for the platform preset, each under a comment with its source."""
    lines = []
    for variable in spec.platform.env:
        lines.extend(textwrap.wrap(variable.source, 100, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False))
        lines.append(f"export {variable.name}={shlex.quote(preset(spec)[variable.name])}")
    return lines


def torchrun_scripts(spec: LaunchSpec, config_path: str) -> dict[str, str]:
    """`torchrun-node<i>.sh` for every node: run script i on node i (with c10d they are the same command)."""
    scripts = {}
    for node_rank in range(spec.nodes):
        where = (
            f"c10d rendezvous at {spec.master_addr}:{spec.port}"
            if spec.rendezvous == "c10d"
            else f"static rendezvous, master {spec.master_addr}:{spec.port}"
        )
        options = ["torchrun", *rendezvous_argv(spec, node_rank)]
        train = " ".join(shlex.quote(word) for word in ferry_train_argv(config_path))
        lines = [
            "#!/usr/bin/env bash",
            f"# ferry launch: node {node_rank} of {spec.nodes} ({spec.platform.name}, {spec.nproc_per_node} "
            f"process(es) per node), {where}.",
            "set -euo pipefail",
            *export_lines(spec),
            "exec " + " \\\n  ".join([*_grouped(options), train]),
            "",
        ]
        scripts[f"torchrun-node{node_rank}.sh"] = "\n".join(lines)
    return scripts


def _grouped(argv: list[str]) -> list[str]:
    """Quoted words with each option beside its value, one option per line."""
    groups: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word.startswith("-") and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            groups.append(f"{shlex.quote(word)} {shlex.quote(argv[index + 1])}")
            index += 2
            continue
        groups.append(shlex.quote(word))
        index += 1
    return groups

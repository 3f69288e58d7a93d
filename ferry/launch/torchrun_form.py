"""The torchrun form: one shell script per node, the same `torchrun` command the other forms wrap.

With c10d rendezvous every node runs the same command and the nodes meet at the first node's
address; with the static form each node also names its rank and the master's address and port.
torchrun's elastic agent restarts every worker of a node after a failure (`--max-restarts`), and
the run resumes from its newest valid checkpoint because the launched config says `resume=latest`.
"""

from __future__ import annotations

import shlex
import textwrap

from ferry.launch.spec import LaunchSpec

CONFIG_NAME = "run.yaml"

# What every form exports besides the platform preset, with its reason: torch reuses the rendezvous'
# TCP store for the workers of the next attempt after a restart, and the restarted workers then read
# the previous attempt's addresses and fail to meet (pytorch/pytorch#135712; a two-node restart test
# here failed 4 of 4 times without it and passes with it).
LAUNCHER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LAUNCHER_ENV_SOURCE = (
    "https://github.com/pytorch/pytorch/issues/135712: after torchrun restarts the workers they reuse the "
    "rendezvous store and read the previous attempt's addresses; a fresh store per attempt lets them meet again"
)


def ferry_train_argv(config_path: str) -> list[str]:
    """What each worker runs: the launched config, nothing else (every override is inside it)."""
    return ["-m", "ferry", "train", config_path]


def rendezvous_argv(spec: LaunchSpec, node_rank: int) -> list[str]:
    """torchrun's options that place one node in the job."""
    shape = ["--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.nproc_per_node)]
    if spec.rendezvous == "c10d":
        meet = [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{spec.master_addr}:{spec.port}",
            "--rdzv-id",
            spec.job_name,
        ]
    else:
        meet = [
            "--node-rank",
            str(node_rank),
            "--master-addr",
            str(spec.master_addr),
            "--master-port",
            str(spec.port),
        ]
    return [*shape, *meet, "--max-restarts", str(spec.max_restarts)]


def export_lines(spec: LaunchSpec) -> list[str]:
    """`export NAME=value` for the launcher's variable and the platform preset, each under its source."""
    lines = _comment(LAUNCHER_ENV_SOURCE)
    lines += [f"export {name}={value}" for name, value in LAUNCHER_ENV.items()]
    for variable in spec.platform.env:
        lines += _comment(variable.source)
        lines.append(f"export {variable.name}={shlex.quote(variable.value)}")
    return lines


def _comment(text: str) -> list[str]:
    return textwrap.wrap(
        text, 100, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False
    )


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
            f"cd {shlex.quote(str(spec.workdir))}  # where the config's relative paths (data, runs/) point",
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

"""The Slurm form: an sbatch script that starts one torchrun agent per node with `srun`.

The first host of the allocation hosts the c10d rendezvous; `--kill-on-bad-exit` ends the job step
when a node's agent gives up (its restarts spent), so a dead node does not leave the others waiting
out the collective timeout; every node writes its own log.
"""

from __future__ import annotations

import shlex

from ferry.launch.spec import LaunchSpec
from ferry.launch.torchrun_form import export_lines, ferry_train_argv

SBATCH_NAME = "ferry.sbatch"


def sbatch_script(spec: LaunchSpec, config_path: str, log_dir: str) -> str:
    platform = spec.platform
    directives = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--chdir={spec.workdir}",
        f"--output={log_dir}/%x-%j.out",
    ]
    if platform.slurm_gres is not None:
        directives.insert(3, f"--gres={platform.slurm_gres}:{spec.nproc_per_node}")
    if spec.slurm_partition:
        directives.append(f"--partition={spec.slurm_partition}")
    if spec.slurm_time:
        directives.append(f"--time={spec.slurm_time}")
    train = " ".join(shlex.quote(word) for word in ferry_train_argv(config_path))
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {directive}" for directive in directives),
        f"# ferry launch: {spec.nodes} node(s) of {platform.name} x {spec.nproc_per_node} process(es); "
        f"torchrun restarts a node's workers up to {spec.max_restarts} time(s), resuming from the newest checkpoint.",
        "set -euo pipefail",
        *export_lines(spec),
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # srun does not inherit sbatch's CPU count (Slurm >= 22.05): give the one task per node the whole node
        f'srun --kill-on-bad-exit=1 --nodes={spec.nodes} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \\',
        f"  --output={shlex.quote(log_dir)}/%x-%j-node%n.log \\",
        f'  torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {spec.nproc_per_node} \\',
        f'  --rdzv-backend c10d --rdzv-endpoint "$head_node:{spec.port}" --rdzv-id "$SLURM_JOB_ID" \\',
        f"  --max-restarts {spec.max_restarts} \\",
        f"  {train}",
        "",
    ]
    return "\n".join(lines)

"""A Slurm array job that prepares a corpus on many machines: `ferry data prepare ... --tasks N --render DIR`.

Three files: `prepare.sbatch`, an array of N tasks each running `ferry data prepare --task
$SLURM_ARRAY_TASK_ID --tasks N` into a partial dataset `<output>.tasks/task-I` with `--workers`
processes on as many CPUs; `merge.sbatch`, one task running `ferry data merge` into `<output>`; and
`submit.sh`, which submits the array and the merge to start once every array task succeeded
(`--dependency=afterok`). A task that failed is resubmitted alone (`sbatch --array=I prepare.sbatch`);
a partial dataset already written is kept (`partial dataset up to date`), so a resubmitted whole array
redoes only what is missing. Slurm schedules; ferry only writes the scripts.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ferry.config import UserError

PREPARE_NAME = "prepare.sbatch"
MERGE_NAME = "merge.sbatch"
SUBMIT_NAME = "submit.sh"
LOG_DIR = "logs"


def task_directory(output: str) -> str:
    """Where the partial datasets of the tasks preparing `output` go: beside it, never inside."""
    return f"{output.rstrip('/')}.tasks"


def render_data_job(
    prepare_argv: list[str], output: str, tasks: int, workers: int, job_name: str, out: Path
) -> dict[str, str]:
    """File name to content. `prepare_argv`: the `ferry data prepare` arguments every task shares (inputs,
    tokenizer, text field, shard size), without --output, --task, --tasks or --workers."""
    where = out.resolve()
    logs = shlex.quote(str(where / LOG_DIR))
    workdir = shlex.quote(str(Path.cwd().resolve()))
    partials = task_directory(output)
    shared = " ".join(shlex.quote(word) for word in prepare_argv)
    prepare = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --array=0-{tasks - 1}",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={workers}",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={logs}/%x-%A-%a.out",
        f"# ferry data prepare: task $SLURM_ARRAY_TASK_ID of {tasks}, {workers} worker process(es) each; "
        f"`{SUBMIT_NAME}` runs {MERGE_NAME} once all succeeded.",
        "set -euo pipefail",
        f"ferry data prepare {shared} \\",
        f'  --output {shlex.quote(partials)}/task-"$SLURM_ARRAY_TASK_ID" \\',
        f'  --task "$SLURM_ARRAY_TASK_ID" --tasks {tasks} --workers {workers}',
        "",
    ]
    merge = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}-merge",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=1",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={logs}/%x-%j.out",
        f"# ferry data merge: the {tasks} partial datasets into the dataset one process would have written.",
        "set -euo pipefail",
        f"ferry data merge {shlex.quote(partials)}/task-* --output {shlex.quote(output)}",
        "",
    ]
    submit = [
        "#!/bin/bash",
        f"# Submit the {tasks} preparing tasks, and the merge to start once every one of them succeeded.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"array=$(sbatch --parsable {PREPARE_NAME})",
        f'sbatch --dependency=afterok:"$array" {MERGE_NAME}',
        "",
    ]
    return {PREPARE_NAME: "\n".join(prepare), MERGE_NAME: "\n".join(merge), SUBMIT_NAME: "\n".join(submit)}


def write_data_job(files: dict[str, str], out: Path, overwrite: bool = False) -> None:
    """Write the scripts (and the log directory sbatch opens its files in); a script holding something
    else is replaced only with `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--render: {out} is a file, not a directory")
    for name, text in files.items():
        existing = out / name
        if not overwrite and existing.is_file() and existing.read_text(encoding="utf-8") != text:
            raise UserError(f"--render: {existing} exists with other content; pass --overwrite to replace it")
    (out / LOG_DIR).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        staging = out / f".{name}.{os.getpid()}"
        staging.write_text(text, encoding="utf-8")
        staging.chmod(0o755)
        os.replace(staging, out / name)

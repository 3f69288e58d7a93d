"""`ferry launch`: every file of a job from one spec, written together or not at all.

The directory holds the launched run config (`run.yaml`: the user's config with the cluster
defaults and overrides applied, exactly what the ranks load), one torchrun script per node, the
sbatch script and its log directory, and the Kubernetes manifests. An existing file with other
content is not replaced unless asked, so a second render never silently changes a submitted job.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from ferry.config import UserError
from ferry.config.loader import dump_yaml
from ferry.launch.kubernetes import PYTORCHJOB_NAME, TRAINJOB_NAME, manifests, run_dir
from ferry.launch.slurm import SBATCH_NAME, sbatch_script
from ferry.launch.spec import LaunchSpec
from ferry.launch.torchrun_form import CONFIG_NAME, torchrun_scripts

LOG_DIR = "logs"


def render_launch(spec: LaunchSpec, out: Path) -> dict[str, str]:
    """File name (relative to `out`) to content; scripts refer to `out`'s absolute path."""
    where = out.resolve()
    config_path = str(where / CONFIG_NAME)
    files: dict[str, str] = {}
    if "torchrun" in spec.schedulers or "slurm" in spec.schedulers:
        files[CONFIG_NAME] = dump_yaml(spec.config)
    if "torchrun" in spec.schedulers:
        files.update(torchrun_scripts(spec, config_path))
    if "slurm" in spec.schedulers:
        files[SBATCH_NAME] = sbatch_script(spec, config_path, str(where / LOG_DIR))
    if "k8s" in spec.schedulers:
        cluster_yaml = dump_yaml(spec.cluster_config(run_dir(spec)))
        for name, objects in manifests(spec, cluster_yaml).items():
            files[name] = yaml.safe_dump_all(objects, sort_keys=False, width=120)
    return files


def write_launch(spec: LaunchSpec, out: Path, overwrite: bool = False) -> dict[str, str]:
    """Render and write; refuses (naming the file) to replace a file that holds something else, or to leave
    beside the new files one of an earlier render that this one does not write (another form, more nodes)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file, not a directory")
    files = render_launch(spec, out)
    stale = [path for path in _launch_files(out) if path.name not in files]
    if not overwrite:
        if stale:
            raise UserError(
                f"--out: {stale[0]} belongs to an earlier render (another --scheduler or more nodes), which this "
                "one would leave beside its own files; pass --overwrite to remove it, or choose another --out"
            )
        for name, text in files.items():
            existing = out / name
            if existing.is_file() and existing.read_text(encoding="utf-8") != text:
                raise UserError(f"--out: {existing} exists with other content; pass --overwrite to replace it")
    for path in stale:
        path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    if "slurm" in spec.schedulers:
        (out / LOG_DIR).mkdir(exist_ok=True)  # sbatch opens its output files before the script runs
    for name, text in files.items():
        target = out / name
        staging = target.with_name(f".{name}.{os.getpid()}")
        staging.write_text(text, encoding="utf-8")
        if name.endswith((".sh", ".sbatch")):
            staging.chmod(0o755)
        os.replace(staging, target)
    return files


def _launch_files(out: Path) -> list[Path]:
    """The files in `out` that some render writes (a job's logs and anything else are left alone)."""
    if not out.is_dir():
        return []
    named = (CONFIG_NAME, SBATCH_NAME, TRAINJOB_NAME, PYTORCHJOB_NAME)
    return sorted([*(out / name for name in named if (out / name).is_file()), *out.glob("torchrun-node*.sh")])

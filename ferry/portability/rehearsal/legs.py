"""One leg of a rehearsal: a `ferry train` process (or N local ranks) in one environment, timed from launch.

Each leg runs as its own process tree, exactly as a user would start it on that
machine, so that the time to the first step includes everything a real move pays
(interpreter and torch start-up, process group, checkpoint verification and load),
and so that an environment's ranks are its real sharding, not a simulation of it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ferry.config import UserError, dump_yaml
from ferry.metrics.jsonl import read_metrics
from ferry.metrics.progress import WorkProgress
from ferry.portability.comparison.environment import Environment
from ferry.portability.rehearsal.conditions import LoadSampler, MachineLoad, throughput_conditions
from ferry.train.config import RunConfig
from ferry.train.run_dir.record import METRICS_NAME, RUN_RECORD_NAME


@dataclass
class LegResult:
    """How a leg ended, when, and what its run directory recorded."""

    name: str
    environment: str
    run_dir: Path
    log: Path
    returncode: int
    launched_unix: float
    finished_unix: float
    record: dict
    load: MachineLoad | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def wall_s(self) -> float:
        return self.finished_unix - self.launched_unix

    @property
    def first_step_s(self) -> float | None:
        """Seconds from launching the processes to the end of the first step they trained."""
        first = self.record.get("first_step_at_unix")
        return None if first is None else first - self.launched_unix

    def median_tokens_per_s(self) -> float | None:
        """Median throughput over the leg's steps, its first (warm-up) step left out."""
        try:
            records = read_metrics(self.run_dir)
        except UserError:
            return None
        values = [r["tokens_per_s"] for r in records[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
        return statistics.median(values) if values else None

    def conditions(self) -> dict | None:
        """What the leg's throughput was measured under (`conditions.py` beside this); None when unmeasured."""
        return None if self.load is None else throughput_conditions(self.load, self.record)

    def kernels(self) -> dict[str, dict]:
        return self.record.get("kernels", {}).get("ops", {})

    def failure(self) -> str:
        """The last lines the leg printed: where a failing rank names its error."""
        lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines() if self.log.exists() else []
        errors = [line for line in lines if "error" in line.lower()]
        return "\n    ".join((errors or lines)[-6:]) or f"exit code {self.returncode}, nothing printed"


def run_leg(
    name: str,
    environment: Environment,
    config: RunConfig,
    work_dir: Path,
    say: Callable[[str], None],
    steps: int | None = None,
    options: list[str] = (),
) -> LegResult:
    """Train `config` on `environment`'s ranks; its config and log go under `work_dir`.

    Its steps are followed in its metrics: a bar on a terminal, a line at least every 30 s elsewhere.
    A leg that refuses its input (exit code 2: a device that is not here, a checkpoint that
    does not fit) is bad input to the rehearsal and raises `UserError`; other failures are
    returned for the caller to judge.
    """
    config_path = work_dir / "configs" / f"{name}.yaml"
    log = work_dir / "logs" / f"{name}.log"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_yaml(config), encoding="utf-8")
    command = [sys.executable, "-m", "ferry", "train", str(config_path)]
    if environment.nproc > 1:
        command += ["--nproc", str(environment.nproc)]
    command += list(options)
    say(f"ferry: {name} on {environment.name} ({environment.nproc} rank(s)): log {log}")
    launched = time.time()
    with log.open("w", encoding="utf-8") as output, LoadSampler() as sampler:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        returncode = _follow(process, name, config.run.path / METRICS_NAME, steps, say)
    finished = time.time()
    result = LegResult(
        name,
        environment.name,
        config.run.path,
        log,
        returncode,
        launched,
        finished,
        _run_record(config.run.path),
        load=sampler.measured,
    )
    if returncode == 2:
        raise UserError(f"the {name} leg on environment {environment.label} refused its input:\n    {result.failure()}")
    state = "done" if result.ok else f"FAILED (exit code {returncode})"
    say(f"ferry: {name} {state} in {result.wall_s:.1f} s")
    return result


def _follow(process: subprocess.Popen, name: str, metrics: Path, steps: int | None, say: Callable[[str], None]) -> int:
    """Wait for the leg, following its steps as they land in its metrics file: a bar on a terminal, a line at
    least every 30 s elsewhere (a leg of minutes must not leave the parent's log silent)."""
    with WorkProgress(f"{name} leg", steps, say=say, unit="steps") as progress:
        while process.poll() is None:
            progress.update(_lines(metrics))
            time.sleep(0.5)
    return process.returncode


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as handle:
            return sum(1 for _ in handle)
    except OSError:
        return 0


def _run_record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / RUN_RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}

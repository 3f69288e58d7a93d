"""A real one-node Slurm cluster for the suite: Debian's `slurm-wlm` and `munge` (which `.ci/run` installs), started
as root without systemd in a temporary directory (munged, slurmctld, slurmd, each in the foreground as a child of
the test process) and stopped by their pids. Where the binaries are absent or the suite does not run as root, the
tests that need it skip, saying why, except in CI (`CI=true`), where that fails them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ferry.comm.spawn import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "sinfo", "squeue")


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


class SlurmCluster:
    """One node (this host, its cores) in one partition; `env` is what a client command needs to reach it."""

    def __init__(self, root: Path):
        for name in (*DAEMONS, *COMMANDS):
            if shutil.which(name) is None:
                _missing(f"{name} is not installed (Debian's slurm-wlm and munge; .ci/run installs them as root)")
        if os.geteuid() != 0:
            _missing("a Slurm cluster of the suite's own needs root (its daemons run as the user that starts them)")
        self.root = root
        self.processes: list[subprocess.Popen] = []
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = root / "munge.sock"
        self._start(
            "munged",
            "--foreground",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={root / 'munged.pid'}",
            f"--log-file={root / 'munged.log'}",
            f"--seed-file={root / 'munge.seed'}",
        )
        self._wait(socket_path.exists, "munged's socket")
        host = socket.gethostname()
        for directory in ("state", "spool"):
            (root / directory).mkdir()
        self.conf = root / "slurm.conf"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=ferry",
                    f"SlurmctldHost={host}",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={socket_path}",
                    "CredType=cred/munge",
                    "ProctrackType=proctrack/linuxproc",  # no cgroups: no systemd here
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'slurmd.log'}",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start("slurmctld", "-D", "-f", str(self.conf))
        self._start("slurmd", "-D", "-f", str(self.conf))
        self._wait(self._idle, "the Slurm node to be idle")

    def _start(self, name: str, *args: str) -> None:
        log = (self.root / f"{name}.out").open("w")
        env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.processes.append(subprocess.Popen([name, *args], stdout=log, stderr=subprocess.STDOUT, env=env))

    def _idle(self) -> bool:
        for process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[0]} exited with {process.returncode}; see {self.root}")
        state = subprocess.run(["sinfo", "--noheader", "-o", "%t"], capture_output=True, text=True, env=self.env)
        return state.returncode == 0 and state.stdout.strip() == "idle"

    def _wait(self, condition, what: str, deadline_s: float = 60.0) -> None:
        """Poll until `condition()` (a guard against a hang, not a measurement)."""
        waited = 0.0
        while not condition():
            if waited > deadline_s:
                raise TimeoutError(f"{what} did not happen within {deadline_s:.0f} s; see {self.root}")
            time.sleep(0.1)
            waited += 0.1

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A client command (`sbatch`, `scontrol`, ...) against this cluster."""
        done = subprocess.run(list(command), capture_output=True, text=True, env=self.env)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(command)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

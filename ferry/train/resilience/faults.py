"""Fault injection: the failures a large run meets, made to happen on purpose, once, where asked.

`fault.inject` lists faults as `{step, rank, kind}`:

    kill              SIGKILL at the start of the step: the process is gone, it reports nothing
    hang              the rank stops making progress at the start of the step (the watchdog finds it)
    raise             an exception at the start of the step
    nan               the step's gradients are poisoned with NaN after the backward
    corrupt_checkpoint  the checkpoint of the step is damaged after it is written (a flipped byte)
    kill_during_save  SIGKILL while the checkpoint of the step is half written (with asynchronous saves, from
                      the rank's writer thread, while training goes on)
    disk_full_during_save, permission_denied_during_save, io_error_during_save
                      the storage refuses the rank's write of the checkpoint of the step once its tensor files
                      are written (ENOSPC, EACCES, EIO), as ferry's write layer would meet it

A fault fires once per run directory (a marker is written, and synced, before it fires), so a
restarted run does not trip it again; `once: false` makes it fire at every attempt, as a
deterministic bug would. The markers also say when each fault fired (`fired_faults`): a drill reads
them to tell what each fault led to.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ferry.config import UserError
from ferry.train.resilience.config import FaultSpec
from ferry.train.run_dir.record import FAULTS_DIR

MARKERS_DIR = Path(FAULTS_DIR) / "fired"
# What each storage fault makes the write of a rank's checkpoint files raise
STORAGE_ERRORS = {
    "disk_full_during_save": errno.ENOSPC,
    "permission_denied_during_save": errno.EACCES,
    "io_error_during_save": errno.EIO,
}
STORAGE_FAULTS = tuple(STORAGE_ERRORS)


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


class FaultInjector:
    """The faults of one rank, fired at the hooks the trainer calls."""

    def __init__(
        self,
        specs: list[FaultSpec],
        rank: int,
        world_size: int,
        run_dir: Path,
        local: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
    ):
        """`local(tensor)`: this rank's part of a gradient as a plain tensor, as the run's layout holds it (FSDP's
        shard; the tensor itself elsewhere)."""
        for index, spec in enumerate(specs):
            if spec.rank >= world_size:
                raise UserError(
                    f"fault.inject.{index}.rank: {spec.rank} is not a rank of this job of {world_size} rank(s)"
                )
        self.run_dir = run_dir
        self.rank = rank
        self.specs = list(specs)
        self.mine = [(index, spec) for index, spec in enumerate(specs) if spec.rank == rank]
        self._local = local

    def at_step_start(self, step: int, on_hang: Callable[[], None]) -> None:
        """`kill`, `hang` and `raise` faults of `step` (the step about to be trained); the first one due fires,
        and only it is marked, so a second fault at the same step fires on the restart."""
        for index, spec in self._due(step, ("kill", "hang", "raise"), mark=False)[:1]:
            self._mark(index, spec)
            if spec.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.kind == "hang":
                on_hang()
                while True:
                    time.sleep(3600)
            raise InjectedFault(f"injected fault {index} ({spec.kind}) at step {step} on rank {self.rank}")

    def poison_gradients(self, step: int, model: torch.nn.Module) -> None:
        """A `nan` fault: one gradient of this rank becomes NaN, as a bad input or a flaky device makes it."""
        for _ in self._due(step, ("nan",)):
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local = self._local(grad)  # this rank's part: no collective
            with torch.no_grad():
                local.view(-1)[0] = float("nan")

    def during_save(self, step: int) -> Callable[[Path], None] | None:
        """A `kill_during_save` or storage fault: the hook a save calls with its staging directory once this rank's
        files are written (the first due of the step fires)."""
        due = self._due(step, ("kill_during_save", *STORAGE_FAULTS), mark=False)[:1]
        if not due:
            return None
        index, spec = due[0]

        def strike(staging: Path) -> None:
            self._mark(index, spec)
            if spec.kind == "kill_during_save":
                os.kill(os.getpid(), signal.SIGKILL)
            code = STORAGE_ERRORS[spec.kind]
            raise OSError(code, os.strerror(code), str(staging / "manifest.json"))

        return strike

    def save_fault_step(self, kind: str, step: int, last_save_step: int, fixed_interval: bool) -> int | None:
        """The step of the fault of `kind` a save at `step` fires: with a fixed interval, one of this very step;
        otherwise (Daly's interval puts the saves where it will) the earliest still due at or before this step: a
        fault fired once per run not yet fired, or one fired at every attempt not yet fired at a save of this
        attempt (after `last_save_step`). One per save and kind (two corruptions of one file would undo each
        other)."""
        if fixed_interval:
            return step
        due = [
            spec.step
            for index, spec in self.mine
            if spec.kind == kind
            and spec.step <= step
            and (not self._fired(index) if spec.once else spec.step > last_save_step)
        ]
        return min(due) if due else None

    def pending(self, kinds: tuple[str, ...]) -> list[tuple[int, FaultSpec]]:
        """The job's faults of `kinds` (every rank's) still to fire."""
        return [(index, spec) for index, spec in enumerate(self.specs) if spec.kind in kinds and not self.spent(index)]

    def wants_after_save(self, step: int) -> bool:
        return bool(self._due(step, ("corrupt_checkpoint",), mark=False))

    def after_save(self, step: int, checkpoint: Path) -> None:
        """A `corrupt_checkpoint` fault: flip one byte inside a tensor file of the checkpoint just written."""
        for _ in self._due(step, ("corrupt_checkpoint",)):
            victim = sorted(checkpoint.glob("model-*.safetensors"))[0]
            with victim.open("r+b") as handle:
                handle.seek(victim.stat().st_size - 1)
                byte = handle.read(1)
                handle.seek(victim.stat().st_size - 1)
                handle.write(bytes([byte[0] ^ 0xFF]))

    def _due(self, step: int, kinds: tuple[str, ...], mark: bool = True) -> list[tuple[int, FaultSpec]]:
        due = [
            (index, spec)
            for index, spec in self.mine
            if spec.step == step and spec.kind in kinds and not (spec.once and self._fired(index))
        ]
        if mark:
            for index, spec in due:
                self._mark(index, spec)
        return due

    def spent(self, index: int) -> bool:
        """Whether fault `index` fires once per run directory and already has."""
        return self.specs[index].once and self._fired(index)

    def _fired(self, index: int) -> bool:
        return (self.run_dir / MARKERS_DIR / f"fault-{index}").exists()

    def _mark(self, index: int, spec: FaultSpec) -> None:
        """Written and synced before the fault fires: a restarted run sees it even after a SIGKILL."""
        if not spec.once:
            return
        folder = self.run_dir / MARKERS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f"fault-{index}"
        with marker.open("w") as handle:
            handle.write(json.dumps({"kind": spec.kind, "step": spec.step, "rank": spec.rank, "at_unix": time.time()}))
            handle.flush()
            os.fsync(handle.fileno())


def fired_faults(run_dir: Path) -> dict[int, float]:
    """When each fault of the run that fires once has fired, by its index in `fault.inject` (unix seconds).

    A marker that holds no time (an older ferry wrote text) gives its modification time: it was written
    just before the fault fired, either way."""
    folder = run_dir / MARKERS_DIR
    fired = {}
    for marker in folder.glob("fault-*") if folder.is_dir() else ():
        index = int(marker.name.removeprefix("fault-"))
        try:
            fired[index] = float(json.loads(marker.read_text(encoding="utf-8"))["at_unix"])
        except (ValueError, KeyError, TypeError):
            fired[index] = marker.stat().st_mtime
    return fired

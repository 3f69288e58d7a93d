"""What a training run does to survive failures: a hook at the loop's named points, and the calls the run's
opening and its checkpoint and evaluation hooks make.

It composes the hang watchdog, the fault injector and the record of restarts and goodput, so the training
loop stays a training loop:

    begin(...)                  after the resume: the job's events (a fresh start, or a restart)
    before_step(step)           injected faults that strike as a step begins
    after_backward(...)         injected NaN gradients
    after_step(step, record)    the watchdog's heartbeat, goodput in the record
    on_error(exc)               what this rank says as it goes, for whoever restarts the job
    finish()                    restarts and goodput into run.json
    at_close(end)               the watchdog stops

The checkpoints are their own hook's (`ferry.train.checkpoint_hook`); it and the evaluation hook are offered
the watchdog (`watchdog`: phase and clock) and the checkpoint hook the save-time faults (`injector`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ferry.comm.reductions import largest_over_world
from ferry.platform.process import Stopped
from ferry.train.hook_points import Hook, RunEnd
from ferry.train.resilience.config import FaultConfig
from ferry.train.resilience.faults import FaultInjector
from ferry.train.resilience.restarts import (
    append_event,
    collect_causes,
    goodput,
    job_events,
    last_metrics_step,
    read_events,
    restart_is_pending,
    restarts,
    write_cause,
)
from ferry.train.resilience.watchdog import Watchdog
from ferry.train.run_dir.record import METRICS_NAME, RunRecord

Say = Callable[[str], None]


class ResilientRun(Protocol):
    """What resilience reads of a run config (`ferry.train.config.RunConfig`, which composes resilience's settings
    and so is not imported here): where the run lives, and its fault settings."""

    run: Any
    fault: FaultConfig


Agree = Callable[[list[float]], list[float]]  # each value's maximum over the ranks, on every rank

_agreed: dict = {}  # the process group and environment the restart counts were agreed for, and the counts


def torchrun_restart_counts(agree: Agree | None = None) -> list[int]:
    """The restart count of every node's torchrun agent, the same list on every rank; empty when no torchrun
    agent started this process.

    An agent counts only the restarts it decides: when a worker on node 1 fails, node 1's agent raises
    TORCHELASTIC_RESTART_COUNT, while node 0's agent restarts its own workers (a peer waits in the
    rendezvous) and does not. So each rank puts its node's count at its node's place (GROUP_RANK of
    GROUP_WORLD_SIZE) and one all-reduce (maximum; `agree`, else over the default process group) gives
    every rank all of them. Called on every rank; the agreement is kept, so the collective runs once per
    process group however often this is asked. Every torchrun worker has the variable and no other
    process does, so the ranks of a job all take part in the collective, or none does.
    """
    local = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if local is None:
        return []
    nodes = max(int(os.environ.get("GROUP_WORLD_SIZE", "1")), 1)
    node = min(max(int(os.environ.get("GROUP_RANK", "0")), 0), nodes - 1)
    counts = [0.0] * nodes
    counts[node] = float(int(local))
    if not (dist.is_available() and dist.is_initialized()):
        return [int(count) for count in counts]
    group, key = dist.group.WORLD, (local, node, nodes)
    if _agreed.get("group") is group and _agreed.get("key") == key:
        return list(_agreed["counts"])
    agreed = [int(round(count)) for count in (agree or largest_over_world)(counts)]
    _agreed.update(group=group, key=key, counts=agreed)
    return list(agreed)


def restarted_by_torchrun(agree: Agree | None = None) -> bool:
    """Whether torchrun's elastic agents restarted the job: any node's agent counted a restart (a collective
    in a multi-rank job: call it on every rank, see `torchrun_restart_counts`)."""
    return any(count > 0 for count in torchrun_restart_counts(agree))


class Resilience(Hook):
    """Failure handling of one rank of one run."""

    def __init__(
        self,
        config: ResilientRun,
        rank: int,
        world_size: int,
        started_unix: float,
        agree: Agree = largest_over_world,
        local: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
    ):
        """`agree(values)`: each value's maximum over the ranks, on every rank (a run passes its
        `RankReductions.largest`, which reduces on the run's device); `local(tensor)`: this rank's part of a gradient
        as its layout holds it (the plan's), for the faults that poison one."""
        self.config = config
        self.rank = rank
        self.is_main = rank == 0
        self.world_size = world_size
        self.started_unix = started_unix
        self.run_dir = config.run.path
        self.step = 0
        self.injector = FaultInjector(config.fault.inject, rank, world_size, self.run_dir, local)
        self.watchdog = Watchdog(config.fault, rank, self._hung)
        self.job_mtbf_s = config.fault.mtbf_hours_per_device * 3600.0 / world_size
        self._record: RunRecord | None = None
        self._restarting = False
        self._first_step_done = False
        self._lost: dict = {}
        self._productive = 0.0
        self._job_start_unix = started_unix
        self._say: Say = print
        self.agree = agree

    def watch_loading(self) -> None:
        """Before the run restores anything: the watchdog watches the load too (verifying and restoring a
        checkpoint, the collectives of a shared verification, a reference model's scoring), in a phase that
        gets the checkpoint allowance on top of the first step's; `touch` it while long work progresses."""
        self.watchdog.phase("checkpoint load")
        self.watchdog.start(0)

    def begin(self, resumed_step: int | None, resume_info: dict, record: RunRecord | None, say: Say) -> None:
        """Note where this attempt starts: a new job (fresh, or resumed by hand) or the restart of one."""
        self._say = say
        self.step = resumed_step or 0
        self._record = record
        if self.is_main:
            events = read_events(self.run_dir)
            self._restarting = restart_is_pending(events)
            if self._restarting:
                # the restart has restored the job: where from and at what cost, even if this attempt fails
                # again before its first step
                append_event(
                    self.run_dir, {"event": "restored", "at_unix": time.time(), "step": self.step, **resume_info}
                )
            else:
                loading = (resume_info.get("verify_s") or 0.0) + (resume_info.get("restore_s") or 0.0)
                append_event(
                    self.run_dir,
                    {"event": "start", "at_unix": self.started_unix, "step": self.step, "loading_s": loading},
                )
            starts = [event for event in read_events(self.run_dir) if event["event"] == "start"]
            self._job_start_unix = starts[-1]["at_unix"] if starts else self.started_unix
            self._productive = sum(record.get("step_s") or 0.0 for record in self._kept_records())
            so_far = goodput(read_events(self.run_dir), [], time.time())
            self._lost = {key: so_far[key] for key in ("lost_steps", "loading_s", "restarting_s")}
        self.watchdog.phase("start-up")
        self.watchdog.start(self.step)

    def note_agent_restart(self, counts: list[int] | None = None) -> None:
        """Under torchrun, no ferry supervisor recorded the failure: rank 0 does, once per restart torchrun's
        agents count, before the run's records are cut back to the checkpoint it resumes from (they still say
        how far the failed attempt got). The count is agreed over the ranks first (every rank calls this):
        the failed rank may have lived on another node, whose agent alone counted the restart. torchrun does
        not say how the ranks ended; what they reported does, and the ranks that reported nothing are named.

        Otherwise (a fresh start, a run resumed by hand, an attempt of ferry's supervisor, which collects
        causes itself) any cause file left in the run directory belongs to no recorded failure: it is
        dropped, so that the next failure is not blamed on it. No rank of this attempt has written one yet:
        causes are written from the training loop and the watchdog, which start after the barrier that
        follows this call. `counts`: every node agent's restart count, as the run's start agreed them over the ranks
        (`ferry.train.assembly.decide_start`); agreed here when not given (the agreement is kept: one collective)."""
        counts = torchrun_restart_counts(self.agree) if counts is None else counts
        if not self.is_main:
            return
        total = sum(counts)  # one more for each restart (more when several nodes saw the same failure)
        recorded = [e for e in job_events(read_events(self.run_dir)) if e.get("by") == "torchrun"]
        if total == 0 or (recorded and recorded[-1].get("restart_count", 0) >= total):
            collect_causes(self.run_dir)
            return
        metrics = self.run_dir / METRICS_NAME
        last_written = metrics.stat().st_mtime if metrics.exists() else time.time()
        event = self.failure_event("torchrun", {}, time.time(), fallback_at=last_written)
        silent = sorted(set(range(self.world_size)) - {cause["rank"] for cause in event["causes"]})
        append_event(self.run_dir, {**event, "silent_ranks": silent, "restart_count": total, "restart_counts": counts})

    def failure_event(self, by: str, exit_codes: dict, detected_unix: float, fallback_at: float) -> dict:
        """The event that says the job failed: what the ranks said, how far it got, when (the first report,
        else `fallback_at`)."""
        causes = collect_causes(self.run_dir)
        at = min(cause["at_unix"] for cause in causes) if causes else fallback_at
        return {
            "event": "failure",
            "by": by,
            "at_unix": at,
            "detected_unix": detected_unix,
            "failed_at_step": last_metrics_step(self.run_dir),
            "causes": causes,
            "exit_codes": exit_codes,
        }

    def before_step(self, step: int) -> None:
        self.step = step - 1
        self.watchdog.phase("data")
        self.injector.at_step_start(step, on_hang=lambda: self.watchdog.phase("a hang (injected fault)"))

    def phase(self, name: str) -> None:
        self.watchdog.phase(name)

    def after_backward(self, step: int, model) -> None:
        self.injector.poison_gradients(step, model)

    def after_step(self, step: int, record: dict) -> None:
        """The heartbeat; goodput in the step's record."""
        self.step = record["step"]
        self.watchdog.beat(record["step"], record["step_s"])
        if self.is_main:
            self._productive += record["step_s"]
            record["goodput"] = self._productive / max(time.time() - self._job_start_unix, 1e-9)
            record.update(self._lost)  # what the job's failures and loads have cost so far (fixed in an attempt)
            if not self._first_step_done and self._restarting:
                # back at work when the first step began: its own time is productive, not restarting
                began = time.time() - record["step_s"]
                append_event(self.run_dir, {"event": "resumed", "at_unix": began, "step": record["step"] - 1})
            if not self._first_step_done and self._record is not None:
                self._record.update(first_step_at_unix=time.time())
        else:
            record.update(goodput=None, lost_steps=None, loading_s=None, restarting_s=None)
        self._first_step_done = True

    def on_error(self, exc: BaseException, last: dict) -> None:
        """Leave this rank's account of the failure in the run directory."""
        if isinstance(exc, (KeyboardInterrupt, Stopped)):  # stopped from outside: nothing of this rank's to tell
            return
        write_cause(self.run_dir, self.rank, self.step + 1, self.watchdog.current_phase, f"{type(exc).__name__}: {exc}")

    def at_close(self, end: RunEnd | None) -> None:
        self.watchdog.stop()

    def finish(self) -> dict:
        """Restarts and goodput of the job so far, for run.json."""
        self.watchdog.stop()
        if not self.is_main:
            return {}
        events = read_events(self.run_dir)
        return {"restarts": restarts(events), "goodput": goodput(events, self._all_records(), time.time())}

    def _hung(self, phase: str, message: str, waiting: str | None) -> None:
        write_cause(self.run_dir, self.rank, self.step + 1, phase, f"hang: {message}", waiting_in=waiting)

    def _all_records(self) -> list[dict]:
        from ferry.metrics.jsonl import read_metrics

        path = self.run_dir / METRICS_NAME
        return read_metrics(path) if path.exists() and path.stat().st_size else []

    def _kept_records(self) -> list[dict]:
        starts = [event for event in read_events(self.run_dir) if event["event"] == "start"]
        first = starts[-1]["step"] if starts else 0
        return [record for record in self._all_records() if record["step"] > first]

"""The record of a job's failures and restarts, and its goodput.

Everything lives in the run directory, so that it survives the processes it describes:

    restarts.jsonl         events, appended: `start` (a job begins: a fresh run, or one resumed by
                           hand), `failure` (written by whoever restarts the job: ferry's supervisor,
                           or rank 0 of a run restarted by torchrun), `restored` (rank 0, as a
                           restarted attempt begins to train: the step it resumed from, what
                           verifying and restoring cost), `resumed` (rank 0, once the restarted
                           job has trained its first step again)
    .faults/causes/*.json  what a failing rank said before it went (an exception, a hang); a rank
                           killed outright says nothing, and its exit signal speaks for it

`run.json` lists each restart (time, cause, the step it failed at and the step it resumed from,
steps lost, restart latency) and the job's goodput: productive step time over wall time, with
what the rest went to (saving, loading, restarting, lost steps). When a supervisor gives up, it
settles `run.json` itself (`settle_run_record`): the last attempt could not know of its own failure.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ferry.train.run_dir.record import EVENTS_NAME, FAULTS_DIR, RunRecord

CAUSES_DIR = Path(FAULTS_DIR) / "causes"


def append_event(run_dir: Path, event: dict) -> None:
    path = run_dir / EVENTS_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(event, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / EVENTS_NAME
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash: the events around it still stand
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def write_cause(run_dir: Path, rank: int, step: int, phase: str, error: str, waiting_in: str | None = None) -> None:
    """What this rank reports as it fails: read by whoever restarts the job. `waiting_in`: the collective a
    hung rank was waiting in for its peers (it is a consequence of whichever peer did not come)."""
    folder = run_dir / CAUSES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    cause = {"rank": rank, "step": step, "phase": phase, "error": error, "at_unix": time.time()}
    if waiting_in is not None:
        cause["waiting_in"] = waiting_in
    staging = folder / f".rank-{rank:05d}-{os.getpid()}.json"
    staging.write_text(json.dumps(cause), encoding="utf-8")
    os.replace(staging, folder / f"rank-{rank:05d}-{os.getpid()}.json")


def collect_causes(run_dir: Path) -> list[dict]:
    """The causes the ranks of a failed attempt left, oldest first (those waiting in a collective last); taken
    (deleted) so the next failure has its own."""
    folder = run_dir / CAUSES_DIR
    causes = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else ():
        try:
            causes.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass
        path.unlink(missing_ok=True)
    # ranks that waited in a collective for a peer follow the others: the peer that never came is the cause
    return sorted(causes, key=lambda cause: (cause.get("waiting_in") is not None, cause.get("at_unix", 0.0)))


def last_metrics_step(run_dir: Path, metrics_name: str = "metrics.jsonl") -> int:
    """The last step the run recorded (0 when none): how far an attempt got."""
    path = run_dir / metrics_name
    if not path.exists():
        return 0
    last = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last


def restart_is_pending(events: list[dict]) -> bool:
    """Whether the job is being restarted: a failure was recorded and no attempt restored the job since."""
    for event in reversed(events):
        if event["event"] in ("restored", "resumed", "start"):
            return False
        if event["event"] == "failure":
            return True
    return False


def job_events(events: list[dict]) -> list[dict]:
    """The events of the current job: from its last `start` on."""
    starts = [index for index, event in enumerate(events) if event["event"] == "start"]
    return events[starts[-1] :] if starts else events


def _restored_after(job: list[dict], index: int) -> dict | None:
    """The attempt that followed the failure at `index`, if it got as far as restoring the job: its
    `restored` event (in logs written before that event existed, its `resumed` event), up to the next failure."""
    following = []
    for event in job[index + 1 :]:
        if event["event"] in ("failure", "start"):
            break
        following.append(event)
    return next((e for e in following if e["event"] == "restored"), None) or next(
        (e for e in following if e["event"] == "resumed"), None
    )


def restarts(events: list[dict]) -> list[dict]:
    """Each failure of the job paired with the attempt that followed it, if that attempt restored the job
    (even when it failed again before its first step); None where no attempt did."""
    rows = []
    job = job_events(events)
    for index, event in enumerate(job):
        if event["event"] != "failure":
            continue
        restored = _restored_after(job, index)
        row = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(event["at_unix"])),
            "cause": describe_causes(event),
            "failed_at_step": event["failed_at_step"],
            "resumed_from_step": None if restored is None else restored["step"],
            "steps_lost": None if restored is None else max(event["failed_at_step"] - restored["step"], 0),
            "restart_latency_s": None if restored is None else max(restored["at_unix"] - event["at_unix"], 0.0),
            "skipped_checkpoints": [] if restored is None else restored.get("skipped", []),
            "removed_unfinished_saves": [] if restored is None else restored.get("removed_unfinished_saves", []),
            "by": event.get("by"),
        }
        rows.append(row)
    return rows


def restarts_after(events: list[dict], at_unix: float) -> list[dict]:
    """The rows of `restarts` whose failure was detected at or after `at_unix`, in order: what followed
    something that happened then (a fault that fired: the first row is the failure it caused, if any)."""
    failures = [event for event in job_events(events) if event["event"] == "failure"]
    return [
        row for event, row in zip(failures, restarts(events)) if event.get("detected_unix", event["at_unix"]) >= at_unix
    ]


def describe_causes(event: dict) -> str:
    """One line: how the ranks of the failed attempt ended, the likely first failure first.

    A rank killed outright (SIGKILL; the launcher itself stops ranks with SIGTERM) says nothing
    and is taken as the first to go: the errors its peers then raise (a connection reset in a
    collective) are consequences, listed after it in the order they were reported. Under torchrun
    no exit codes are known: the ranks that left no report (`silent_ranks`) are named first instead.
    """
    reporting = {cause["rank"] for cause in event.get("causes", [])}
    silent = [rank for rank in event.get("silent_ranks", []) if rank not in reporting]
    killed = [_silent_line(silent)] if silent else []
    other = []
    for rank, code in sorted(event.get("exit_codes", {}).items(), key=lambda item: int(item[0])):
        if int(rank) in reporting:
            continue
        if code == -9:
            killed.append(f"rank {rank} was killed (SIGKILL)")
        elif code < 0:
            other.append(f"rank {rank} was stopped by signal {-code}")
        else:
            other.append(f"rank {rank} exited with code {code}")
    said = [
        f"rank {cause['rank']} at step {cause['step']} ({cause['phase']}): {_shorten(cause['error'])}"
        for cause in event.get("causes", [])
    ]
    parts = killed + said + [line for line in other if "stopped by signal" not in line or not (killed or said)]
    return "; then ".join(parts) if parts else "no rank reported a cause"


def _silent_line(ranks: list[int]) -> str:
    names = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(rank) for rank in ranks)
    return f"{names} left no report (killed outright, or stopped by the launcher)"


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def goodput(events: list[dict], records: list[dict], now: float) -> dict:
    """Productive step time over the job's wall time, and where the rest went.

    Productive: the step times of the steps the run kept (a step lost to a failure and trained
    again counts once). Saving: what training waited for checkpoints. Loading: verifying and
    restoring checkpoints at the job's start and at each restart (also of an attempt that failed
    again before its first step). Restarting: from each failure until a restarted attempt had
    restored the job and began to train (which includes its loading), or until the next failure.
    """
    job = job_events(events)
    start = job[0] if job and job[0]["event"] == "start" else None
    begin = start["at_unix"] if start else now
    first_step = start["step"] if start else 0
    kept = [record for record in records if record.get("step", 0) > first_step]
    productive = sum(record.get("step_s") or 0.0 for record in kept)
    rows = restarts(events)
    restorations = [_restored_after(job, index) for index, event in enumerate(job) if event["event"] == "failure"]
    wall = max(now - begin, 1e-9)
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall,
        # a failure some attempt followed: the last one of a job its supervisor gave up on was not restarted
        "restarts": sum(1 for index, event in enumerate(job) if event["event"] == "failure" and index + 1 < len(job)),
        "lost_steps": sum(row["steps_lost"] or 0 for row in rows),
        "saving_s": sum(record.get("checkpoint.blocked_s") or 0.0 for record in kept),
        "loading_s": sum(
            (event.get("verify_s") or 0.0) + (event.get("restore_s") or 0.0) for event in restorations if event
        )
        + (start.get("loading_s") or 0.0 if start else 0.0),
        "restarting_s": _restarting_s(job),
    }


def _restarting_s(job: list[dict]) -> float:
    """Time from each failure to the restoration that followed it, or to the next failure when the attempt
    between them restored nothing: failures that follow one another are not counted twice."""
    total = 0.0
    for index, event in enumerate(job):
        if event["event"] != "failure":
            continue
        following = next((e for e in job[index + 1 :] if e["event"] in ("failure", "restored", "resumed")), None)
        if following is not None:
            total += max(following["at_unix"] - event["at_unix"], 0.0)
    return total


def read_step_records(run_dir: Path, metrics_name: str = "metrics.jsonl") -> list[dict]:
    """The step records of the run, tolerating a line torn by a crash (the failed attempt may have left one)."""
    path = run_dir / metrics_name
    records = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def settle_run_record(run_dir: Path, reason: str, now: float | None = None) -> dict:
    """A supervisor that gives up has the last word in `run.json`: its last attempt wrote it before the
    failure that ends the job was recorded (or never finished it, when it was killed), so every restart,
    the goodput, status `failed`, the reason for giving up and the last failure's cause are written here."""
    now = time.time() if now is None else now
    events = read_events(run_dir)
    rows = restarts(events)
    failures = [event for event in job_events(events) if event["event"] == "failure"]
    record = RunRecord.reopen(run_dir)
    fields = {
        "restarts": rows,
        "goodput": goodput(events, read_step_records(run_dir), now),
        "gave_up": reason,
    }
    if record.content.get("status") != "failed" or not record.content.get("error"):
        fields["error"] = describe_causes(failures[-1]) if failures else reason  # killed: no rank wrote one
    record.finish("failed", **fields)
    return record.content

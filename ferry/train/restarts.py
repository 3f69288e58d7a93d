"""The record of a job's failures and restarts, and its goodput.

Everything lives in the run directory, so that it survives the processes it describes:

    restarts.jsonl         events, appended: `start` (a job begins: a fresh run, or one resumed by
                           hand), `failure` (written by whoever restarts the job: ferry's supervisor,
                           or rank 0 of a run restarted by torchrun), `resumed` (rank 0, once the
                           restarted job has trained its first step again)
    .faults/causes/*.json  what a failing rank said before it went (an exception, a hang); a rank
                           killed outright says nothing, and its exit signal speaks for it

`run.json` lists each restart (time, cause, the step it failed at and the step it resumed from,
steps lost, restart latency) and the job's goodput: productive step time over wall time, with
what the rest went to (saving, loading, restarting, lost steps).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ferry.train.run_record import EVENTS_NAME, FAULTS_DIR

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


def write_cause(run_dir: Path, rank: int, step: int, phase: str, error: str) -> None:
    """What this rank reports as it fails: read by whoever restarts the job."""
    folder = run_dir / CAUSES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    cause = {"rank": rank, "step": step, "phase": phase, "error": error, "at_unix": time.time()}
    staging = folder / f".rank-{rank:05d}-{os.getpid()}.json"
    staging.write_text(json.dumps(cause), encoding="utf-8")
    os.replace(staging, folder / f"rank-{rank:05d}-{os.getpid()}.json")


def collect_causes(run_dir: Path) -> list[dict]:
    """The causes the ranks of a failed attempt left, oldest first; taken (deleted) so the next failure has its own."""
    folder = run_dir / CAUSES_DIR
    causes = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else ():
        try:
            causes.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass
        path.unlink(missing_ok=True)
    return sorted(causes, key=lambda cause: cause.get("at_unix", 0.0))


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
    """Whether the job is being restarted: a failure was recorded and no training resumed since."""
    for event in reversed(events):
        if event["event"] == "resumed":
            return False
        if event["event"] == "failure":
            return True
        if event["event"] == "start":
            return False
    return False


def job_events(events: list[dict]) -> list[dict]:
    """The events of the current job: from its last `start` on."""
    starts = [index for index, event in enumerate(events) if event["event"] == "start"]
    return events[starts[-1]:] if starts else events


def restarts(events: list[dict]) -> list[dict]:
    """Each failure of the job paired with the resumption that followed it (if any yet)."""
    rows = []
    job = job_events(events)
    for index, event in enumerate(job):
        if event["event"] != "failure":
            continue
        # the resumption that followed, even past failures of attempts that died before their first step
        resumed = next((e for e in job[index + 1 :] if e["event"] == "resumed"), None)
        row = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(event["at_unix"])),
            "cause": describe_causes(event),
            "failed_at_step": event["failed_at_step"],
            "resumed_from_step": None if resumed is None else resumed["step"],
            "steps_lost": None if resumed is None else event["failed_at_step"] - resumed["step"],
            "restart_latency_s": None if resumed is None else resumed["at_unix"] - event["at_unix"],
            "skipped_checkpoints": [] if resumed is None else resumed.get("skipped", []),
            "removed_unfinished_saves": [] if resumed is None else resumed.get("removed_unfinished_saves", []),
            "by": event.get("by"),
        }
        rows.append(row)
    return rows


def describe_causes(event: dict) -> str:
    """One line: how the ranks of the failed attempt ended, the likely first failure first.

    A rank killed outright (SIGKILL; the launcher itself stops ranks with SIGTERM) says nothing
    and is taken as the first to go: the errors its peers then raise (a connection reset in a
    collective) are consequences, listed after it in the order they were reported.
    """
    reporting = {cause["rank"] for cause in event.get("causes", [])}
    killed, other = [], []
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


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def goodput(events: list[dict], records: list[dict], now: float) -> dict:
    """Productive step time over the job's wall time, and where the rest went.

    Productive: the step times of the steps the run kept (a step lost to a failure and trained
    again counts once). Saving: what training waited for checkpoints. Loading: verifying and
    restoring checkpoints at each resumption. Restarting: from each failure to the first step
    trained after it.
    """
    job = job_events(events)
    start = job[0] if job and job[0]["event"] == "start" else None
    begin = start["at_unix"] if start else now
    first_step = start["step"] if start else 0
    kept = [record for record in records if record.get("step", 0) > first_step]
    productive = sum(record.get("step_s") or 0.0 for record in kept)
    rows = restarts(events)
    resumed = [event for event in job if event["event"] == "resumed"]
    wall = max(now - begin, 1e-9)
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall,
        "restarts": len(rows),
        "lost_steps": sum(row["steps_lost"] or 0 for row in rows),
        "saving_s": sum(record.get("checkpoint_save_s") or 0.0 for record in kept),
        "loading_s": sum((event.get("verify_s") or 0.0) + (event.get("restore_s") or 0.0) for event in resumed)
        + (start.get("loading_s") or 0.0 if start else 0.0),
        "restarting_s": _restarting_s(job),
    }


def _restarting_s(job: list[dict]) -> float:
    """Time from each failure to the next failure or resumption: failures that follow one another before
    training resumes are counted once, not once per failure."""
    total = 0.0
    for index, event in enumerate(job):
        if event["event"] != "failure":
            continue
        following = next((e for e in job[index + 1 :] if e["event"] in ("failure", "resumed")), None)
        if following is not None:
            total += max(following["at_unix"] - event["at_unix"], 0.0)
    return total

"""An experiment tracker as a sink of the run's records, kept from ever stopping or slowing training.

A tracker talks to a service (W&B's servers, an MLflow server or database) that may be slow, unreachable, refuse
the credentials or fill its disk. So each runs on a thread of its own: the step only hands it the record's numbers
(a bounded queue; a record that finds it full is dropped), and every call the thread makes is guarded. A failure
is counted (`tracker_failures` in the step record), said once as a warning on the run's console (from the training
thread, at the next record), and the tracker is left: training goes on. At the run's end the tracker gets
`run.json` and the plots, and the end waits at most `metrics.tracker_timeout_s` for it; then run.json records each
tracker's run id and failures (`trackers`). The step records' counter is as far as the thread had got.

The tracker's run id is kept in `<run.dir>/trackers.json`, so that a resumed or restarted run continues the same
tracker run rather than starting another. A tracker its own settings disable (W&B's `disabled` mode) gets no thread
and no records; run.json says so, with the source of each of its settings.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

from ferry.metrics.names import RUN_RECORD_FILE, TRACKER_IDS_FILE, scalars
from ferry.metrics.tracker_settings import TrackerSetting, describe_settings
from ferry.platform.library_logs import LIBRARY_LOG_FILE, library_logs_in

_IDS = threading.Lock()  # the trackers of a run keep their ids in one file, each from its own thread
_QUEUED_RECORDS = 1024
# the sections of run.json a tracker shows beside the config, as `run.<section>.<key>`
SUMMARY_SECTIONS = (
    "name",
    "status",
    "model_size",
    "layout",
    "hardware",
    "precision",
    "environment",
    "micro_batch",
    "activation_checkpointing",
    "checkpoint_async",
    "goodput",
    "last_step",
)


class Tracker(Protocol):
    """What a tracker's adapter does, all of it on the sink's thread."""

    name: str
    settings: dict[str, TrackerSetting]  # each with its source (ferry/metrics/tracker_settings.py)
    active: bool  # False where the tracker's own settings disable it: no run, no failure
    loggers: tuple[str, ...]  # the library's loggers, whose records go to the run's libraries.log, not the console

    def open(self, run_id: str | None, config: dict, summary: dict) -> str:
        """Start the tracker's run, or continue `run_id`; with the resolved config and run.json's summary. Returns
        the run's id."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def attach(self, paths: list[Path], summary: dict) -> None:
        """Files of the run (run.json, the plots) and run.json's final summary."""

    def close(self) -> None: ...


class TrackerSink:
    """A `Tracker` fed from the run's records on its own thread. `write`, `warnings` and `close` are called from the
    training thread."""

    def __init__(self, tracker: Tracker, run_dir: Path, timeout_s: float):
        self.tracker = tracker
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.failures = 0
        self.first_failure: str | None = None
        self.run_id: str | None = None
        self._broken = False
        self._warnings: list[str] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUED_RECORDS)
        self._thread = threading.Thread(target=self._work, name=f"ferry-{tracker.name}", daemon=True)
        self._logs = ExitStack()
        if tracker.active:
            self._logs.enter_context(library_logs_in(run_dir / LIBRARY_LOG_FILE, tracker.loggers))
            self._thread.start()
            self._queue.put(("open",))

    def announcement(self) -> str:
        """The console's line for the tracker: its settings and where each came from."""
        state = "" if self.tracker.active else "disabled by its mode, no run; "
        return f"ferry: tracker {self.tracker.name}: {state}{describe_settings(self.tracker.settings)}"

    def write(self, record: dict) -> None:
        if not self.tracker.active:
            return
        try:
            self._queue.put_nowait(("log", record["step"], scalars(record)))
        except queue.Full:
            self._fail(f"its queue of {_QUEUED_RECORDS} records is full (the tracker is slower than training)")

    def warnings(self) -> list[str]:
        """The warnings since the last call (each failure of the tracker said once)."""
        with self._lock:
            taken, self._warnings = self._warnings, []
        return taken

    def close(self) -> None:
        """Hand the tracker the run's files and end its run, waiting at most `timeout_s` for it."""
        if not self.tracker.active:
            return
        with self._logs:
            try:
                self._queue.put(("end",), timeout=self.timeout_s)
            except queue.Full:
                self._fail(
                    f"it did not take the end of the run within metrics.tracker_timeout_s ({self.timeout_s:g} s)"
                )
                return
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                self._fail(
                    f"it did not finish within metrics.tracker_timeout_s ({self.timeout_s:g} s); the run ends "
                    "without it"
                )

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if self._broken:
                if task[0] == "end":
                    return
                self._count()
                continue
            try:
                if task[0] == "open":
                    self._open()
                elif task[0] == "log":
                    self.tracker.log(task[1], task[2])
                else:
                    self._end()
                    return
            except Exception as exc:  # a tracker's every failure: the run goes on without it
                self._broken = True
                self._fail(f"{type(exc).__name__}: {exc}")
                if task[0] == "end":
                    return

    def _open(self) -> None:
        name = self.tracker.name
        record = _run_record(self.run_dir)
        known = _read_ids(self.run_dir).get(name)
        run_id = self.tracker.open(known, record.get("config", {}), manifest_summary(record))
        with _IDS:
            ids = _read_ids(self.run_dir)
            if ids.get(name) != run_id:
                _write_ids(self.run_dir, {**ids, name: run_id})
        self.run_id = run_id

    def _end(self) -> None:
        from ferry.metrics.plots import plot_run  # matplotlib, loaded only when a tracker takes the plots

        files = [path for path in (self.run_dir / RUN_RECORD_FILE,) if path.is_file()]
        files += plot_run(self.run_dir).written
        self.tracker.attach(files, manifest_summary(_run_record(self.run_dir)))
        self.tracker.close()

    def outcome(self) -> dict:
        """What run.json records of the tracker once the run has ended: its run, and what it failed to take."""
        settings = {name: setting.as_record() for name, setting in self.tracker.settings.items()}
        with self._lock:
            return {
                "run_id": self.run_id,
                "failures": self.failures,
                "first_failure": self.first_failure,
                "active": self.tracker.active,
                "settings": settings,
            }

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            self.first_failure = self.first_failure or reason
            if self.failures == 1 or reason.startswith("it did not"):
                self._warnings.append(
                    f"ferry: warning: tracker {self.tracker.name} failed ({reason}); training goes on, its records "
                    "stay in metrics.jsonl"
                )

    def _count(self) -> None:
        with self._lock:
            self.failures += 1


def manifest_summary(record: dict) -> dict:
    """run.json's sections a tracker shows beside the config: their numbers and words, `run.<section>.<key>`."""
    summary = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}", inner)
        elif isinstance(value, (str, int, float, bool)):
            summary[prefix] = value

    for section in SUMMARY_SECTIONS:
        if section in record:
            add(f"run.{section}", record[section])
    return summary


def flattened(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys (the overrides' form) and their values as text, for trackers whose parameters
    are flat strings (MLflow)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flattened(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def _run_record(run_dir: Path) -> dict:
    try:
        content = json.loads((run_dir / RUN_RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / TRACKER_IDS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    """Atomically: a restart must find either the old ids or the new."""
    partial = run_dir / f".{TRACKER_IDS_FILE}.partial"
    partial.write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, run_dir / TRACKER_IDS_FILE)

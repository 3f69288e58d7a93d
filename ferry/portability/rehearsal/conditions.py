"""The conditions a throughput figure was measured under: how busy other work kept the machine while a leg ran,
on what CPU, with how many ranks and threads.

A throughput measured while other processes compete for the same cores is not the machine's: a rehearsal
recorded a target/source ratio of 15.86x, its source measured while the machine was busy, against the 2.32x
of the README's. So every throughput figure carries its conditions, and one measured under load
says so wherever it is shown: `ferry rehearse` and `ferry bench` print it, `ferry report` marks it and keeps
it off its trend line, `ferry cost` warns.

Two measures are taken over the whole leg by the process that launches and waits for it:

- the 1-minute load average (`os.getloadavg`), sampled every second: the figure people know, recorded (mean
  and max) to be read, not to judge by. It is an exponential average over a minute: over a leg of a few
  seconds it shows mostly what ran before the leg (a 2-thread leg of 2.3 s moved it from 0.73 to 0.75 on a
  2-core machine), and a leg that follows a long one inherits its predecessor's load as if it were another's;
- the CPU time other processes used while the leg ran: the machine's busy time (`/proc/stat`, steal
  included, since a virtual machine's host taking its cores is load too) less the CPU time of this process
  and of the leg's process tree (`getrusage`: the ranks are waited for, so their time is counted), averaged
  over the leg's wall time as a number of cores. It has no lag and leaves out the leg's own work, however
  many threads its ranks ran.

A figure is *under load* when other processes kept more than a quarter of the machine's logical cores busy
on average (`UNDER_LOAD_CORES_SHARE`). On 2 cores that is half a core: a one-thread busy loop beside a
2-thread leg shares the cores three ways, takes two thirds of a core and a third of the leg's throughput,
and is flagged, while the background of that machine at rest (kernel threads, its agent: about 0.03 of a
core by `ps`) stays far under it. There, a 1-rank tiny-model leg trained 44,216 tok/s at a load average of
0.75 and 2,828 tok/s while other processes used 1.6 of the 2 cores. Where `/proc/stat` does not exist (macOS), the other
processes' use is unknown and so is the fairness of the figure; the load average is still recorded.
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ferry.platform.fingerprint import cpu_model

UNDER_LOAD_CORES_SHARE = 0.25
FAIR, UNDER_LOAD, UNKNOWN = "fair", "under load", "unknown"
SAMPLE_INTERVAL_S = 1.0
# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...; busy is all but idle
# and iowait (a core waiting for I/O is free to run another's work)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class MachineLoad:
    """How busy the machine was while a leg ran: its 1-minute load average samples, and the cores other
    processes kept busy on average (None where the machine's CPU time cannot be read)."""

    load_1m: tuple[float, ...]
    others_busy_cores: float | None


class LoadSampler:
    """Measures `MachineLoad` from entering to leaving: around the launch of a leg and the wait for its end."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        self._interval_s = interval_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="ferry-load-sampler", daemon=True)
        self._started = 0.0
        self._machine_busy_s: float | None = None
        self._ours_s = 0.0
        self.measured: MachineLoad | None = None

    def __enter__(self) -> LoadSampler:
        self._started = time.monotonic()
        self._machine_busy_s = _machine_busy_s()
        self._ours_s = _our_cpu_s()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall_s = time.monotonic() - self._started
        busy_now = _machine_busy_s()
        others = None
        if self._machine_busy_s is not None and busy_now is not None and wall_s > 0:
            others_s = (busy_now - self._machine_busy_s) - (_our_cpu_s() - self._ours_s)
            others = max(others_s, 0.0) / wall_s
        self.measured = MachineLoad(tuple(self._samples), others)

    def _sample_until_stopped(self) -> None:
        self._sample()
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            self._samples.append(os.getloadavg()[0])
        except OSError:  # no load average on this platform: the samples stay empty
            pass


def throughput_conditions(load: MachineLoad, run_record: dict) -> dict:
    """What a leg's throughput was measured under, as records keep it: the machine's load over the leg, the
    CPU (model, logical cores) and the leg's ranks and torch threads per rank from its run.json fingerprint."""
    environment = run_record.get("environment") or {}
    cores = environment.get("logical_cores") or os.cpu_count()
    samples = load.load_1m
    others = load.others_busy_cores
    return {
        "load_1m_mean": round(statistics.fmean(samples), 2) if samples else None,
        "load_1m_max": round(max(samples), 2) if samples else None,
        "load_samples": len(samples),
        "others_busy_cores": None if others is None else round(others, 2),
        "logical_cores": cores,
        "cpu_model": environment.get("cpu_model") or cpu_model(),
        "ranks": (run_record.get("layout") or {}).get("world_size"),
        "torch_threads": environment.get("cpu_threads"),
        "under_load": None if others is None or not cores else others > UNDER_LOAD_CORES_SHARE * cores,
    }


def fairness(conditions: dict | None) -> str:
    """FAIR, UNDER_LOAD, or UNKNOWN: for a record from before ferry measured the load, or a machine where
    other processes' CPU use cannot be read."""
    under_load = (conditions or {}).get("under_load")
    if under_load is None:
        return UNKNOWN
    return UNDER_LOAD if under_load else FAIR


def ratio_fairness(throughput: dict) -> tuple[str, str]:
    """Whether a rehearsal's target/source ratio (its record's `throughput`) is a fair figure, and why not: a
    ratio is as unfair as its less fair side."""
    sides = {side: fairness(throughput.get(f"{side}_conditions")) for side in ("source", "target")}
    for verdict, why in ((UNDER_LOAD, "measured under load"), (UNKNOWN, "measured under unknown load")):
        named = [side for side, value in sides.items() if value == verdict]
        if named:
            return verdict, f"the {' and the '.join(named)} {'was' if len(named) == 1 else 'were'} {why}"
    return FAIR, "both sides were measured on a machine otherwise at rest"


def describe_conditions(conditions: dict | None) -> str:
    """The conditions in words, for a summary line or a table cell."""
    if not conditions:
        return "load unknown: recorded before ferry measured it"
    cores = conditions.get("logical_cores")
    peak = conditions.get("load_1m_max")
    load = "no load average" if peak is None else f"load average up to {peak:.1f}"
    others = conditions.get("others_busy_cores")
    busy = (
        f"other processes' CPU use unknown on {cores} cores"
        if others is None
        else (f"other processes used {others:.1f} of {cores} cores")
    )
    ranks, threads = conditions.get("ranks"), conditions.get("torch_threads")
    machine = f"{conditions.get('cpu_model') or 'unknown CPU'}, {_count(ranks, 'rank')} x {_count(threads, 'thread')}"
    verdict = fairness(conditions)
    if verdict == UNDER_LOAD:
        return f"measured under load: {busy}, {load} ({machine}): not a fair figure"
    if verdict == UNKNOWN:
        return f"{busy}, {load} ({machine}): whether it is a fair figure is unknown"
    return f"{busy}, {load} ({machine})"


def _count(number: int | None, noun: str) -> str:
    return f"? {noun}s" if number is None else f"{number} {noun}" + ("" if number == 1 else "s")


def _machine_busy_s() -> float | None:
    """Seconds of CPU time all cores of the machine spent busy since boot; None without /proc/stat."""
    try:
        with Path("/proc/stat").open(encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:]]
    return sum(ticks[index] for index in _BUSY_FIELDS if index < len(ticks)) / os.sysconf("SC_CLK_TCK")


def _our_cpu_s() -> float:
    """CPU seconds of this process and of every child it has waited for (with theirs, recursively)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total

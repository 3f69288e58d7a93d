"""The conditions a throughput was measured under: the arithmetic of other processes' CPU use, the judgement of
a figure measured under load, and the words every summary prints. Nothing here depends on how busy the machine
running the tests is: the CPU clocks are replaced where a figure is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ferry.portability.rehearsal import conditions
from ferry.portability.rehearsal.conditions import (
    FAIR,
    UNDER_LOAD,
    UNKNOWN,
    LoadSampler,
    MachineLoad,
    describe_conditions,
    fairness,
    ratio_fairness,
    throughput_conditions,
)

RUN_RECORD = {
    "environment": {"cpu_model": "AMD EPYC", "logical_cores": 2, "cpu_threads": 2},
    "layout": {"world_size": 1, "ep_degree": 1, "mode": "single"},
}


def test_other_processes_use_is_the_machines_busy_time_less_ours_over_the_wall_time(monkeypatch):
    """Over 4 s the machine's cores were busy 10 s, 3 s of them ours (this process and the leg's): others kept
    7 / 4 = 1.75 cores busy."""
    clocks = {"machine": iter([100.0, 110.0]), "ours": iter([20.0, 23.0]), "wall": iter([50.0, 54.0])}
    monkeypatch.setattr(conditions, "_machine_busy_s", lambda: next(clocks["machine"]))
    monkeypatch.setattr(conditions, "_our_cpu_s", lambda: next(clocks["ours"]))
    monkeypatch.setattr(conditions.time, "monotonic", lambda: next(clocks["wall"]))
    with LoadSampler(interval_s=60.0) as sampler:
        pass
    assert sampler.measured.others_busy_cores == pytest.approx(1.75)
    assert len(sampler.measured.load_1m) == 2  # one as the leg starts, one as it ends


def test_a_machine_without_proc_stat_measures_no_other_use(monkeypatch):
    monkeypatch.setattr(conditions, "_machine_busy_s", lambda: None)
    with LoadSampler() as sampler:
        pass
    assert sampler.measured.others_busy_cores is None and sampler.measured.load_1m


def test_a_waited_child_counts_as_ours():
    """The CPU time of a child the sampler's process waited for is ours, not another process's: a second of
    busy loop in a child moves our clock by about a second, whatever else the machine runs."""
    before = conditions._our_cpu_s()
    busy_second = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1: pass"
    subprocess.run([sys.executable, "-c", busy_second], check=True)
    assert conditions._our_cpu_s() - before >= 1.0


@pytest.mark.parametrize(
    "others, verdict",
    [(1.6, UNDER_LOAD), (0.51, UNDER_LOAD), (0.5, FAIR), (0.05, FAIR), (None, UNKNOWN)],
)
def test_a_figure_is_under_load_past_a_quarter_of_the_cores_busy_with_other_work(others, verdict):
    measured = throughput_conditions(MachineLoad((0.7, 4.7), others), RUN_RECORD)
    assert fairness(measured) == verdict
    assert measured["load_1m_mean"] == 2.7 and measured["load_1m_max"] == 4.7 and measured["load_samples"] == 2
    assert (measured["cpu_model"], measured["logical_cores"], measured["ranks"], measured["torch_threads"]) == (
        "AMD EPYC",
        2,
        1,
        2,
    )


def test_the_words_say_under_load_fair_or_unknown():
    busy = throughput_conditions(MachineLoad((4.7,), 1.6), RUN_RECORD)
    quiet = throughput_conditions(MachineLoad((0.8,), 0.05), RUN_RECORD)
    assert describe_conditions(busy) == (
        "measured under load: other processes used 1.6 of 2 cores, load average up to 4.7 "
        "(AMD EPYC, 1 rank x 2 threads): not a fair figure"
    )
    assert describe_conditions(quiet) == (
        "other processes used 0.1 of 2 cores, load average up to 0.8 (AMD EPYC, 1 rank x 2 threads)"
    )
    assert describe_conditions(None) == "load unknown: recorded before ferry measured it"
    assert ratio_fairness({"source_conditions": busy, "target_conditions": quiet}) == (
        UNDER_LOAD,
        "the source was measured under load",
    )
    assert ratio_fairness({"source_conditions": quiet}) == (UNKNOWN, "the target was measured under unknown load")
    assert ratio_fairness({"source_conditions": quiet, "target_conditions": quiet})[0] == FAIR

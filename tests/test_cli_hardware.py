"""`ferry hardware measure | show`: the CPU peak behind MFU is the best one measured, and shown with its conditions."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ferry.cli.main import main
from ferry.platform import hardware


def _entries(tmp_path) -> dict:
    return json.loads((tmp_path / "ferry" / "cpu_peak.json").read_text())


def test_measure_caches_the_peak_with_its_conditions_and_show_reports_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["hardware", "measure", "--seconds", "0.05"]) == 0
    entry = _entries(tmp_path)[hardware._peak_key()]
    assert set(entry["peak_tflops"]) == {"fp32", "bf16", "fp16"} and entry["peak_tflops"]["fp32"] > 0
    assert entry["cores"] >= 1 and "measured_at" in entry and entry["load_average"] >= 0
    capsys.readouterr()
    assert main(["hardware", "show", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"{entry['peak_tflops']['fp32'] * 1e3:10.1f} GFLOP/s" in out
    assert f"at load average {entry['load_average']}" in out


def test_a_measurement_under_load_does_not_replace_a_better_one_unless_asked(tmp_path, monkeypatch):
    measured = {"value": 0.100}
    monkeypatch.setattr(hardware, "_matmul_tflops", lambda dtype, seconds: measured["value"])
    hardware.measure_cpu_peak(tmp_path)
    measured["value"] = 0.040  # the same machine, busy
    assert hardware.measure_cpu_peak(tmp_path)["peak_tflops"]["fp32"] == 0.100
    assert hardware.cpu_peak_tflops(tmp_path)["fp32"] == 0.100
    assert hardware.measure_cpu_peak(tmp_path, replace=True)["peak_tflops"]["fp32"] == 0.040


def test_processes_with_other_thread_counts_keep_their_own_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "_matmul_tflops", lambda dtype, seconds: 0.1 * torch.get_num_threads())
    threads = torch.get_num_threads()
    try:
        hardware.measure_cpu_peak(tmp_path)
        torch.set_num_threads(threads + 1)
        hardware.measure_cpu_peak(tmp_path)
    finally:
        torch.set_num_threads(threads)
    entries = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert len(entries) == 2
    assert hardware.cpu_peak_tflops(tmp_path)["fp32"] == 0.1 * threads  # the first entry is still there


def test_a_non_positive_window_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["hardware", "measure", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err
    assert not (tmp_path / "ferry" / "cpu_peak.json").exists()


def test_a_run_that_outpaces_a_stale_cached_peak_measures_it_again_and_records_the_source(
    tmp_path, monkeypatch, make_config, capsys
):
    """The cache held a peak far below this CPU's (a cold or loaded measurement): the run's own rate beats it on
    its first step, so the run measures the peak again, says which peak was stale, and run.json records the new
    one with its conditions."""
    from ferry.train.trainer import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with monkeypatch.context() as patched:
        patched.setattr(hardware, "_matmul_tflops", lambda dtype, seconds: 1e-6)  # 1 MFLOP/s
        hardware.measure_cpu_peak(replace=True)
    result = train(make_config("train.steps=2"))
    out = capsys.readouterr().out
    assert "ferry: warning: MFU" in out and "the fp32 peak 0.0 GFLOP/s measured" in out
    assert str(tmp_path / "cache" / "ferry" / "cpu_peak.json") in out
    run = json.loads((result.run_dir / "run.json").read_text())
    peak = run["hardware"]["mfu_peak"]
    assert peak["kind"] == "measured" and peak["dtype"] == "fp32" and peak["tflops"] > 1e-3
    assert peak["threads"] == torch.get_num_threads() and peak["cache"].endswith("cpu_peak.json")
    assert hardware.cpu_peak_tflops()["fp32"] == peak["tflops"], "the new measurement is cached"
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["mfu"] < 1


def test_the_peak_is_the_best_of_several_timed_products_not_a_cold_first_one(monkeypatch):
    """A product timed once can land in a cold start; the measurement repeats it and keeps the best."""
    calls = {"count": 0}
    clock = {"now": 0.0}  # the measurement's clock, advanced by the products alone: no sleep to race the load

    def product(a, b):
        calls["count"] += 1
        clock["now"] += 0.02 if calls["count"] <= 2 else 0.001  # the warm-up and the first timed product are slow

    monkeypatch.setattr(hardware, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(hardware, "_SIZES", (64,))
    tflops = hardware._product_tflops(product, torch.float32, seconds=0.0)
    assert calls["count"] == 1 + hardware._MIN_REPEATS
    assert tflops == pytest.approx(2 * 64**3 / 0.001 / 1e12)

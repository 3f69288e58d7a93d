"""`ferry hardware measure | show`: the CPU peak behind MFU is the best one measured, and shown with its conditions."""

from __future__ import annotations

import json

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

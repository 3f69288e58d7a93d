"""`ferry hardware measure | show`: the CPU peak behind MFU is re-measurable, and its conditions are shown."""

from __future__ import annotations

import json

from ferry.cli.main import main


def test_measure_caches_the_peak_with_its_conditions_and_show_reports_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["hardware", "measure", "--seconds", "0.05"]) == 0
    entry = json.loads((tmp_path / "ferry" / "cpu_peak.json").read_text())
    assert set(entry["peak_tflops"]) == {"fp32", "bf16", "fp16"} and entry["peak_tflops"]["fp32"] > 0
    assert entry["cores"] >= 1 and "measured_at" in entry and entry["load_average"] >= 0
    capsys.readouterr()
    assert main(["hardware", "show", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"{entry['peak_tflops']['fp32'] * 1e3:10.1f} GFLOP/s" in out
    assert f"at load average {entry['load_average']}" in out


def test_a_non_positive_window_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["hardware", "measure", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err
    assert not (tmp_path / "ferry" / "cpu_peak.json").exists()

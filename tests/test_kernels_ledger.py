"""The debt ledger covers every vendor implementation and is current; docs/boundary.md is generated from it."""

from __future__ import annotations

import argparse
import datetime
import re

import pytest
import torch
from conftest import REPO

from ferry.cli.kernels import add_kernels_commands
from ferry.kernels import REGISTRY, load_ledger
from ferry.kernels.boundary import code_lines, render_boundary
from ferry.portability.report.history import KERNEL_BENCH, read_records


def test_every_vendor_implementation_has_a_current_ledger_entry():
    ledger = load_ledger()
    today = datetime.date.today()
    for impl in REGISTRY.vendor_implementations():
        entry = ledger.entry(impl)
        assert entry is not None, f"{impl.op} {impl.key} has no entry in ferry/kernels/ledger.yaml"
        assert entry.expires >= today, f"the ledger entry of {entry.key} expired on {entry.expires}: measure, renew"
        assert entry.approved is None or entry.approved <= today <= entry.expires


def test_every_ledger_entry_names_a_registered_implementation():
    registered = {(impl.op, impl.name, impl.platform) for impl in REGISTRY.vendor_implementations()}
    for entry in load_ledger().entries:
        assert (entry.op, entry.implementation, entry.platform) in registered, f"{entry.key} is not registered"


def test_the_committed_boundary_document_is_current():
    committed = (REPO / "docs" / "boundary.md").read_text(encoding="utf-8")
    assert committed == render_boundary(), "docs/boundary.md is stale: run `ferry kernels boundary`"


def test_code_lines_skip_blank_lines_comments_and_docstrings(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        '"""Module\n\ndocstring."""\n\n# comment\nimport os\n\n\n'
        'def f(x):\n    """Doc."""\n    return (x +\n            1)  # why\n'
    )
    assert code_lines(source) == 4


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ferry")
    add_kernels_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.handler(args)


def test_kernels_list_prints_availability_and_ledger_status(capsys):
    assert _cli("kernels", "list", "--device", "cpu") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["op", "implementation", "platform"]
    fused = next(line for line in lines if "fused_loop" in line)
    assert "yes" in fused and "expires" in fused
    cuda = next(line for line in lines if "grouped_gemm" in line)
    assert "no: it is built for cuda" in cuda


def test_kernels_boundary_writes_the_document(tmp_path, capsys):
    output = tmp_path / "boundary.md"
    assert _cli("kernels", "boundary", "--output", str(output)) == 0
    assert output.read_text(encoding="utf-8") == render_boundary()
    assert str(output) in capsys.readouterr().out


def test_kernels_bench_prints_ratios_verdicts_and_a_dispatch_cost_under_one_percent(capsys, tmp_path):
    argv = ["--tokens", "128", "--dim", "32", "--ffn", "16", "--experts", "4", "--top-k", "2", "--repeats", "1"]
    assert _cli("kernels", "bench", "--device", "cpu", *argv, "--history", str(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["moe.grouped_mm", "torch_grouped_mm@cpu"] for line in lines)
    assert any(line.startswith("  moe.routed_experts: portable") for line in lines)
    dispatch = next(line for line in lines if line.startswith("registry dispatch:"))
    assert "within the 1% limit" in dispatch
    ((_, record),) = read_records(tmp_path, KERNEL_BENCH)
    assert record["dtype"] == "float32" and record["shape"]["experts"] == 4 and record["date"]
    assert "host allocator: keep_freed" in lines  # the CPU profile's preset, as a CPU training run has it
    assert record["host_allocator"]["preset"] == "keep_freed"
    routed = next(op for op in record["ops"] if op["op"] == "moe.routed_experts")
    assert routed["fastest_vendor"] == "fused_loop@cpu" and routed["portable_loss"] is not None
    assert lines[-1] == f"ferry: figures appended to {tmp_path / KERNEL_BENCH}"


def test_ledger_debt_status_names_expiring_unmeasured_and_expired_entries():
    entry = next(e for e in load_ledger().entries if e.implementation == "fused_loop")
    assert entry.debt_status(entry.expires - datetime.timedelta(days=31)) == "approved"
    assert entry.debt_status(entry.expires - datetime.timedelta(days=30)) == "expiring"
    assert entry.debt_status(entry.expires + datetime.timedelta(days=1)) == "expired"
    unmeasured = next(e for e in load_ledger().entries if e.implementation == "grouped_gemm")
    assert not unmeasured.measured and unmeasured.debt_status(datetime.date(2026, 12, 1)) == "unmeasured"
    rejected = next(e for e in load_ledger().entries if e.implementation == "padded_bmm")
    assert rejected.debt_status(datetime.date(2026, 12, 1)) == "not approved"


def test_kernels_bench_rejects_a_budget_outside_zero_to_one():
    from ferry.config import UserError

    with pytest.raises(UserError, match="--budget"):
        _cli("kernels", "bench", "--device", "cpu", "--budget", "1.5")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--experts", "0"], "--experts must be at least 1"),
        (["--dim", "-4"], "--dim must be at least 1"),
        (["--experts", "4", "--top-k", "8"], "--top-k (8) cannot exceed --experts (4)"),
    ],
)
def test_kernels_bench_refuses_a_shape_it_cannot_build_before_timing_anything(argv, named):
    from ferry.config import UserError

    with pytest.raises(UserError, match=re.escape(named)):
        _cli("kernels", "bench", "--device", "cpu", *argv)


def test_a_history_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    from ferry.cli.main import main

    taken = tmp_path / "taken"
    taken.write_text("kept")
    assert main(["kernels", "bench", "--device", "cpu", "--history", str(taken / "portability")]) == 2
    assert f"{taken} is a file, not a directory" in capsys.readouterr().err
    assert main(["rehearse", "configs/tiny.yaml", "--from", "cpu", "--to", "cpu", "--history", str(taken)]) == 2
    assert f"{taken} is a file, not a directory" in capsys.readouterr().err
    assert taken.read_text() == "kept"


def test_kernels_bench_lists_an_implementation_that_refuses_the_recipe_as_unavailable(monkeypatch):
    """An implementation whose kernel takes other element formats (torchao's MXFP8 with E5M2 gradients) is
    listed with its reason, and the other implementations are still timed."""
    from ferry.kernels import bench
    from ferry.kernels.bench import BenchShape, run_bench
    from ferry.kernels.registry import RecipeRefused
    from ferry.platform.hardware import load_profile
    from ferry.precision import PrecisionConfig, resolve_precision

    timed = bench._time

    def refusing_low_precision(case, fn, repeats, device):
        if any(getattr(arg, "kind", None) == "fp8" for arg in case.args):
            raise RecipeRefused("it computes E4M3 gradients only")
        return timed(case, fn, repeats, device)

    monkeypatch.setattr(bench, "_time", refusing_low_precision)
    recipe = resolve_precision(PrecisionConfig(experts="fp8", on_unsupported="emulate"), load_profile("cpu")).recipe
    shape = BenchShape(tokens=64, dim=32, ffn=16, experts=4, top_k=2)
    report = run_bench(torch.device("cpu"), 0.1, shape, repeats=1, recipes={"moe.fp8_grouped_mm": recipe})
    timings = {op.op: op.timings for op in report.ops}
    (fp8,) = timings["moe.fp8_grouped_mm"][:1]
    assert fp8.seconds is None and fp8.unavailable == "it computes E4M3 gradients only"
    assert all(timing.seconds is not None for timing in timings["moe.grouped_mm"] if timing.unavailable is None)


def test_the_fp8_grouped_gemms_record_their_whole_steps_against_bf16_and_are_numerics_only_where_slower():
    entries = {entry.key: entry for entry in load_ledger().entries}
    native = entries["moe.fp8_grouped_mm torch_scaled_grouped_mm@cuda"].step_on("h200")
    assert native.ratio == 0.19 and native.slower and native.shape == "OLMoE-1B-7B" and native.date == "2026-12"
    torchao = entries["moe.fp8_grouped_mm torchao@cuda"]
    assert torchao.step_on("h200").ratio == 0.51 and torchao.approved is None
    assert torchao.speed_summary() == "whole step 0.51x bf16 on h200 (numerics only)"
    assert entries["moe.routed_experts fused_loop@cpu"].speed_summary() is None


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("profile", "h900", "unknown hardware profile 'h900'"),
        ("date", "December 2026", "date"),
        ("ratio", 0.0, "ratio"),
    ],
)
def test_a_whole_step_measurement_names_a_known_profile_a_date_and_a_positive_ratio(field, value, named):
    from ferry.config import ConfigError
    from ferry.config.loader import validate
    from ferry.kernels.ledger import StepMeasurement

    raw = {
        "profile": "h200",
        "ratio": 0.19,
        "baseline": "the bf16 eager step",
        "shape": "OLMoE-1B-7B",
        "figures": "3,862 against 20,144 tok/s",
        "date": "2026-12",
        "source": "benchmarks/accelerator_training.py",
    }
    assert validate(StepMeasurement, raw).ratio == 0.19
    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(StepMeasurement, {**raw, field: value})


def test_kernels_list_marks_the_fp8_kernels_measured_slower_than_bf16_as_numerics_only(capsys):
    assert _cli("kernels", "list", "--device", "cpu") == 0
    lines = capsys.readouterr().out.splitlines()
    native = next(line for line in lines if "torch_scaled_grouped_mm  cuda" in line)
    assert " approved, expires " in native
    assert native.endswith("; whole step 0.19x bf16 on h200 (numerics only)")
    rocm = next(line for line in lines if "torch_scaled_grouped_mm  rocm" in line)
    assert "numerics only" not in rocm

"""FP8 expert GEMMs are a speed option only where the ledger measured them winning against bf16.

The start of a run is built here as `choose_numerics` builds it (precision resolved against the
hardware profile, kernels selected for the device, the expert GEMMs routed through the FP8 op),
on a CPU that reports compute capability 9.0 for `cuda`, which is all the SM90 probes look at.
"""

from __future__ import annotations

import datetime
import sys

import pytest
import torch

from ferry.kernels import KernelsConfig, Ledger, load_ledger, select_kernels
from ferry.kernels.ledger import StepMeasurement
from ferry.platform.hardware import load_profile
from ferry.precision import PrecisionConfig, resolve_precision
from ferry.precision.kernels import low_precision_op, with_low_precision_experts

TODAY = datetime.date(2026, 12, 1)
FP8_OP = "moe.fp8_grouped_mm"


@pytest.fixture
def sm90(monkeypatch):
    """A `cuda` device with compute capability 9.0 (H100/H200) and no torchao installed."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)


def _start(profile: str, experts: str = "fp8", ledger: Ledger | None = None):
    """The precision policy and kernels of a run starting on `profile`'s hardware, as the run's assembly makes them."""
    precision = resolve_precision(PrecisionConfig(experts=experts), load_profile(profile))
    kernels = select_kernels(
        KernelsConfig(policy="auto"), "cuda", precision.torch_compute_dtype, ledger=ledger, today=TODAY
    )
    if precision.recipe is not None:
        kernels = with_low_precision_experts(kernels, precision.recipe)
        low = kernels.choices[low_precision_op(precision.recipe)].implementation
        precision.record_experts_kernel(low.key, native=not low.portable, ledger=ledger)
    return precision, kernels


def test_fp8_on_an_h200_runs_native_and_says_at_start_it_is_for_numerics_not_speed(sm90):
    precision, kernels = _start("h200")
    assert precision.experts_mode == "native" and precision.experts_kernel == "torch_scaled_grouped_mm@cuda"
    line = precision.decisions[-1]
    assert line.startswith(
        "warning: experts=fp8 on h200: the FP8 expert GEMMs (torch_scaled_grouped_mm@cuda) "
        "measured 0.19x the bf16 eager step on h200 at the OLMoE-1B-7B shape "
        "(benchmarks/accelerator_training.py"
    )
    assert line.endswith("so fp8 is offered here for its numerics, not for speed")
    assert line in precision.as_dict()["decisions"]  # what run.json records
    reason = kernels.choices[FP8_OP].reason
    assert "approved in the ledger" in reason and "whole step 0.19x bf16 on h200 (numerics only)" in reason


def test_a_bf16_run_on_the_same_hardware_says_nothing_about_fp8(sm90):
    precision, _ = _start("h200", experts="none")
    assert precision.experts_kernel is None
    assert not any("fp8" in decision or "numerics" in decision for decision in precision.decisions)


def test_on_hardware_without_a_measurement_fp8_is_not_offered_for_speed_and_the_evidence_elsewhere_is_named(sm90):
    precision, _ = _start("h100")
    line = precision.decisions[-1]
    assert "have no whole-step measurement against bf16 on h100" in line
    assert "elsewhere: 0.19x the bf16 eager step on h200" in line
    assert line.endswith("fp8 is offered here for its numerics, not for speed") and not line.startswith("warning")


def test_a_measured_win_is_stated_without_the_numerics_only_warning(sm90):
    won = StepMeasurement(
        profile="h200",
        ratio=1.25,
        baseline="the bf16 compiled step",
        shape="OLMoE-1B-7B",
        figures="test",
        date="2027-01",
        source="test",
    )
    native = "moe.fp8_grouped_mm torch_scaled_grouped_mm@cuda"
    entries = tuple(
        entry.model_copy(update={"step_vs_bf16": [won]}) if entry.key == native else entry
        for entry in load_ledger().entries
    )
    precision, kernels = _start("h200", ledger=Ledger(entries))
    assert precision.decisions[-1] == (
        "experts=fp8 on h200: the FP8 expert GEMMs (torch_scaled_grouped_mm@cuda) measured 1.25x the bf16 compiled "
        "step on h200 at the OLMoE-1B-7B shape (test, 2027-01)"
    )
    assert "numerics only" not in kernels.choices[FP8_OP].reason


def test_a_pinned_kernel_measured_slower_says_so_with_its_own_figure():
    precision = resolve_precision(PrecisionConfig(experts="fp8"), load_profile("h200"))
    precision.record_experts_kernel("torchao@cuda", native=True)
    assert "(torchao@cuda) measured 0.51x the bf16 eager step on h200" in precision.decisions[-1]
    assert precision.decisions[-1].startswith("warning:")


@pytest.mark.parametrize("profile", ["cpu", "h200"])
def test_emulated_fp8_says_it_is_for_its_numerics_only(profile):
    precision = resolve_precision(PrecisionConfig(experts="fp8"), load_profile(profile))
    precision.record_experts_kernel("portable", native=False)
    assert precision.experts_mode == "emulated"
    assert "for its numerics only" in precision.decisions[-1]

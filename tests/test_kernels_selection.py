"""Kernel selection: policies, per-op pins, the ledger gate, clear errors, and what the model runs."""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
from pathlib import Path

import pytest
import torch
from test_model import LocalDispatcher

import ferry.kernels.vendor
from ferry.config import ConfigError, UserError
from ferry.config.loader import validate
from ferry.kernels import KernelsConfig, Ledger, LedgerEntry, load_ledger, select_kernels
from ferry.model import ModelConfig, MoEConfig, MoELayer, Transformer

VENDOR_DIR = Path(ferry.kernels.vendor.__file__).parent
MODEL_DIR = Path(ferry.kernels.__file__).parent.parent / "model"
TODAY = datetime.date(2026, 11, 30)


def _ledger(approved: datetime.date | None, expires: datetime.date) -> Ledger:
    """The packaged ledger with the CPU fused experts' entry replaced."""
    entries = [e for e in load_ledger().entries if (e.op, e.platform) != ("moe.routed_experts", "cpu")]
    fused = LedgerEntry(
        op="moe.routed_experts",
        implementation="fused_loop",
        platform="cpu",
        owner="test",
        reason="test",
        measured_gain="test",
        approved=approved,
        expires=expires,
    )
    return Ledger((*entries, fused))


def test_portable_policy_takes_every_portable_implementation():
    selection = select_kernels(KernelsConfig(policy="portable"), "cpu")
    assert selection.vendor_ops == []
    assert all(choice.implementation.portable for choice in selection.choices.values())
    assert selection.describe() == f"kernels: policy portable on cpu — all {len(selection.choices)} ops portable"


def test_auto_takes_an_approved_unexpired_vendor_implementation_only():
    approved = select_kernels(KernelsConfig(), "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY)
    assert approved.choices["moe.routed_experts"].implementation.key == "fused_loop@cpu"
    assert approved.vendor_ops == ["moe.routed_experts"]
    pending = select_kernels(KernelsConfig(), "cpu", ledger=_ledger(None, TODAY), today=TODAY)
    assert pending.choices["moe.routed_experts"].implementation.portable
    assert "ledger entry not approved" in pending.choices["moe.routed_experts"].reason
    expired = select_kernels(
        KernelsConfig(), "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY + datetime.timedelta(days=1)
    )
    assert expired.choices["moe.routed_experts"].implementation.portable
    assert "ledger entry expired" in expired.choices["moe.routed_experts"].reason


def test_a_pin_overrides_the_policy_both_ways():
    config = validate(KernelsConfig, {"policy": "portable", "ops": {"moe.grouped_mm": "torch_grouped_mm"}})
    selection = select_kernels(config, "cpu", today=TODAY)
    assert selection.choices["moe.grouped_mm"].implementation.key == "torch_grouped_mm@cpu"
    assert "ledger: not approved" in selection.choices["moe.grouped_mm"].reason
    config = KernelsConfig(policy="auto", ops={"moe.routed_experts": "portable"})
    assert select_kernels(config, "cpu", today=TODAY).vendor_ops == []


def test_the_selection_is_recorded_for_run_json():
    record = select_kernels(KernelsConfig(), "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY).as_dict()
    assert record["policy"] == "auto" and record["platform"] == "cpu"
    assert record["ops"]["moe.routed_experts"]["implementation"] == "fused_loop@cpu"
    assert record["ops"]["moe.grouped_mm"] == {
        "implementation": "portable",
        "reason": "auto: loop_column_major@cpu: it only changes the GEMM layouts of bfloat16/float16; in "
        "torch.float32 the portable loop is as fast; torch_grouped_mm@cpu: ledger entry not approved; "
        "padded_bmm@cpu: ledger entry not approved",
    }


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ({"moe.grouped_mmm": "portable"}, "unknown op 'moe.grouped_mmm'"),
        ({"moe.grouped_mm": "cutlass"}, "moe.grouped_mm has no implementation 'cutlass'"),
    ],
)
def test_a_bad_override_is_a_config_error_naming_the_op(ops, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate(KernelsConfig, {"ops": ops})
    assert "ops" in str(error.value)


@pytest.mark.parametrize(
    ("device", "ops", "message"),
    [
        ("cpu", {"moe.grouped_mm": "grouped_gemm"}, "grouped_gemm is not available on cpu: it is built for cuda"),
        ("cuda", {"moe.routed_experts": "fused_loop"}, "fused_loop is not available on cuda: it is built for cpu"),
        ("cuda", {"moe.grouped_mm": "grouped_gemm"}, "grouped_gemm@cuda is not available on cuda"),
    ],
)
def test_an_unavailable_implementation_is_a_user_error_naming_op_and_reason(device, ops, message):
    with pytest.raises(UserError, match=re.escape(message)) as error:
        select_kernels(KernelsConfig(ops=ops), device)
    assert f'kernels.ops."{next(iter(ops))}"' in str(error.value)


class _VendorTrace:
    """Records which vendor files' Python code runs inside the block (forward and backward alike)."""

    def __enter__(self) -> set[str]:
        self.seen: set[str] = set()
        sys.setprofile(self._profile)
        return self.seen

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and Path(frame.f_code.co_filename).parent == VENDOR_DIR:
            self.seen.add(Path(frame.f_code.co_filename).name)


def _train_step(model) -> None:
    output = model(torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)))
    output.logits_BSV.sum().backward()


SMALL = {
    "vocab_size": 50,
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "qk_norm": True,
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16},
}


def test_portable_policy_runs_no_vendor_code():
    config = ModelConfig.model_validate(SMALL)
    portable = Transformer(config, select_kernels(KernelsConfig(policy="portable"), "cpu"))
    with _VendorTrace() as seen:
        _train_step(portable)
    assert seen == set()
    auto = Transformer(config, select_kernels(KernelsConfig(), "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY))
    with _VendorTrace() as seen:
        _train_step(auto)
    assert seen == {"cpu_fused_experts.py"}, "the trace sees vendor code when it runs"


def test_a_composed_op_follows_the_choice_for_its_parts():
    """Pinning moe.grouped_mm reaches the experts through moe.expert_mlp, on one device and behind a dispatcher."""
    pinned = select_kernels(KernelsConfig(policy="portable", ops={"moe.grouped_mm": "padded_bmm"}), "cpu")
    layer = MoELayer(32, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16), pinned)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x_BSD = torch.randn(2, 5, 32)
    for dispatcher in (None, LocalDispatcher()):
        layer.dispatcher = dispatcher
        with _VendorTrace() as seen:
            layer(x_BSD)[0].sum().backward()
        assert seen == {"padded_bmm.py"}


def test_a_model_built_with_vendor_kernels_matches_the_portable_model():
    config = ModelConfig.model_validate(
        {
            "vocab_size": 50,
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "dense_layers": 1,
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16, "shared_expert_ffn_dim": 8},
        }
    )
    torch.manual_seed(0)
    portable = Transformer(config)
    torch.manual_seed(0)
    vendor = Transformer(config, select_kernels(KernelsConfig(), "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY))
    assert vendor.kernels.vendor_ops == ["moe.routed_experts"]
    assert list(vendor.state_dict()) == list(portable.state_dict()), "kernels never change checkpoint names"
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = [model(tokens).logits_BSV.float().pow(2).mean() for model in (portable, vendor)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-5 * abs(losses[0].item())
    for (name, p), (_, q) in zip(portable.named_parameters(), vendor.named_parameters()):
        assert (p.grad - q.grad).norm() <= 1e-5 * p.grad.norm() + 1e-12, name


def test_model_files_call_kernels_only_through_the_registry():
    forbidden = re.compile(
        r"torch\.cuda|torch\.version|device\.type|_grouped_mm|import triton|grouped_gemm|"
        r"scaled_dot_product_attention|ferry\.kernels\.(vendor|portable)"
    )
    for path in sorted(MODEL_DIR.glob("*.py")):
        hits = [line.strip() for line in path.read_text().splitlines() if forbidden.search(line)]
        assert not hits, f"{path.name} reaches past the kernel registry: {hits}"


def test_every_selection_runs_under_autocast_and_agrees():
    """Ops compute in the dtypes they are given, so autocast cannot mix dtypes inside an implementation.

    Under autocast the expert layer hands its op every operand in the autocast dtype
    (the expert GEMMs follow precision.compute_dtype), and the fp32 weights get fp32
    gradients. Tolerance 2e-2: in bfloat16 the two grouped GEMMs round their outputs
    (2^-8 relative) after summing in different orders; measured 1.0e-3.
    """
    outputs = []
    for config in (KernelsConfig(policy="portable"), KernelsConfig(ops={"moe.grouped_mm": "torch_grouped_mm"})):
        torch.manual_seed(0)
        selection = select_kernels(config, "cpu", ledger=_ledger(TODAY, TODAY), today=TODAY)
        seen_dtypes = set()
        routed = selection.functions["moe.routed_experts"]

        def spy(*args, routed=routed, seen_dtypes=seen_dtypes):
            seen_dtypes.update(arg.dtype for arg in args if isinstance(arg, torch.Tensor) and arg.is_floating_point())
            return routed(*args)

        selection.choices["moe.routed_experts"] = dataclasses.replace(selection.choices["moe.routed_experts"], fn=spy)
        model = Transformer(ModelConfig.model_validate(SMALL), selection)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_BSV = model(torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))).logits_BSV
        logits_BSV.float().pow(2).mean().backward()
        weight = model.layers[1].ffn.experts.w_gate_EFD
        assert seen_dtypes == {torch.bfloat16} and weight.grad.dtype == torch.float32
        outputs.append((logits_BSV.float(), weight.grad))
    (logits_a, grad_a), (logits_b, grad_b) = outputs
    assert (logits_a - logits_b).norm() < 2e-2 * logits_a.norm()
    assert (grad_a - grad_b).norm() < 2e-2 * grad_a.norm()

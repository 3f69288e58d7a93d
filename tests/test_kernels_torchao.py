"""torchao's MoE training kernels as vendor implementations of the low-precision expert GEMM ops.

On a CPU the probes must refuse with a reason a user can act on, `auto` must never
take them, and the code around torchao's kernels (moving token groups to aligned
starts and back, the column-major weight, the zero gradient of an expert without
tokens) runs over reference kernels that check torchao's contract and compute the
portable emulation, in fp32: tolerance 1e-5 relative, as only padding differs.

On a GPU with torchao the kernels themselves run, in bfloat16, against the emulation
in fp32 on the same bfloat16-rounded inputs. MXFP8 quantizes exactly as the emulation
(OCP scales, blocks restarting at each group), so 2e-2, a few bfloat16 roundings. FP8
rounds every scale down to a power of two, so its elements round differently from the
emulation's: on random data each lies about 3.6% from the exact product and 5% from
the other (measured on CPU with a model of torchao's scaling); the test bounds the
difference at 8% and asks the native path to be no further from the exact product
than the emulation is, by more than a quarter.
"""

from __future__ import annotations

import datetime
import enum
import sys
import types
from functools import partial

import pytest
import torch

from ferry.config import UserError
from ferry.config.loader import validate
from ferry.kernels import REGISTRY, KernelsConfig, Ledger, LedgerEntry, load_ledger, portable_kernels, select_kernels
from ferry.kernels.boundary import list_rows
from ferry.kernels.vendor import torchao_grouped_mm as ao
from ferry.precision.formats import float_format
from ferry.precision.recipe import LowPrecisionRecipe

CUDA = torch.device("cuda")
TODAY = datetime.date(2026, 12, 1)
TOLERANCE = 1e-5
MXFP8_TOLERANCE = 2e-2
FP8_TOLERANCE = 8e-2
E4M3 = float_format("float8_e4m3fn")
FP8 = LowPrecisionRecipe("fp8", E4M3, E4M3)
MXFP8_E4M3 = LowPrecisionRecipe("mxfp8", E4M3, E4M3)  # what torchao computes: E4M3 gradients
MXFP8_E5M2 = LowPrecisionRecipe("mxfp8", E4M3, float_format("float8_e5m2"))  # the precision layer's MXFP8


class _ScaleCalculationMode(enum.Enum):
    FLOOR = "floor"
    RCEIL = "rceil"


def _fake_torchao(monkeypatch, version: str = "0.18.0", sm100_kernels: bool = True, **kernels) -> None:
    """torchao's modules as ferry imports them, holding `kernels` (none: a release without the MoE kernels)."""
    modules = {
        "torchao": types.ModuleType("torchao"),
        "torchao.prototype": types.ModuleType("torchao.prototype"),
        "torchao.prototype.moe_training": types.ModuleType("torchao.prototype.moe_training"),
        "torchao.prototype.moe_training.mxfp8_grouped_mm": types.ModuleType("mxfp8_grouped_mm"),
        "torchao.prototype.mx_formats": types.ModuleType("torchao.prototype.mx_formats"),
        "torchao.prototype.mx_formats.config": types.ModuleType("torchao.prototype.mx_formats.config"),
    }
    modules["torchao"].__version__ = version
    modules["torchao.prototype.moe_training.mxfp8_grouped_mm"]._SM100_KERNELS_AVAILABLE = sm100_kernels
    modules["torchao.prototype.mx_formats.config"].ScaleCalculationMode = _ScaleCalculationMode
    for name, fn in kernels.items():
        setattr(modules["torchao.prototype.moe_training"], name, fn)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


# --- probes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [ao.probe_fp8, ao.probe_mxfp8], ids=["fp8", "mxfp8"])
def test_probes_refuse_a_cpu_and_a_rocm_gpu(probe, monkeypatch):
    assert "run on NVIDIA CUDA GPUs, this device is cpu" in probe(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "this device is a ROCm GPU" in probe(CUDA, torch.bfloat16)


@pytest.mark.parametrize("probe, capability", [(ao.probe_fp8, (9, 0)), (ao.probe_mxfp8, (10, 0))], ids=["fp8", "mxfp8"])
def test_probes_name_what_is_missing_on_a_gpu_that_fits(probe, capability, monkeypatch):
    _gpu(monkeypatch, capability)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed, even where it is
    assert probe(CUDA, torch.bfloat16) == "torchao is not installed (pip install ferry-moe[gpu])"
    assert "the run computes in torch.float32" in probe(CUDA, torch.float32)
    _fake_torchao(monkeypatch, version="0.13.0")
    reason = probe(CUDA, torch.bfloat16)
    assert reason.startswith("torchao 0.13.0 has no torchao.prototype.moe_training._to_")
    assert "ferry needs torchao 0.17 or newer" in reason
    _fake_torchao(monkeypatch, **{ao.FP8_KERNEL: None, ao.MXFP8_KERNEL: None})
    assert probe(CUDA, torch.bfloat16) is None


def test_probes_name_the_compute_capability_each_kernel_needs(monkeypatch):
    _fake_torchao(monkeypatch, **{ao.FP8_KERNEL: None, ao.MXFP8_KERNEL: None})
    _gpu(monkeypatch, (8, 9))
    assert "runs on compute capability 9.0, this GPU has 8.9" in ao.probe_fp8(CUDA, torch.bfloat16)
    _gpu(monkeypatch, (10, 0))
    assert "runs on compute capability 9.0, this GPU has 10.0" in ao.probe_fp8(CUDA, torch.bfloat16)
    _gpu(monkeypatch, (9, 0))
    assert "runs on compute capability 10.x (SM100), this GPU has 9.0" in ao.probe_mxfp8(CUDA, torch.bfloat16)


def test_mxfp8_probe_refuses_a_torchao_built_without_its_sm100_kernels(monkeypatch):
    _gpu(monkeypatch, (10, 0))
    _fake_torchao(monkeypatch, sm100_kernels=False, **{ao.MXFP8_KERNEL: None})
    assert "torchao 0.18.0 was built without its SM100 MXFP8 kernels" in ao.probe_mxfp8(CUDA, torch.bfloat16)


# --- registry, ledger, selection ------------------------------------------------------------------------------


def test_the_registry_lists_torchao_for_cuda_on_both_low_precision_ops():
    for op, fn in [("moe.fp8_grouped_mm", ao.fp8_grouped_mm), ("moe.mxfp8_grouped_mm", ao.mxfp8_grouped_mm)]:
        (impl,) = REGISTRY[op].named("torchao")
        assert impl.platform == "cuda" and impl.fn is fn
        assert load_ledger().entry(impl).approved is None  # registered for measurement and pins only


def test_kernels_list_shows_torchao_unavailable_on_a_cpu():
    rows = [row for row in list_rows(torch.device("cpu")) if row[1] == "torchao"]
    assert [row[0] for row in rows] == ["moe.fp8_grouped_mm", "moe.mxfp8_grouped_mm"]
    for _, _, platform, available, status in rows:
        assert platform == "cuda" and available == "no: it is built for cuda and this device is cpu"
        assert status.startswith("not approved")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_on_a_cpu_never_takes_torchao(dtype):
    selection = select_kernels(KernelsConfig(policy="auto"), "cpu", dtype, today=TODAY)
    for op in ("moe.fp8_grouped_mm", "moe.mxfp8_grouped_mm"):
        assert selection.choices[op].implementation.portable
        assert selection.choices[op].reason == "auto: no vendor implementation for cpu"


def test_a_pin_of_torchao_on_a_cpu_is_a_user_error():
    config = validate(KernelsConfig, {"ops": {"moe.fp8_grouped_mm": "torchao"}})
    with pytest.raises(UserError, match="torchao is not available on cpu: it is built for cuda"):
        select_kernels(config, "cpu", today=TODAY)


def _approving_torchao() -> Ledger:
    entries = [entry for entry in load_ledger().entries if entry.implementation != "torchao"]
    approved = [
        LedgerEntry(
            op=op,
            implementation="torchao",
            platform="cuda",
            owner="test",
            reason="test",
            measured_gain="test",
            approved=TODAY,
            expires=TODAY,
        )
        for op in ("moe.fp8_grouped_mm", "moe.mxfp8_grouped_mm")
    ]
    return Ledger((*entries, *approved))


def test_on_an_h200_auto_takes_torchao_only_once_approved_and_a_pin_takes_it_now(monkeypatch):
    _gpu(monkeypatch, (9, 0))
    _fake_torchao(monkeypatch, **{ao.FP8_KERNEL: None, ao.MXFP8_KERNEL: None})
    today = select_kernels(KernelsConfig(policy="auto"), CUDA, torch.bfloat16, today=TODAY)
    assert today.choices["moe.fp8_grouped_mm"].implementation.key == "torch_scaled_grouped_mm@cuda"
    assert "compute capability 10.x" in today.choices["moe.mxfp8_grouped_mm"].reason
    approved = select_kernels(
        KernelsConfig(policy="auto"), CUDA, torch.bfloat16, ledger=_approving_torchao(), today=TODAY
    )
    assert approved.choices["moe.fp8_grouped_mm"].implementation.key == "torchao@cuda"
    pinned = validate(KernelsConfig, {"policy": "auto", "ops": {"moe.fp8_grouped_mm": "torchao"}})
    choice = select_kernels(pinned, CUDA, torch.bfloat16, today=TODAY).choices["moe.fp8_grouped_mm"]
    assert choice.implementation.key == "torchao@cuda" and "ledger: not approved" in choice.reason


def test_a_pin_names_the_missing_torchao(monkeypatch):
    _gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)
    config = validate(KernelsConfig, {"ops": {"moe.fp8_grouped_mm": "torchao"}})
    with pytest.raises(UserError, match=r"torchao@cuda is not available .*pip install ferry-moe\[gpu\]"):
        select_kernels(config, CUDA, torch.bfloat16, today=TODAY)


# --- the code around the kernels, over reference kernels ------------------------------------------------------


class _Unwritten(torch.autograd.Function):
    """The identity; its backward leaves NaN in the gradient of experts without rows, as uninitialized memory."""

    @staticmethod
    def forward(ctx, b_EIO, offs):
        ctx.save_for_backward(offs)
        return b_EIO.view_as(b_EIO)

    @staticmethod
    def backward(ctx, grad_EIO):
        (offs,) = ctx.saved_tensors
        empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
        return grad_EIO.masked_fill(empty.view(-1, 1, 1), float("nan")), None


def _reference(recipe, align: int, a_PI, b_EIO, offs):
    """torchao's contract, checked, computed by the portable emulation; rows past the last group are NaN."""
    assert a_PI.ndim == 2 and b_EIO.ndim == 3 and a_PI.stride(-1) == 1, "A 2D row-major, B 3D"
    assert b_EIO.stride(-2) == 1, "B must be column-major per expert: (E, I, O) with strides (I*O, 1, I)"
    assert a_PI.shape[1] % align == 0 and b_EIO.shape[1] % align == 0 and b_EIO.shape[2] % align == 0
    assert offs.dtype == torch.int32 and offs.shape == (b_EIO.shape[0],)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert bool((sizes % align == 0).all()), f"token groups must be multiples of {align} rows"
    assert a_PI.shape[0] % align == 0 and a_PI.shape[0] >= int(offs[-1])
    rows = int(offs[-1])
    w_EOI = _Unwritten.apply(b_EIO, offs).transpose(-2, -1)
    y = portable_kernels()[_op_of(recipe)](a_PI[:rows], w_EOI, offs, recipe)
    return torch.cat([y, y.new_full((a_PI.shape[0] - rows, y.shape[1]), float("nan"))])


def reference_fp8(a, b, offs, out_dtype, float8_dtype, pad_token_groups_for_grouped_mm):
    assert float8_dtype == torch.float8_e4m3fn and not pad_token_groups_for_grouped_mm
    return _reference(FP8, ao.FP8_ALIGN, a, b, offs).to(out_dtype)


def reference_mxfp8(a, b, offs, out_dtype, scale_calculation_mode, pad_token_groups_for_grouped_mm):
    assert scale_calculation_mode is _ScaleCalculationMode.FLOOR and not pad_token_groups_for_grouped_mm
    return _reference(MXFP8_E4M3, ao.MX_ALIGN, a, b, offs).to(out_dtype)


def _op_of(recipe) -> str:
    return f"moe.{recipe.kind}_grouped_mm"


def _fwd_bwd(fn, x, w, offsets):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, offsets)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16()  # exact in both dtypes
    y.backward(upstream.to(y))
    return [y.detach(), x.grad, w.grad]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(group_sizes, width_in=64, width_out=96, device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor(group_sizes).cumsum(0).to(torch.int32)
    x = torch.randn(int(offsets[-1]), width_in, generator=generator) * 3
    w = torch.randn(len(group_sizes), width_out, width_in, generator=generator) * 0.1
    return x.to(device, dtype), w.to(device, dtype), offsets.to(device)


GROUPS = pytest.mark.parametrize(
    "group_sizes",
    [[32, 64, 0, 32], [5, 0, 37, 22, 0], [40, 9, 0, 0], [0, 1, 70]],  # aligned; ragged, empty between or at the ends
    ids=["aligned", "ragged", "trailing-empty", "leading-empty"],
)


@GROUPS
@pytest.mark.parametrize(
    "fn, kernel, recipe",
    [(ao.fp8_grouped_mm, ao.FP8_KERNEL, FP8), (ao.mxfp8_grouped_mm, ao.MXFP8_KERNEL, MXFP8_E4M3)],
    ids=["fp8", "mxfp8"],
)
def test_torchao_paths_compute_the_emulation_over_reference_kernels(group_sizes, fn, kernel, recipe, monkeypatch):
    reference = reference_fp8 if recipe.kind == "fp8" else reference_mxfp8
    _fake_torchao(monkeypatch, **{kernel: reference})
    x, w, offsets = _inputs(group_sizes)
    expected = _fwd_bwd(partial(portable_kernels()[_op_of(recipe)], recipe=recipe), x, w, offsets)
    actual = _fwd_bwd(partial(fn, recipe=recipe), x, w, offsets)
    for got, want in zip(actual, expected, strict=True):
        assert torch.isfinite(got).all()
        assert _relative(got, want) < TOLERANCE
    for expert, size in enumerate(group_sizes):
        if size == 0:
            assert actual[2][expert].abs().sum() == 0


@pytest.mark.parametrize(
    "fn, recipe",
    [
        (ao.fp8_grouped_mm, MXFP8_E4M3),
        (ao.fp8_grouped_mm, LowPrecisionRecipe("fp8", E4M3, float_format("float8_e5m2"))),
        (ao.fp8_grouped_mm, LowPrecisionRecipe("fp8", *[float_format("float8_e4m3fnuz")] * 2)),
        (ao.mxfp8_grouped_mm, MXFP8_E5M2),
        (ao.mxfp8_grouped_mm, FP8),
    ],
    ids=["fp8-given-mxfp8", "fp8-e5m2-gradients", "fp8-fnuz", "mxfp8-e5m2-gradients", "mxfp8-given-fp8"],
)
def test_torchao_paths_refuse_recipes_their_kernels_cannot_compute(fn, recipe):
    x, w, offsets = _inputs([32])
    formats = f"the recipe is {recipe.kind} with {recipe.forward_format.dtype} forward and {recipe.grad_format.dtype}"
    with pytest.raises(ValueError, match=f"computes .* with torch.float8_e4m3fn for every operand.*; {formats}"):
        fn(x, w, offsets, recipe)


def test_a_recipe_the_kernel_cannot_compute_is_known_at_start_auto_falls_back_and_a_pin_is_refused():
    """ferry's MXFP8 recipe (E5M2 gradients) on torchao's E4M3-only kernel: under `auto` the run takes the
    portable emulation and says why; pinned, the run stops before training, naming the pin."""
    from ferry.kernels.selection import Choice, KernelSelection
    from ferry.precision.kernels import with_low_precision_experts

    selection = portable_kernels()
    torchao = next(impl for impl in REGISTRY["moe.mxfp8_grouped_mm"].vendor if impl.name == "torchao")

    def chosen(pinned: bool) -> KernelSelection:
        choice = Choice(torchao, "as if chosen on an SM100 GPU", torchao.fn, pinned)
        return KernelSelection("auto", "cuda", "cuda", {**selection.choices, "moe.mxfp8_grouped_mm": choice})

    assert torchao.recipe_refusal(MXFP8_E4M3) is None
    fallen_back = with_low_precision_experts(chosen(pinned=False), MXFP8_E5M2).choices["moe.mxfp8_grouped_mm"]
    assert fallen_back.implementation.portable
    assert fallen_back.reason.startswith("auto: torchao@cuda refuses the recipe: moe.mxfp8_grouped_mm torchao computes")
    with pytest.raises(UserError, match='kernels.ops."moe.mxfp8_grouped_mm": torchao@cuda cannot run this recipe'):
        with_low_precision_experts(chosen(pinned=True), MXFP8_E5M2)


def test_torchao_paths_name_widths_their_kernels_cannot_take():
    x, w, offsets = _inputs([32], width_in=48, width_out=64)
    with pytest.raises(UserError, match="torchao needs widths that are multiples of 32, got in 48 and out 64"):
        ao.mxfp8_grouped_mm(x, w, offsets, MXFP8_E4M3)


# --- on a GPU with torchao ------------------------------------------------------------------------------------


def _on_gpu(op: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (impl,) = REGISTRY[op].named("torchao")
    reason = impl.unavailable_reason(CUDA, torch.bfloat16)
    if reason is not None:
        pytest.skip(f"{op} torchao: {reason}")
    return impl.fn


@pytest.mark.parametrize("group_sizes", [[512, 640, 0, 384, 512], [37, 0, 301, 129, 5]], ids=["aligned", "ragged"])
def test_torchao_fp8_agrees_with_the_emulation_on_a_gpu(group_sizes):
    fn = _on_gpu("moe.fp8_grouped_mm")
    x, w, offsets = _inputs(group_sizes, width_in=256, width_out=128, device="cuda", dtype=torch.bfloat16)
    emulation = _fwd_bwd(partial(portable_kernels()["moe.fp8_grouped_mm"], recipe=FP8), x.float(), w.float(), offsets)
    exact = _fwd_bwd(portable_kernels()["moe.grouped_mm"], x.float(), w.float(), offsets)
    native = _fwd_bwd(partial(fn, recipe=FP8), x, w, offsets)
    for got, want, truth in zip(native, emulation, exact, strict=True):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert _relative(got, want) < FP8_TOLERANCE
        assert _relative(got, truth) < 1.25 * _relative(want, truth) + 1e-2


@pytest.mark.parametrize("group_sizes", [[512, 640, 0, 384, 512], [37, 0, 301, 129, 5]], ids=["aligned", "ragged"])
def test_torchao_mxfp8_agrees_with_the_emulation_on_a_gpu(group_sizes):
    fn = _on_gpu("moe.mxfp8_grouped_mm")
    x, w, offsets = _inputs(group_sizes, width_in=256, width_out=128, device="cuda", dtype=torch.bfloat16)
    emulation = portable_kernels()["moe.mxfp8_grouped_mm"]
    expected = _fwd_bwd(partial(emulation, recipe=MXFP8_E4M3), x.float(), w.float(), offsets)
    native = _fwd_bwd(partial(fn, recipe=MXFP8_E4M3), x, w, offsets)
    for got, want in zip(native, expected, strict=True):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert _relative(got, want) < MXFP8_TOLERANCE

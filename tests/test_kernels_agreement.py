"""Every implementation of every op computes what the portable one computes, forward and backward.

Tolerance: 1e-5 relative in fp32. Implementations differ only in the order of
floating-point sums (grouped vs per-expert matmuls, index_add vs gather-sum), which
moves results by a few ulps (observed: below 1e-6).

Accelerator implementations (CUDA, ROCm) run where such a device is present, in
bfloat16 as their kernels require (as do CPU implementations made for bfloat16), against the portable implementation
in fp32 on the same bfloat16-rounded inputs: tolerance 2e-2 relative, a few bfloat16 roundings
(2^-8 each) of the outputs and gradients. Their widths are multiples of 16, as FP8
GEMMs need.
"""

from __future__ import annotations

import pytest
import torch

from ferry.config import UserError
from ferry.kernels import REGISTRY, portable_kernels
from ferry.kernels.activation import GatedActivation
from ferry.kernels.selection import bind
from ferry.kernels.vendor import cpu_fused_experts, torch_grouped_mm
from ferry.platform.hardware import resolve_profile
from ferry.precision import PrecisionConfig, resolve_precision
from ferry.precision.formats import float_format
from ferry.precision.recipe import LowPrecisionRecipe

TOLERANCE = 1e-5
ACCELERATOR_TOLERANCE = 2e-2
CPU = torch.device("cpu")
T, D, F, E, K = 23, 16, 8, 5, 2


def _inputs(op_name: str, D: int = D, F: int = F) -> tuple[tuple, tuple[int, ...]]:
    """Fixed inputs of an op and the positions that take gradients; expert 3 receives no token."""
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator)

    scores_TE = randn(T, E).softmax(-1)
    scores_TE[:, 3] = -1.0
    weights_TK, expert_ids_TK = scores_TE.topk(K, dim=-1)
    counts_E = torch.bincount(expert_ids_TK.flatten(), minlength=E)
    x_TD = randn(T, D)
    w_gate_EFD, w_up_EFD, w_down_EDF = randn(E, F, D), randn(E, F, D), randn(E, D, F)
    x_ND, dispatch = portable_kernels()["moe.permute"](x_TD, expert_ids_TK)
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return {
        "norm.rms": ((randn(3, 7, D), randn(D), 1e-5), (0, 1)),
        "linear": ((randn(3, 7, D), randn(F, D)), (0, 1)),
        "attention": ((randn(2, 4, 9, 8), randn(2, 2, 9, 8), randn(2, 2, 9, 8)), (0, 1, 2)),
        "attention.masked": (
            (
                randn(2, 4, 5, 8),
                randn(2, 2, 9, 8),
                randn(2, 2, 9, 8),
                _decoding_visibility(pad_B=[0, 3], new=5, slots=9),
            ),
            (0, 1, 2),
        ),
        "moe.permute": ((x_TD, expert_ids_TK), (0,)),
        "moe.grouped_mm": ((x_ND.detach(), w_gate_EFD, offsets_E), (0, 1)),
        "moe.fp8_grouped_mm": ((x_ND.detach(), w_gate_EFD, offsets_E, _recipe("fp8")), (0, 1)),
        "moe.mxfp8_grouped_mm": ((x_ND.detach(), w_gate_EFD, offsets_E, _recipe("mxfp8")), (0, 1)),
        "moe.expert_mlp": ((x_ND.detach(), counts_E, w_gate_EFD, w_up_EFD, w_down_EDF), (0, 2, 3, 4)),
        "moe.biased_expert_mlp": (
            (
                x_ND.detach(),
                counts_E,
                w_gate_EFD,
                w_up_EFD,
                w_down_EDF,
                randn(E, F),
                randn(E, F),
                randn(E, D),
                GatedActivation("clamped_swiglu", limit=1.0),
            ),
            (0, 2, 3, 4, 5, 6, 7),
        ),
        "moe.combine": ((randn(T * K, D), weights_TK, dispatch), (0, 1)),
        "moe.routed_experts": (
            (x_TD, expert_ids_TK, weights_TK, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF),
            (0, 2, 4, 5, 6),
        ),
    }[op_name]


def _decoding_visibility(pad_B: list[int], new: int, slots: int) -> torch.Tensor:
    """The keys each of the last `new` slots may see in left-padded rows: from the row's first token to itself."""
    keys_T = torch.arange(slots)
    queries_S = torch.arange(slots - new, slots)
    first_B11 = torch.tensor(pad_B)[:, None, None]
    return (keys_T[None, None, :] <= queries_S[None, :, None]) & (keys_T[None, None, :] >= first_B11)


def _recipe(kind: str) -> LowPrecisionRecipe:
    grad = "float8_e4m3fn" if kind == "fp8" else "float8_e5m2"  # as the precision layer's recipes
    return LowPrecisionRecipe(kind, float_format("float8_e4m3fn"), float_format(grad))


def _run(
    fn, args: tuple, grad_args: tuple[int, ...], loss: str, grad_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The output and the gradient of every differentiable input, for a `sum` or a random-weighted loss.

    The random upstream gradient is rounded to `grad_dtype` when given, so that two runs
    in different dtypes start their backward from the same values.
    """
    leaves = [arg.detach().clone().requires_grad_() if i in grad_args else arg for i, arg in enumerate(args)]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    if loss == "sum":  # `.sum()` hands the backward an expanded, zero-stride gradient
        out.sum().backward()
    else:
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(grad_dtype or out.dtype)
        out.backward(upstream.to(out))
    return [out.detach()] + [leaves[i].grad for i in grad_args]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# torchao's kernels round their scales to powers of two, so they sit ~5% from the emulation on random data;
# tests/test_kernels_torchao.py holds them to bounds measured for that rounding
VENDOR = [
    pytest.param(impl, id=impl.key + " " + impl.op)
    for impl in REGISTRY.vendor_implementations()
    if impl.name != "torchao"
]


def _device_recipe(recipe: LowPrecisionRecipe, device: torch.device) -> LowPrecisionRecipe:
    """The recipe of the same kind in the formats of `device`'s hardware profile (FNUZ on MI300)."""
    config = PrecisionConfig(experts=recipe.kind, on_unsupported="emulate")
    try:
        profile = resolve_profile("auto", device)
    except UserError as exc:  # a GPU without a hardware profile: its FP8 variant is unknown
        pytest.skip(str(exc))
    return resolve_precision(config, profile).recipe


def _on(args: tuple, device: torch.device, dtype: torch.dtype) -> list:
    """The arguments on `device`, floating-point tensors in `dtype`; anything else as it is."""
    return [
        (arg.to(device, dtype) if arg.is_floating_point() else arg.to(device)) if isinstance(arg, torch.Tensor) else arg
        for arg in args
    ]


@pytest.mark.parametrize("loss", ["sum", "random"])
@pytest.mark.parametrize("impl", VENDOR)
def test_vendor_implementation_agrees_with_portable(impl, loss, monkeypatch):
    if impl.platform in ("cuda", "rocm"):
        if not torch.cuda.is_available():
            pytest.skip(f"{impl.key}: needs a CUDA or ROCm device")
        device, dtype, tolerance = torch.device("cuda"), torch.bfloat16, ACCELERATOR_TOLERANCE
        args, grad_args = _inputs(impl.op, D=32, F=16)
    elif impl.unavailable_reason(CPU, torch.float32) is not None:  # a CPU path for reduced precision only
        device, dtype, tolerance = CPU, torch.bfloat16, ACCELERATOR_TOLERANCE
        args, grad_args = _inputs(impl.op)
    else:
        device, dtype, tolerance = CPU, torch.float32, TOLERANCE
        args, grad_args = _inputs(impl.op)
    reason = impl.unavailable_reason(device, dtype)
    if reason is not None:
        pytest.skip(f"{impl.key}: {reason}")
    if device.type != "cpu":
        args = tuple(_device_recipe(arg, device) if isinstance(arg, LowPrecisionRecipe) else arg for arg in args)
    monkeypatch.setattr(cpu_fused_experts, "BLOCK_ROWS", 3)  # several blocks per expert: gradients accumulate
    args = _on(args, device, dtype)
    expected = _run(portable_kernels()[impl.op], _on(args, device, torch.float32), grad_args, loss, dtype)
    actual = _run(bind(impl, portable_kernels().functions), args, grad_args, loss, dtype)
    for got, want in zip(actual, expected, strict=True):
        assert _relative_error(got.float(), want) < tolerance


CPU_VENDOR = [param for param in VENDOR if param.values[0].platform == "cpu"]


@pytest.mark.parametrize("impl", CPU_VENDOR)
def test_cpu_implementations_agree_in_bfloat16_too(impl, monkeypatch):
    """A CPU run with `compute_dtype: bf16` takes other code paths (GEMM layouts, casts) than fp32."""
    reason = impl.unavailable_reason(CPU, torch.bfloat16)
    if reason is not None:
        pytest.skip(f"{impl.key}: {reason}")
    monkeypatch.setattr(cpu_fused_experts, "BLOCK_ROWS", 3)
    args, grad_args = _inputs(impl.op)
    args = _on(args, CPU, torch.bfloat16)
    expected = _run(portable_kernels()[impl.op], _on(args, CPU, torch.float32), grad_args, "random", torch.bfloat16)
    actual = _run(bind(impl, portable_kernels().functions), args, grad_args, "random", torch.bfloat16)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == torch.bfloat16
        assert _relative_error(got.float(), want) < ACCELERATOR_TOLERANCE


@pytest.mark.parametrize("op", REGISTRY.names)
def test_portable_implementation_runs_forward_and_backward(op):
    args, grad_args = _inputs(op)
    for tensor in _run(portable_kernels()[op], args, grad_args, "random"):
        assert torch.isfinite(tensor).all()


def test_grouped_mm_implementations_agree_with_a_per_row_reference():
    """The portable loop itself against row-by-row matmuls: the reference is right, not merely consistent."""
    args, _ = _inputs("moe.grouped_mm")
    x_NI, w_EOI, offsets_E = args
    expert_of_N = torch.searchsorted(offsets_E, torch.arange(x_NI.shape[0]), right=True)
    expected = torch.stack([w_EOI[e] @ x for e, x in zip(expert_of_N.tolist(), x_NI)])
    assert _relative_error(portable_kernels()["moe.grouped_mm"](x_NI, w_EOI, offsets_E), expected) < TOLERANCE


def test_the_biased_expert_mlp_is_each_rows_own_experts_gpt_oss_mlp_and_without_biases_the_swiglus():
    """Row by row: its expert's gate and up with their biases, GPT-OSS's clamp and gating, the down projection and
    its bias; with no biases and the plain activation, exactly `moe.expert_mlp`."""
    args, _ = _inputs("moe.biased_expert_mlp")
    x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation = args
    got = portable_kernels()["moe.biased_expert_mlp"](*args)
    expert_of_N = torch.repeat_interleave(torch.arange(E), counts_E).tolist()
    rows = []
    for e, x_D in zip(expert_of_N, x_ND):
        gate_F = (w_gate_EFD[e] @ x_D + b_gate_EF[e]).clamp(max=1.0)
        up_F = (w_up_EFD[e] @ x_D + b_up_EF[e]).clamp(-1.0, 1.0)
        rows.append(w_down_EDF[e] @ (gate_F * torch.sigmoid(1.702 * gate_F) * (up_F + 1)) + b_down_ED[e])
    assert _relative_error(got, torch.stack(rows)) < TOLERANCE
    plain = portable_kernels()["moe.biased_expert_mlp"](
        x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, None, None, None, GatedActivation()
    )
    assert torch.equal(plain, portable_kernels()["moe.expert_mlp"](x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF))


def test_torch_grouped_mm_rejects_misaligned_bfloat16_widths_by_name():
    x_NI = torch.randn(4, 12, dtype=torch.bfloat16)
    w_EOI = torch.randn(2, 8, 12, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="multiples of 8 torch.bfloat16 values"):
        torch_grouped_mm.grouped_mm(x_NI, w_EOI, torch.tensor([2, 4], dtype=torch.int32))

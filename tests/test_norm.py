"""The portable RMSNorm's own backward against autograd's backward of the plain formula."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.portable.norm import rms_norm

EPS = 1e-5


def formula(x_XD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    x32_XD = x_XD.float()
    return weight_D * (x32_XD * torch.rsqrt(x32_XD.pow(2).mean(-1, keepdim=True) + eps)).to(x_XD.dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gradients(norm, x, weight, grad):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = norm(x, weight, EPS)
    out.backward(grad)
    return out, x.grad, weight.grad


@pytest.mark.parametrize(
    "shape, x_dtype, tolerance",
    [
        ((2, 5, 48), torch.float32, 1e-6),  # hidden states [B, S, D]
        ((2, 5, 3, 16), torch.float32, 1e-6),  # per-head query norm: [B, S, H, C] against a weight [C]
        ((2, 5, 48), torch.bfloat16, 4e-3),  # an activation under autocast (bf16 rounding); the weight stays fp32
    ],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_forward_equals_the_formula_and_gradients_equal_autograds(shape, x_dtype, tolerance, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=generator) + 0.5).to(device, x_dtype)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=generator).to(device)
    grad = torch.randn(shape, generator=generator).to(device)

    out, grad_x, grad_weight = gradients(rms_norm, x, weight, grad)
    reference_out, reference_grad_x, reference_grad_weight = gradients(formula, x, weight, grad)

    assert out.dtype == reference_out.dtype and torch.equal(out, reference_out)
    assert grad_x.dtype == x_dtype and grad_weight.dtype == torch.float32
    assert relative_error(grad_x, reference_grad_x) < tolerance
    assert relative_error(grad_weight, reference_grad_weight) < 1e-6


def test_a_strided_input_and_a_frozen_weight():
    """A slice of a wider projection (the queries of the fused query/key/value GEMM), weight not trained."""
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 6, 96, generator=generator)
    weight = torch.rand(32, generator=generator) + 0.5
    grad = torch.randn(4, 6, 32, generator=generator)
    x = wide[..., 32:64].detach().requires_grad_()
    rms_norm(x, weight, EPS).backward(grad)
    x_reference = wide[..., 32:64].contiguous().requires_grad_()
    formula(x_reference, weight, EPS).backward(grad)
    assert relative_error(x.grad, x_reference.grad) < 1e-6


def test_backward_keeps_the_input_and_one_statistic_a_row():
    """What forward leaves for backward: the input (which the residual stream holds anyway) and rstd,
    where autograd's formula keeps the normalised activation too."""
    x = torch.randn(8, 64, requires_grad=True)
    weight = torch.ones(64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, weight, EPS)
    new_elements = sum(t.numel() for t in saved if t.data_ptr() not in (x.data_ptr(), weight.data_ptr()))
    assert new_elements == 8  # one rstd a row

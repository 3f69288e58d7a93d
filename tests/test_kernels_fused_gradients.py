"""The fused CPU expert path writes weight gradients into kept `.grad` buffers: same values, reused memory.

Tolerance: 1e-5 relative in fp32 against the portable composition, as in
test_kernels_agreement.py (the two differ only in the order of sums).
"""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import portable_kernels
from ferry.kernels.vendor import cpu_fused_experts

TOLERANCE = 1e-5
T, D, F, E, K = 37, 16, 8, 6, 2


def _problem(seed: int):
    """Routing in which expert 3 receives no token, and the three expert weights as leaf parameters."""
    generator = torch.Generator().manual_seed(seed)
    scores_TE = torch.randn(T, E, generator=generator).softmax(-1)
    scores_TE[:, 3] = -1.0
    weights_TK, expert_ids_TK = scores_TE.topk(K, dim=-1)
    counts_E = torch.bincount(expert_ids_TK.flatten(), minlength=E)
    x_TD = torch.randn(T, D, generator=generator)
    return x_TD, expert_ids_TK, weights_TK, counts_E


def _weights(seed: int = 7) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in ((E, F, D), (E, F, D), (E, D, F))]


def _backward(fn, weights, seeds, transform=lambda w: w) -> None:
    for seed in seeds:
        x_TD, expert_ids_TK, weights_TK, counts_E = _problem(seed)
        out = fn(x_TD, expert_ids_TK, weights_TK, counts_E, *(transform(w) for w in weights))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100)))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a - b).norm() / b.norm()).item() < TOLERANCE


@pytest.fixture(autouse=True)
def several_blocks_per_expert(monkeypatch):
    monkeypatch.setattr(cpu_fused_experts, "BLOCK_ROWS", 3)


def test_gradients_accumulate_over_micro_batches_like_autograd():
    fused, reference = _weights(), _weights()
    _backward(cpu_fused_experts.routed_experts, fused, seeds=(1, 2))
    _backward(portable_kernels()["moe.routed_experts"], reference, seeds=(1, 2))
    for ours, theirs in zip(fused, reference, strict=True):
        assert _close(ours.grad, theirs.grad)
        assert torch.equal(ours.grad[3], torch.zeros_like(ours.grad[3]))  # expert 3 never had a token


def test_the_kept_buffer_is_reused_after_zero_grad_and_overwritten():
    fused, reference = _weights(), _weights()
    _backward(cpu_fused_experts.routed_experts, fused, seeds=(1,))
    first_storage = [w.grad.data_ptr() for w in fused]
    for w in fused:
        w.grad = None  # what zero_grad(set_to_none=True) does
    _backward(cpu_fused_experts.routed_experts, fused, seeds=(2,))
    _backward(portable_kernels()["moe.routed_experts"], reference, seeds=(2,))
    assert [w.grad.data_ptr() for w in fused] == first_storage
    for ours, theirs in zip(fused, reference, strict=True):
        assert _close(ours.grad, theirs.grad)  # step 1's values are gone, not added to
        assert torch.equal(ours.grad[3], torch.zeros_like(ours.grad[3]))


def test_a_weight_that_is_not_a_leaf_gets_its_gradient_through_autograd():
    fused, reference = _weights(), _weights()
    _backward(cpu_fused_experts.routed_experts, fused, seeds=(1,), transform=lambda w: w * 2.0)
    _backward(portable_kernels()["moe.routed_experts"], reference, seeds=(1,), transform=lambda w: w * 2.0)
    for ours, theirs in zip(fused, reference, strict=True):
        assert _close(ours.grad, theirs.grad)
        assert not hasattr(ours, cpu_fused_experts._KEPT_GRAD)


def test_a_retained_graph_whose_activations_were_reused_is_refused_not_corrupted():
    weights = _weights()
    x_TD, expert_ids_TK, weights_TK, counts_E = _problem(1)
    retained = cpu_fused_experts.routed_experts(x_TD, expert_ids_TK, weights_TK, counts_E, *weights)
    retained.sum().backward(retain_graph=True)
    _backward(cpu_fused_experts.routed_experts, weights, seeds=(2,))  # takes the handed-back activation buffer
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        retained.sum().backward()


def test_a_second_backward_of_a_retained_graph_hands_its_buffers_back_once():
    weights = _weights()
    x_TD, expert_ids_TK, weights_TK, counts_E = _problem(1)
    retained = cpu_fused_experts.routed_experts(x_TD, expert_ids_TK, weights_TK, counts_E, *weights)
    retained.sum().backward(retain_graph=True)
    retained.sum().backward()  # no forward in between: allowed, and it reads what it saved
    pooled = [id(buffer) for spare in cpu_fused_experts._SPARE_ACTIVATIONS._spare.values() for buffer in spare]
    assert len(pooled) == len(set(pooled)) == 2


def test_autograd_grad_and_hooks_get_the_weight_gradients_through_autograd():
    fused, reference = _weights(), _weights()
    x_TD, expert_ids_TK, weights_TK, counts_E = _problem(1)
    out = cpu_fused_experts.routed_experts(x_TD, expert_ids_TK, weights_TK, counts_E, *fused)
    expected_out = portable_kernels()["moe.routed_experts"](x_TD, expert_ids_TK, weights_TK, counts_E, *reference)
    grads = torch.autograd.grad(out.square().sum(), fused)
    expected = torch.autograd.grad(expected_out.square().sum(), reference)
    for got, want, weight in zip(grads, expected, fused, strict=True):
        assert got is not None and _close(got, want)
        assert weight.grad is None  # autograd.grad accumulates nothing
    hooked = _weights()
    seen = []
    hooked[0].register_hook(lambda grad: seen.append(grad.norm()) or grad * 0.0)
    _backward(cpu_fused_experts.routed_experts, hooked, seeds=(1,))
    assert len(seen) == 1 and seen[0] > 0 and torch.equal(hooked[0].grad, torch.zeros_like(hooked[0].grad))


def _bf16_gradients(monkeypatch, quantum: int, poisoned: bool) -> list[torch.Tensor]:
    """Output and every gradient of a bfloat16 forward and backward, blocks padded to `quantum` rows; `poisoned`:
    every buffer the pool hands out starts as NaN, as stale rows of an earlier step might."""
    monkeypatch.setattr(cpu_fused_experts, "REDUCED_ROW_QUANTUM", quantum)
    if poisoned:

        def nan_filled(shape, dtype):
            return torch.full(shape, float("nan"), dtype=dtype)

        monkeypatch.setattr(cpu_fused_experts._SPARE_ACTIVATIONS, "take", nan_filled)
    x_TD, expert_ids_TK, weights_TK, counts_E = _problem(1)
    x_TD = x_TD.to(torch.bfloat16).requires_grad_()
    weights_TK = weights_TK.to(torch.bfloat16).requires_grad_()
    experts = [w.detach().to(torch.bfloat16).requires_grad_() for w in _weights()]
    out_TD = cpu_fused_experts.routed_experts(x_TD, expert_ids_TK, weights_TK, counts_E, *experts)
    out_TD.float().square().sum().backward()
    return [out_TD.detach(), x_TD.grad, weights_TK.grad, *(w.grad for w in experts)]


def test_padded_blocks_in_bfloat16_give_the_exact_blocks_results(monkeypatch):
    """Padding rows hold zeros or the next block's rows, never stale memory, and add nothing to any gradient: with
    blocks of 3 rows padded to 4, and every pooled buffer starting as NaN, the results equal unpadded blocks'."""
    exact = _bf16_gradients(monkeypatch, quantum=1, poisoned=False)
    padded = _bf16_gradients(monkeypatch, quantum=4, poisoned=True)
    for ours, theirs in zip(padded, exact, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=0.0, atol=0.0)


def test_bfloat16_gemms_take_row_counts_in_multiples_of_the_quantum(monkeypatch):
    """What keeps oneDNN's per-shape GEMMs cached: every expert GEMM's row count (the weight gradients' inner
    dimension) is a multiple of the quantum, however ragged the experts' loads; float32 keeps exact rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RowCounts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "aten.mm":
                self.rows.append(args[0].shape[0])
            elif name == "aten.addmm_" and args[0].shape[0] == F:  # an expert's weight gradient: rows are inner
                self.rows.append(args[1].shape[1])
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(cpu_fused_experts, "BLOCK_ROWS", 8)
    for dtype, quantum in ((torch.bfloat16, cpu_fused_experts.REDUCED_ROW_QUANTUM), (torch.float32, 1)):
        x_TD, expert_ids_TK, weights_TK, counts_E = _problem(2)
        experts = [w.detach().to(dtype).requires_grad_() for w in _weights()]
        inputs = (x_TD.to(dtype), expert_ids_TK, weights_TK.to(dtype), counts_E)
        with RowCounts() as recorded:
            out = cpu_fused_experts.routed_experts(*inputs, *experts)
            out.float().sum().backward()
        assert recorded.rows and all(rows % quantum == 0 for rows in recorded.rows), (dtype, recorded.rows)
        if quantum == 1:
            assert sorted(set(recorded.rows)) != [8], "float32 blocks keep their ragged sizes"

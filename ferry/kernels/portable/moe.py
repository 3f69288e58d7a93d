"""Portable MoE ops: pure PyTorch, correct on every device.

Every row move is an `index_select` (a gather): the permutation gathers tokens
into expert order, the combine gathers expert outputs back into token order, and
each backward gathers along the opposite map (`Dispatch` keeps both). A gather
writes each output row once, so it parallelises without atomics and is
deterministic, which an `index_add_` scatter is not on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.activation import GatedActivation
from ferry.kernels.amp import outside_autocast
from ferry.kernels.dispatch import Dispatch, group_sizes, reads_group_sizes_on_host


def permute(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[torch.Tensor, Dispatch]:
    """Rows of `x_TD` copied into expert order (stable: tokens keep their order within an expert)."""
    top_k = expert_ids_TK.shape[1]
    order_N = torch.argsort(expert_ids_TK.flatten(), stable=True)
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    token_of_N = torch.div(order_N, top_k, rounding_mode="floor")
    dispatch = Dispatch(order_N=order_N, token_of_N=token_of_N, inverse_N=inverse_N, top_k=top_k)
    return _GatherTokens.apply(x_TD, dispatch), dispatch


@reads_group_sizes_on_host
@outside_autocast
def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e times w[e].T, one matmul per expert (the reference every other one must meet)."""
    return loop_grouped_mm(x_NI, w_EOI, offsets_E)


def loop_grouped_mm(
    x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, input_grad_weight=None
) -> torch.Tensor:
    """`grouped_mm`; `input_grad_weight(w_OI)`, when given, lays out each weight for the input gradient's GEMM."""
    return _LoopGroupedMM.apply(x_NI, w_EOI, offsets_E, input_grad_weight)


def expert_mlp(
    x_ND: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    grouped_mm,
) -> torch.Tensor:
    """Each expert's SwiGLU on its group of expert-sorted rows, on the selected `moe.grouped_mm`."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    gate_NF = grouped_mm(x_ND, w_gate_EFD, offsets_E)
    up_NF = grouped_mm(x_ND, w_up_EFD, offsets_E)
    return grouped_mm(F.silu(gate_NF) * up_NF, w_down_EDF, offsets_E)


def biased_expert_mlp(
    x_ND: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    b_gate_EF: torch.Tensor | None,
    b_up_EF: torch.Tensor | None,
    b_down_ED: torch.Tensor | None,
    activation: GatedActivation,
    *,
    grouped_mm,
) -> torch.Tensor:
    """`moe.expert_mlp` with each expert's biases (`b_gate_EF`, `b_up_EF`, `b_down_ED`; each may be None) added to
    its rows' projections, and `activation` between them (GPT-OSS's experts). Each row's bias is its expert's,
    gathered by the row's expert."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    expert_N = torch.repeat_interleave(
        torch.arange(tokens_per_expert_E.numel(), device=x_ND.device), tokens_per_expert_E, output_size=x_ND.shape[0]
    )

    def biased(y_NX: torch.Tensor, b_EX: torch.Tensor | None) -> torch.Tensor:
        return y_NX if b_EX is None else y_NX + b_EX.index_select(0, expert_N)

    gate_NF = biased(grouped_mm(x_ND, w_gate_EFD, offsets_E), b_gate_EF)
    up_NF = biased(grouped_mm(x_ND, w_up_EFD, offsets_E), b_up_EF)
    return biased(grouped_mm(activation(gate_NF, up_NF), w_down_EDF, offsets_E), b_down_ED)


@outside_autocast
def combine(y_ND: torch.Tensor, weights_TK: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """out[t] = sum over k of weights[t, k] * (the sorted row of assignment t * K + k)."""
    return _Combine.apply(y_ND, weights_TK, dispatch)


def routed_experts(
    x_TD: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    permute,
    expert_mlp,
    combine,
) -> torch.Tensor:
    """The routed path on one device: the selected `moe.permute`, `moe.expert_mlp` and `moe.combine`.

    They are separate ops because expert parallelism moves the sorted rows to other
    ranks between them; on one device they run back to back.
    """
    x_ND, dispatch = permute(x_TD, expert_ids_TK)
    y_ND = expert_mlp(x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF)
    return combine(y_ND, weights_TK, dispatch)


class _GatherTokens(torch.autograd.Function):
    """x_ND = x_TD[token_of_N]; backward sums each token's K rows, found through `inverse_N`."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
        ctx.dispatch = dispatch
        return x_TD.index_select(0, dispatch.token_of_N)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        dispatch: Dispatch = ctx.dispatch
        grad_TKD = grad_ND.index_select(0, dispatch.inverse_N).view(dispatch.num_tokens, dispatch.top_k, -1)
        return grad_TKD.sum(dim=1), None


class _Combine(torch.autograd.Function):
    """Weighted sum of each token's K expert outputs, with a backward made of gathers only."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, weights_TK: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
        ctx.save_for_backward(y_ND, weights_TK)
        ctx.dispatch = dispatch
        y_TKD = y_ND.index_select(0, dispatch.inverse_N).view(*weights_TK.shape, -1)
        return torch.bmm(weights_TK.unsqueeze(1), y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_ND, weights_TK = ctx.saved_tensors
        dispatch: Dispatch = ctx.dispatch
        grad_ND = grad_TD.index_select(0, dispatch.token_of_N)
        grad_weights_TK = None
        if ctx.needs_input_grad[1]:
            grad_weight_N = torch.linalg.vecdot(grad_ND, y_ND)
            grad_weights_TK = grad_weight_N.index_select(0, dispatch.inverse_N).view_as(weights_TK)
        grad_y_ND = None
        if ctx.needs_input_grad[0]:
            weight_N = weights_TK.flatten().index_select(0, dispatch.order_N)
            grad_y_ND = grad_ND.mul_(weight_N.unsqueeze(1))
        return grad_y_ND, grad_weights_TK, None


class _LoopGroupedMM(torch.autograd.Function):
    """Per-expert `torch.mm` into slices of one preallocated output, forward and backward.

    The group sizes are read on the host once per call (a device sync on accelerators)
    and kept for the backward.
    """

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, input_grad_weight):
        sizes = group_sizes(offsets_E)
        ctx.save_for_backward(x_NI, w_EOI)
        ctx.sizes = sizes
        ctx.input_grad_weight = input_grad_weight
        y_NO = x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])
        for x_MI, w_OI, y_MO in zip(x_NI.split(sizes), w_EOI, y_NO.split(sizes)):
            torch.mm(x_MI, w_OI.t(), out=y_MO)
        return y_NO

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_NI, w_EOI = ctx.saved_tensors
        sizes = ctx.sizes
        grad_NO = grad_NO.contiguous()
        grad_x_NI = grad_w_EOI = None
        if ctx.needs_input_grad[0]:
            grad_x_NI = torch.empty_like(x_NI)
            for grad_MO, w_OI, grad_x_MI in zip(grad_NO.split(sizes), w_EOI, grad_x_NI.split(sizes)):
                torch.mm(grad_MO, ctx.input_grad_weight(w_OI) if ctx.input_grad_weight else w_OI, out=grad_x_MI)
        if ctx.needs_input_grad[1]:
            grad_w_EOI = torch.empty_like(w_EOI)
            for grad_MO, x_MI, grad_w_OI in zip(grad_NO.split(sizes), x_NI.split(sizes), grad_w_EOI):
                torch.mm(grad_MO.t(), x_MI, out=grad_w_OI)
        return grad_x_NI, grad_w_EOI, None, None

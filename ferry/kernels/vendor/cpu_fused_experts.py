"""`moe.routed_experts` for CPUs: one pass over the experts that keeps each expert's rows in cache.

The portable composition materialises every intermediate for all N = T*K rows at
once: the permuted tokens, the gate, up and down outputs, their gradients. On a
CPU each is a fresh allocation of tens of megabytes whose first touch costs page
faults, and in the VMs ferry is developed on those cost as much as the matmuls
beside them. Here each expert gathers its own tokens in blocks of at most
`BLOCK_ROWS` rows, runs gate, up, SwiGLU and down while the block sits in cache,
and adds its weighted output straight into the token-ordered result; only the
gate and up activations, which the backward needs, span all rows. The backward
walks the blocks again and recomputes the cheap elementwise parts. A loop of many
small kernels is the wrong shape for a GPU, hence: CPU only. In bfloat16/float16 the input
gradient's GEMMs take a column-major copy of each expert's weight (the
row-major layout runs at a tenth of the speed on CPUs without bfloat16 units: `cpu_gemm_layout`).

The weight-gradient GEMMs accumulate straight into the parameters' `.grad` (as
Megatron's fused weight-gradient accumulation does), into one buffer per parameter
that is kept across steps: `zero_grad(set_to_none=True)` drops the reference, the
next backward takes the same memory again (so a reference kept to an earlier step's
`.grad` sees it overwritten). Only where the backward would accumulate into `.grad`
anyway: `torch.autograd.grad`, `backward(inputs=...)` without the weight and tensor
hooks on it get the gradient through autograd, and so do the autocast copies of the
weights that a layer under autocast passes in (fp32 parameters, bf16 compute): that
case keeps correct gradients but not the saving. Returning fresh gradients through
autograd instead maps 3 x E x F x D new floats every step (192 MB at 128 experts),
and their page faults cost as much as the weight-gradient GEMMs themselves. A weight
that is not a leaf (a view) gets its gradient through autograd. A sharding wrapper
that drops `.grad` after reducing it (FSDP) leaves the kept buffer in place: on a CPU
its unsharded expert gradients stay allocated between steps.

For the same reason the activations saved for the backward (the gathered token rows
and the gate and up outputs) come from a pool: a finished backward hands its buffers
back, and the next forward of the same size takes them. Keeping the gathered rows
costs N x D floats per layer in flight and saves the backward from gathering them
again. Were a retained graph's backward run again after another forward had reused
the buffers, autograd's version check on saved tensors would refuse it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ferry.kernels.amp import outside_autocast
from ferry.kernels.dispatch import reads_group_sizes_on_host
from ferry.kernels.vendor.cpu_gemm_layout import REDUCED_DTYPES, fast_right_operand

# Large enough for full-speed matmuls, small enough that a block's temporaries stay in cache
# and are recycled by the allocator instead of being mapped afresh.
BLOCK_ROWS = 1024
# In bfloat16/float16 a CPU matmul runs a oneDNN primitive made for its exact shape and cached by it, and making one
# costs more than a 512-row product: ragged expert blocks, a new row count nearly every call, ran the experts'
# GEMMs at 140 GFLOP/s where repeated shapes reach 330 (2 cores with AVX-512 BF16). Each block's GEMMs therefore
# take its rows rounded up to a multiple of this, so a step's shapes repeat and stay cached; the padding rows are
# zeros (or the next block's rows, whose results the next block overwrites) and add nothing to any gradient.
# float32 runs MKL's GEMM, which makes nothing per shape: exact rows there.
REDUCED_ROW_QUANTUM = 32


@reads_group_sizes_on_host
@outside_autocast
def routed_experts(
    x_TD: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    return _FusedExperts.apply(x_TD, expert_ids_TK, weights_TK, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF)


class _FusedExperts(torch.autograd.Function):
    """Forward and backward by blocks of one expert's rows; gradients of the same inputs as the portable op."""

    @staticmethod
    def forward(ctx, x_TD, expert_ids_TK, weights_TK, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF):
        top_k = expert_ids_TK.shape[1]
        order_N = torch.argsort(expert_ids_TK.flatten(), stable=True)
        token_of_N = torch.div(order_N, top_k, rounding_mode="floor")
        assignments, quantum = order_N.numel(), _row_quantum(x_TD.dtype)
        padded_rows = assignments + quantum - 1  # room for the last block's padding
        weight_N1 = weights_TK.new_zeros(padded_rows, 1)
        weight_N1[:assignments, 0] = weights_TK.flatten().index_select(0, order_N)
        sizes = tokens_per_expert_E.tolist()
        _SPARE_ACTIVATIONS.serve_rows(assignments)
        activations_2NF = _SPARE_ACTIVATIONS.take((2, padded_rows, w_gate_EFD.shape[1]), x_TD.dtype)
        gate_NF, up_NF = activations_2NF
        x_ND = _SPARE_ACTIVATIONS.take((padded_rows, x_TD.shape[1]), x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        for expert, _, block in _blocks(sizes):
            tokens_M, padded = token_of_N[block], _padded(block, quantum)
            torch.index_select(x_TD, 0, tokens_M, out=x_ND[block])
            x_ND[block.stop : padded.stop].zero_()  # padding rows: the next block's, not gathered yet, or spare
            x_PD = x_ND[padded]
            gate_PF = torch.mm(x_PD, w_gate_EFD[expert].t(), out=gate_NF[padded])
            up_PF = torch.mm(x_PD, w_up_EFD[expert].t(), out=up_NF[padded])
            y_PD = torch.mm(F.silu(gate_PF).mul_(up_PF), w_down_EDF[expert].t())
            out_TD.index_add_(0, tokens_M, y_PD[: len(tokens_M)].mul_(weight_N1[block]))
        ctx.save_for_backward(x_ND, order_N, token_of_N, weight_N1, activations_2NF, w_gate_EFD, w_up_EFD, w_down_EDF)
        ctx.x_shape = x_TD.shape
        ctx.sizes = sizes
        ctx.weights_shape = weights_TK.shape
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        x_ND, order_N, token_of_N, weight_N1, activations_2NF, w_gate_EFD, w_up_EFD, w_down_EDF = ctx.saved_tensors
        gate_NF, up_NF = activations_2NF
        quantum = _row_quantum(x_ND.dtype)
        grad_TD = grad_TD.contiguous()
        grad_x_TD = grad_TD.new_zeros(ctx.x_shape)
        longest_block = _rounded(min(BLOCK_ROWS, order_N.numel()), quantum)
        grad_out_buffer_PD = grad_TD.new_empty(longest_block, grad_TD.shape[1])
        grad_weight_N = weight_N1.new_empty(x_ND.shape[0])
        targets = [_WeightGradient(weight) for weight in (w_gate_EFD, w_up_EFD, w_down_EDF)]
        grad_gate_EFD, grad_up_EFD, grad_down_EDF = (target.tensor for target in targets)
        for expert, size in enumerate(ctx.sizes):
            if size == 0:
                for target in targets:
                    target.zero_expert(expert)
        column_major = w_down_EDF.dtype in REDUCED_DTYPES  # the input gradient's GEMMs want it (cpu_gemm_layout)
        for expert, first, block in _blocks(ctx.sizes):
            beta = 0.0 if first else 1.0  # an expert's first block writes its weight gradients, later ones add
            tokens_M, padded = token_of_N[block], _padded(block, quantum)
            rows = len(tokens_M)
            x_PD = x_ND[padded]
            # zero output gradients on the padding rows: every gradient computed from them is zero there
            grad_out_PD = grad_out_buffer_PD[: padded.stop - padded.start]
            torch.index_select(grad_TD, 0, tokens_M, out=grad_out_PD[:rows])
            grad_out_PD[rows:].zero_()
            gate_PF, up_PF, weight_P1 = gate_NF[padded], up_NF[padded], weight_N1[padded]
            silu_PF = F.silu(gate_PF)
            hidden_PF = silu_PF * up_PF
            w_down_DF, w_gate_FD, w_up_FD = w_down_EDF[expert], w_gate_EFD[expert], w_up_EFD[expert]
            if column_major:
                w_down_DF, w_gate_FD, w_up_FD = map(fast_right_operand, (w_down_DF, w_gate_FD, w_up_FD))
            # the gradient at the hidden layer before the routing weight also yields the weight's gradient
            grad_hidden_PF = torch.mm(grad_out_PD, w_down_DF)
            torch.linalg.vecdot(grad_hidden_PF, hidden_PF, out=grad_weight_N[padded])
            grad_down_EDF[expert].addmm_(grad_out_PD.t(), hidden_PF.mul_(weight_P1), beta=targets[2].beta(beta))
            grad_hidden_PF.mul_(weight_P1)
            grad_up_PF = grad_hidden_PF * silu_PF
            grad_gate_PF = torch.ops.aten.silu_backward(grad_hidden_PF.mul_(up_PF), gate_PF)
            grad_gate_EFD[expert].addmm_(grad_gate_PF.t(), x_PD, beta=targets[0].beta(beta))
            grad_up_EFD[expert].addmm_(grad_up_PF.t(), x_PD, beta=targets[1].beta(beta))
            grad_x_PD = torch.mm(grad_gate_PF, w_gate_FD).addmm_(grad_up_PF, w_up_FD)
            grad_x_TD.index_add_(0, tokens_M, grad_x_PD[:rows])
        grad_weights_TK = grad_weight_N.new_empty(order_N.numel())
        grad_weights_TK[order_N] = grad_weight_N[: order_N.numel()]
        if not getattr(ctx, "handed_back", False):  # a retained graph's second backward must not hand back twice
            ctx.handed_back = True
            _SPARE_ACTIVATIONS.give_back(activations_2NF)
            _SPARE_ACTIVATIONS.give_back(x_ND)
        return (
            grad_x_TD,
            None,
            grad_weights_TK.view(ctx.weights_shape),
            None,
            *(target.returned for target in targets),
        )


class _SparePool:
    """Activation buffers handed back by a finished backward, for the next forward of the same size.

    It holds buffers for one row count only: a forward with another count (a new batch
    size, a shorter last micro-batch) lets the others go, so the pool never holds more
    than the largest set of buffers a step had in flight.
    """

    def __init__(self):
        self._spare: dict[tuple, list[torch.Tensor]] = {}
        self._rows: int | None = None

    def serve_rows(self, rows: int) -> None:
        if rows != self._rows:
            self._spare.clear()
            self._rows = rows

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        spare = self._spare.get((shape, dtype))
        return spare.pop() if spare else torch.empty(shape, dtype=dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._spare.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)


_SPARE_ACTIVATIONS = _SparePool()


# The attribute that holds a parameter's kept weight-gradient buffer (as Megatron keeps `main_grad`
# on the parameter): it lives exactly as long as the parameter.
_KEPT_GRAD = "ferry_kept_grad"


class _WeightGradient:
    """Where one expert weight's gradient is written, and what the backward hands to autograd.

    A leaf parameter's gradient goes into `.grad` directly: added to it when it holds
    one (gradient accumulation over micro-batches), else written into the parameter's
    kept buffer, which becomes its `.grad`; autograd then gets None for it. Any other
    weight gets a fresh tensor through autograd.
    """

    def __init__(self, weight: torch.Tensor):
        direct = weight.is_leaf and weight.requires_grad and _engine_accumulates(weight)
        existing = weight.grad if direct else None
        self.accumulate = existing is not None and _fits(existing, weight) and existing.is_contiguous()
        if self.accumulate:
            self.tensor = existing
        elif direct and existing is None:
            buffer = getattr(weight, _KEPT_GRAD, None)
            if buffer is None or not _fits(buffer, weight):
                buffer = torch.empty_like(weight, memory_format=torch.contiguous_format)
                setattr(weight, _KEPT_GRAD, buffer)
            weight.grad = buffer
            self.tensor = buffer
        else:
            direct = False
            self.tensor = torch.empty_like(weight, memory_format=torch.contiguous_format)
        self.returned = None if direct else self.tensor

    def beta(self, block_beta: float) -> float:
        """The GEMM's beta: an expert's first block overwrites a fresh gradient and adds to an existing one."""
        return 1.0 if self.accumulate else block_beta

    def zero_expert(self, expert: int) -> None:
        """An expert without tokens has a zero gradient: written into a fresh one, nothing added to an existing one."""
        if not self.accumulate:
            self.tensor[expert].zero_()


def _engine_accumulates(weight: torch.Tensor) -> bool:
    """Will this backward accumulate into `weight.grad`, with no tensor hook to see the gradient first?

    Not under `torch.autograd.grad` (which returns gradients instead of accumulating
    them), nor when `backward(inputs=...)` leaves the weight out, nor with a hook
    registered on the weight: there the gradient must travel through autograd.
    """
    if weight._backward_hooks:
        return False
    with torch.enable_grad():
        accumulate_node = weight.view_as(weight).grad_fn.next_functions[0][0]
    try:
        return torch._C._will_engine_execute_node(accumulate_node)
    except RuntimeError:  # torch refuses leaves while torch.autograd.grad runs, which fills no .grad
        return False


def _fits(gradient: torch.Tensor, weight: torch.Tensor) -> bool:
    return gradient.shape == weight.shape and gradient.dtype == weight.dtype and gradient.device == weight.device


def _row_quantum(dtype: torch.dtype) -> int:
    """Rows a block's GEMMs are rounded up to in `dtype` (1: exact)."""
    return REDUCED_ROW_QUANTUM if dtype in REDUCED_DTYPES else 1


def _padded(block: slice, quantum: int) -> slice:
    """`block` with its rows rounded up to a multiple of `quantum`: the rows after it are the next block's or spare."""
    return slice(block.start, block.start + _rounded(block.stop - block.start, quantum))


def _rounded(rows: int, quantum: int) -> int:
    return -(-rows // quantum) * quantum


def _blocks(sizes: list[int]) -> Iterator[tuple[int, bool, slice]]:
    """(expert, whether it is the expert's first block, row slice) over every block of every expert."""
    start = 0
    for expert, size in enumerate(sizes):
        for offset in range(0, size, BLOCK_ROWS):
            yield expert, offset == 0, slice(start + offset, start + min(offset + BLOCK_ROWS, size))
        start += size

"""`moe.fp8_grouped_mm` on `torch._scaled_grouped_mm`: FP8 elements, fp32 row-wise scales, one call per GEMM.

torch's FP8 grouped GEMM runs on compute capability 9.0 (H100, H200; not SM100,
where torch offers MXFP8 instead) and on AMD MI300X/MI325X (gfx942), and takes E4M3
elements for both operands (OCP on NVIDIA, FNUZ on AMD), gradients included. It takes
the left operand row-major and the right one column-major, one dequantization scale
per row of each, and for the weight gradient (groups along the reduction dim,
"2d x 2d") one scale per row and group, group-major. Its reduction-dim groups must be
multiples of 16 rows, so this implementation pads token groups with zero rows there,
which add nothing to a sum. The recipe quantizes, exactly as the portable emulation
does; only the GEMM differs. Nothing is read back to the host: the padded size is a bound
from the shapes and the number of weight-gradient scale groups is the number of experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferry.kernels.amp import outside_autocast
from ferry.kernels.registry import RecipeRefused

GROUP_ALIGN_ROWS = 16
# The element format torch's row-wise FP8 grouped GEMM takes, for both operands: OCP E4M3 on
# NVIDIA, the FNUZ variant on AMD MI300-class GPUs.
CUDA_ELEMENTS = torch.float8_e4m3fn
ROCM_ELEMENTS = torch.float8_e4m3fnuz
ROCM_ARCHITECTURES = ("gfx942",)

ScaledGroupedMM = Callable[..., torch.Tensor]


def probe_cuda(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm (it needs torch 2.9 or newer)"
    if dtype != torch.bfloat16:
        return f"its kernel writes bfloat16, the run computes in {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"torch's FP8 grouped GEMM runs on compute capability 9.0, this GPU has {capability[0]}.{capability[1]}"
    return None


def probe_rocm(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm (it needs torch 2.9 or newer)"
    if dtype != torch.bfloat16:
        return f"its kernel writes bfloat16, the run computes in {dtype}"
    architecture = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    if architecture not in ROCM_ARCHITECTURES:
        return f"torch's FP8 grouped GEMM runs on {' and '.join(ROCM_ARCHITECTURES)}, this GPU is {architecture}"
    return None


@outside_autocast
def fp8_grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, recipe) -> torch.Tensor:
    elements = ROCM_ELEMENTS if torch.version.hip else CUDA_ELEMENTS
    return scaled_grouped_mm_with(torch._scaled_grouped_mm, elements, x_NI, w_EOI, offsets_E, recipe)


def scaled_grouped_mm_with(
    kernel: ScaledGroupedMM,
    elements: torch.dtype,
    x_NI: torch.Tensor,
    w_EOI: torch.Tensor,
    offsets_E: torch.Tensor,
    recipe,
) -> torch.Tensor:
    """The implementation over any kernel with `torch._scaled_grouped_mm`'s contract (tests pass a reference),
    for a kernel that takes `elements` for both operands."""
    _check_recipe(recipe, elements)
    return _FP8GroupedMM.apply(x_NI, w_EOI, offsets_E, recipe, kernel)


class _FP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w_EOI, offsets_E, recipe, kernel):
        ctx.save_for_backward(x_NI, w_EOI, offsets_E)
        ctx.recipe, ctx.kernel = recipe, kernel
        fmt = recipe.forward_format
        x_q, x_scale_N1 = recipe.quantize_scaled(x_NI, fmt, -1)
        w_q, w_scale_EO1 = recipe.quantize_scaled(w_EOI, fmt, -1)
        return kernel(
            x_q, w_q.transpose(-2, -1), x_scale_N1[:, 0], w_scale_EO1[..., 0], offs=offsets_E, out_dtype=x_NI.dtype
        )

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_EOI, offsets_E = ctx.saved_tensors
        recipe, kernel = ctx.recipe, ctx.kernel
        dy_NO = dy_NO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_scale_N1 = recipe.quantize_scaled(dy_NO, recipe.grad_format, -1)
            w_q, w_scale_EI1 = recipe.quantize_scaled(w_EOI, recipe.forward_format, 1)
            w_q_column_major = w_q.transpose(1, 2).contiguous().transpose(1, 2)
            grad_x = kernel(
                dy_q, w_q_column_major, dy_scale_N1[:, 0], w_scale_EI1[..., 0], offs=offsets_E, out_dtype=x_NI.dtype
            )
        if ctx.needs_input_grad[1]:
            grad_w = _weight_gradient(kernel, recipe, dy_NO, x_NI, offsets_E, w_EOI.shape[0])
        return grad_x, grad_w, None, None, None


def _weight_gradient(kernel, recipe, dy_NO, x_NI, offsets_E, num_experts: int) -> torch.Tensor:
    """dw[e] = dy[group e].T @ x[group e]: the 2d x 2d form, groups along tokens, scaled per channel and group."""
    block_ids_N = recipe.token_block_ids(offsets_E, x_NI.shape[0])  # FP8: one block per expert group
    dy_q, dy_scale_OB = recipe.quantize_scaled(dy_NO, recipe.grad_format, 0, block_ids_N, num_experts)
    x_q, x_scale_IB = recipe.quantize_scaled(x_NI, recipe.forward_format, 0, block_ids_N, num_experts)
    dy_q, x_q, padded_offsets_E = _pad_groups([dy_q, x_q], offsets_E)
    grad_EOI = kernel(
        dy_q.t().contiguous(),
        x_q.t().contiguous().t(),
        _group_major(dy_scale_OB, num_experts),
        _group_major(x_scale_IB, num_experts),
        offs=padded_offsets_E,
        out_dtype=x_NI.dtype,
    )
    empty_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)) == 0
    return grad_EOI.masked_fill(empty_E.view(-1, 1, 1), 0.0)


def _group_major(scale_XB: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[channel, group] scales as the kernel reads them: group by group; groups past the last token get 1."""
    missing = num_groups - scale_XB.shape[1]
    if missing:
        scale_XB = torch.cat([scale_XB, scale_XB.new_ones(scale_XB.shape[0], missing)], dim=1)
    return scale_XB.t().contiguous().view(-1)


def _pad_groups(tensors_NX: list[torch.Tensor], offsets_E: torch.Tensor):
    """Each group's rows moved to a start that is a multiple of 16, zero rows between and after; with the
    new group ends. The padded row count is a bound the shapes give (every group padded by at most 15 rows),
    so nothing is read on the host; the kernel reads up to the last group end only."""
    num_rows, num_groups = tensors_NX[0].shape[0], offsets_E.shape[0]
    ends_E = offsets_E.long()
    sizes_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_E = (sizes_E + GROUP_ALIGN_ROWS - 1) // GROUP_ALIGN_ROWS * GROUP_ALIGN_ROWS
    padded_offsets_E = torch.cumsum(padded_E, 0)
    rows_N = torch.arange(num_rows, device=offsets_E.device)
    group_N = torch.searchsorted(ends_E, rows_N, right=True)
    destination_N = rows_N + (padded_offsets_E - padded_E - (ends_E - sizes_E))[group_N]
    bound = (num_rows + num_groups * (GROUP_ALIGN_ROWS - 1) + GROUP_ALIGN_ROWS - 1) // GROUP_ALIGN_ROWS
    total = bound * GROUP_ALIGN_ROWS
    padded = []
    for tensor_NX in tensors_NX:
        bytes_NX = tensor_NX.view(torch.uint8)  # fp8 has no index_copy kernel everywhere; its bytes do
        out_PX = bytes_NX.new_zeros(total, *bytes_NX.shape[1:])
        padded.append(out_PX.index_copy_(0, destination_N, bytes_NX).view(tensor_NX.dtype))
    return (*padded, padded_offsets_E.to(offsets_E.dtype))


def recipe_refusal(recipe) -> str | None:
    """Why this device's kernel cannot compute `recipe`, or None when it can."""
    elements = ROCM_ELEMENTS if torch.version.hip else CUDA_ELEMENTS
    return _recipe_refusal(recipe, elements)


def _recipe_refusal(recipe, elements: torch.dtype) -> str | None:
    formats = (recipe.forward_format.dtype, recipe.grad_format.dtype)
    if recipe.kind == "fp8" and all(dtype == elements for dtype in formats):
        return None
    return (
        f"moe.fp8_grouped_mm torch_scaled_grouped_mm computes row-wise scaled FP8 with {elements} for every "
        f"operand here; the recipe is {recipe.kind} with {formats[0]} forward and {formats[1]} gradients"
    )


def _check_recipe(recipe, elements: torch.dtype) -> None:
    reason = _recipe_refusal(recipe, elements)
    if reason is not None:
        raise RecipeRefused(reason)

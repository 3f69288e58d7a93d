"""Every op ferry's model calls, and every implementation of each: the one place they are listed.

An op's summary is its contract (arguments, result, semantics); the portable
implementation is its definition, and each vendor implementation must agree with
it (tests/test_kernels_agreement.py). Vendor implementations are listed in the
order `auto` prefers them.
"""

from __future__ import annotations

from ferry.kernels.portable import attention, linear, low_precision, moe, norm
from ferry.kernels.registry import PORTABLE, Implementation, Op, Registry
from ferry.kernels.vendor import (
    cpu_fused_experts,
    cpu_linear,
    cpu_loop_grouped_mm,
    grouped_gemm,
    padded_bmm,
    torch_grouped_mm,
    torch_scaled_grouped_mm,
    torchao_grouped_mm,
)


def _portable(op: str, fn, summary: str, uses: tuple[str, ...] = ()) -> Implementation:
    return Implementation(op=op, name=PORTABLE, fn=fn, summary=summary, uses=uses)


REGISTRY = Registry(
    [
        Op(
            name="norm.rms",
            summary="(x_XD, weight_D, eps) -> weight * x / sqrt(mean(x^2) + eps), statistics in fp32",
            portable=_portable(
                "norm.rms", norm.rms_norm, "fp32 statistics in plain tensor ops, a closed-form backward"
            ),
        ),
        Op(
            name="linear",
            summary="(x_XI, w_OI) -> x @ w.T over the last dim, no bias: every dense projection of the model",
            portable=_portable("linear", linear.linear, "torch.nn.functional.linear and autograd's backward"),
            vendor=(
                Implementation(
                    op="linear",
                    name="transposed_dgrad",
                    platform="cpu",
                    fn=cpu_linear.linear,
                    probe=cpu_linear.probe,
                    summary="bfloat16/float16: the input gradient from a column-major copy of the weight",
                ),
            ),
        ),
        Op(
            name="attention",
            summary=(
                "(q_BHSC, k_BGSC, v_BGSE, scale=None) -> causal softmax attention, logits times scale "
                "(default 1/sqrt(C)); each of G kv heads serves H/G query heads"
            ),
            portable=_portable("attention", attention.causal_attention, "torch scaled_dot_product_attention"),
        ),
        Op(
            name="attention.masked",
            summary=(
                "(q_BHSC, k_BGTC, v_BGTE, visible_BST: bool, scale=None, sinks_H=None) -> softmax attention of S "
                "queries over the T keys each may see (a cache, a window, documents), each head's softmax with one "
                "more logit sinks_H[h] of zero value when given"
            ),
            portable=_portable(
                "attention.masked",
                attention.masked_attention,
                "torch scaled_dot_product_attention with a boolean mask; with sinks, the softmax written out",
            ),
        ),
        Op(
            name="moe.permute",
            summary="(x_TD, expert_ids_TK) -> (x_ND: the T*K routed rows sorted by expert, stable; Dispatch)",
            portable=_portable("moe.permute", moe.permute, "stable argsort, gather forward and backward"),
        ),
        Op(
            name="moe.grouped_mm",
            summary="(x_NI, w_EOI, offsets_E: int32 group ends) -> y_NO with y[group e] = x[group e] @ w[e].T",
            portable=_portable("moe.grouped_mm", moe.grouped_mm, "one torch.mm per expert (the reference)"),
            vendor=(
                Implementation(
                    op="moe.grouped_mm",
                    name="torch_grouped_mm",
                    platform="cuda",
                    fn=torch_grouped_mm.grouped_mm,
                    probe=torch_grouped_mm.probe_cuda,
                    summary="torch._grouped_mm: CUTLASS grouped GEMM, SM90+, bfloat16, 16-byte aligned widths",
                ),
                Implementation(
                    op="moe.grouped_mm",
                    name="grouped_gemm",
                    platform="cuda",
                    fn=grouped_gemm.grouped_mm,
                    probe=grouped_gemm.probe,
                    summary="grouped_gemm package (MegaBlocks' CUTLASS kernels), SM80+, bfloat16",
                ),
                Implementation(
                    op="moe.grouped_mm",
                    name="loop_column_major",
                    platform="cpu",
                    fn=cpu_loop_grouped_mm.grouped_mm,
                    probe=cpu_loop_grouped_mm.probe,
                    summary="bfloat16/float16: the portable loop, each input gradient from a column-major weight",
                ),
                Implementation(
                    op="moe.grouped_mm",
                    name="torch_grouped_mm",
                    platform="cpu",
                    fn=torch_grouped_mm.grouped_mm,
                    probe=torch_grouped_mm.probe_cpu,
                    summary="torch._grouped_mm's CPU kernel (torch 2.9+), 16-byte aligned widths",
                ),
                Implementation(
                    op="moe.grouped_mm",
                    name="padded_bmm",
                    platform="cpu",
                    fn=padded_bmm.grouped_mm,
                    summary="groups padded to the largest, one torch.bmm",
                ),
            ),
        ),
        Op(
            name="moe.fp8_grouped_mm",
            summary=(
                "(x_NI, w_EOI, offsets_E, recipe) -> y_NO as moe.grouped_mm, every operand of the forward and both "
                "gradients quantized to FP8 with row-wise scales as the recipe prescribes"
            ),
            portable=_portable(
                "moe.fp8_grouped_mm",
                low_precision.low_precision_grouped_mm,
                "emulated: operands rounded, moe.grouped_mm as selected",
                uses=("moe.grouped_mm",),
            ),
            vendor=(
                Implementation(
                    op="moe.fp8_grouped_mm",
                    name="torchao",
                    platform="cuda",
                    fn=torchao_grouped_mm.fp8_grouped_mm,
                    probe=torchao_grouped_mm.probe_fp8,
                    recipe_refusal=torchao_grouped_mm.fp8_recipe_refusal,
                    summary="torchao 0.17+: fused FP8 quantization, torch._scaled_grouped_mm, SM90, power-of-2 scales",
                ),
                Implementation(
                    op="moe.fp8_grouped_mm",
                    name="torch_scaled_grouped_mm",
                    platform="cuda",
                    fn=torch_scaled_grouped_mm.fp8_grouped_mm,
                    probe=torch_scaled_grouped_mm.probe_cuda,
                    recipe_refusal=torch_scaled_grouped_mm.recipe_refusal,
                    summary="torch._scaled_grouped_mm: FP8 CUTLASS grouped GEMM, SM90, row-wise scales",
                ),
                Implementation(
                    op="moe.fp8_grouped_mm",
                    name="torch_scaled_grouped_mm",
                    platform="rocm",
                    fn=torch_scaled_grouped_mm.fp8_grouped_mm,
                    probe=torch_scaled_grouped_mm.probe_rocm,
                    recipe_refusal=torch_scaled_grouped_mm.recipe_refusal,
                    summary="torch._scaled_grouped_mm on MI300X/MI325X (gfx942), FNUZ E4M3, row-wise scales",
                ),
            ),
        ),
        Op(
            name="moe.mxfp8_grouped_mm",
            summary=(
                "(x_NI, w_EOI, offsets_E, recipe) -> y_NO as moe.grouped_mm, every operand quantized to MXFP8 "
                "(blocks of 32 along the reduction dim, E8M0 scales) as the recipe prescribes"
            ),
            portable=_portable(
                "moe.mxfp8_grouped_mm",
                low_precision.low_precision_grouped_mm,
                "emulated: operands rounded, moe.grouped_mm as selected",
                uses=("moe.grouped_mm",),
            ),
            vendor=(
                Implementation(
                    op="moe.mxfp8_grouped_mm",
                    name="torchao",
                    platform="cuda",
                    fn=torchao_grouped_mm.mxfp8_grouped_mm,
                    probe=torchao_grouped_mm.probe_mxfp8,
                    recipe_refusal=torchao_grouped_mm.mxfp8_recipe_refusal,
                    summary="torchao 0.17+: fused MXFP8 quantization and grouped GEMM, SM100, E4M3 gradients only",
                ),
            ),
        ),
        Op(
            name="moe.expert_mlp",
            summary=(
                "(x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF) -> y_ND, each expert's SwiGLU "
                "on its group of expert-sorted rows"
            ),
            portable=_portable(
                "moe.expert_mlp", moe.expert_mlp, "moe.grouped_mm x3 as selected", uses=("moe.grouped_mm",)
            ),
        ),
        Op(
            name="moe.biased_expert_mlp",
            summary=(
                "(x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, "
                "activation) -> y_ND, each expert's gated MLP with its biases (each may be None) and the given "
                "activation (GPT-OSS's clamped SwiGLU) on its group of expert-sorted rows"
            ),
            portable=_portable(
                "moe.biased_expert_mlp",
                moe.biased_expert_mlp,
                "moe.grouped_mm x3 as selected, biases gathered per row",
                uses=("moe.grouped_mm",),
            ),
        ),
        Op(
            name="moe.combine",
            summary="(y_ND, weights_TK, Dispatch) -> out_TD = sum over k of weights[t, k] * y[row of (t, k)]",
            portable=_portable("moe.combine", moe.combine, "gathers forward and backward, no scatter-add"),
        ),
        Op(
            name="moe.routed_experts",
            summary=(
                "(x_TD, expert_ids_TK, weights_TK, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF) -> "
                "out_TD, the routing-weighted sum of each token's SwiGLU experts"
            ),
            portable=_portable(
                "moe.routed_experts",
                moe.routed_experts,
                "moe.permute, moe.expert_mlp, moe.combine as selected",
                uses=("moe.permute", "moe.expert_mlp", "moe.combine"),
            ),
            vendor=(
                Implementation(
                    op="moe.routed_experts",
                    name="fused_loop",
                    platform="cpu",
                    fn=cpu_fused_experts.routed_experts,
                    summary="one cache-resident pass per expert, forward and backward",
                    replay_refusal="its activation buffers come from a pool a recompute finds in another state, and "
                    "it scales GEMM outputs in place",
                ),
            ),
        ),
    ]
)

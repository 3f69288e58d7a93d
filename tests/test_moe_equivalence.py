"""ferry's MoE block equals the OLMoE sparse MoE block of `transformers` given the same weights,
with the portable kernels and with what `kernels.policy: auto` takes on a CPU."""

import pytest
import torch
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from ferry.kernels import KernelsConfig, select_kernels
from ferry.model import MoEConfig, MoELayer

DIM, FFN, EXPERTS, TOP_K = 64, 48, 8, 2


def _pair(renormalize: bool, policy: str) -> tuple[MoELayer, OlmoeSparseMoeBlock]:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_ffn_dim=FFN, renormalize=renormalize)
    ours = MoELayer(DIM, config, select_kernels(KernelsConfig(policy=policy), "cpu"))
    for param in ours.parameters():
        torch.nn.init.normal_(param, std=0.2)
    hf_config = OlmoeConfig(
        hidden_size=DIM,
        intermediate_size=FFN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=renormalize,
    )
    theirs = OlmoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight_ED)
        experts = ours.experts
        theirs.experts.gate_up_proj.copy_(torch.cat([experts.w_gate_EFD, experts.w_up_EFD], dim=1))
        theirs.experts.down_proj.copy_(experts.w_down_EDF)
    return ours, theirs


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("policy", ["portable", "auto"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_forward_and_backward_match_olmoe(renormalize, policy):
    ours, theirs = _pair(renormalize, policy)
    x_BSD = torch.randn(3, 17, DIM)
    x_ours = x_BSD.clone().requires_grad_()
    x_theirs = x_BSD.clone().requires_grad_()
    y_ours, stats = ours(x_ours)
    y_theirs = theirs(x_theirs)
    assert _relative_error(y_ours, y_theirs) < 1e-5
    grad_BSD = torch.randn_like(y_ours)
    y_ours.backward(grad_BSD)
    y_theirs.backward(grad_BSD)
    assert _relative_error(x_ours.grad, x_theirs.grad) < 1e-5
    assert _relative_error(ours.router.weight_ED.grad, theirs.gate.weight.grad) < 1e-5
    gate_up_grad = torch.cat([ours.experts.w_gate_EFD.grad, ours.experts.w_up_EFD.grad], dim=1)
    assert _relative_error(gate_up_grad, theirs.experts.gate_up_proj.grad) < 1e-5
    assert _relative_error(ours.experts.w_down_EDF.grad, theirs.experts.down_proj.grad) < 1e-5
    assert int(stats.tokens_per_expert_E.sum()) == 3 * 17 * TOP_K

"""DeepSeek-V2 against transformers' `DeepseekV2ForCausalLM` on the same weights: softmax routing over every expert
(`greedy`) and within the groups whose best expert scores highest (`group_limited_greedy`), full and compressed
queries, YaRN with DeepSeek's magnitudes, rotary rows in V2's interleaved pairs. A ferry model exports as V2
with logits within 1e-5 (fp32) and the same greedy tokens, a V2 directory written by transformers imports to the
same logits, export -> import gives the weights back bit for bit, and what V2 cannot express is named."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import exported, greedy_tokens_agree, relative
from test_interop import _random_model
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from ferry.interop.architectures import from_hf_state, hf_config, model_config_from_hf, refusals, to_hf_state
from ferry.interop.importing import read_hf_dir
from ferry.model import ModelConfig, Transformer

TOLERANCE = 1e-5  # relative: fp32 kernels in another order, never more

V2_BASE = dict(
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    max_seq_len=64,
    attention="mla",
    dense_layers=1,
    dense_ffn_dim=40,
    mla=dict(q_lora_rank=0, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    moe=dict(
        num_experts=8,
        top_k=2,
        expert_ffn_dim=16,
        score_func="softmax",
        renormalize=False,
        shared_expert_ffn_dim=32,
        routed_scaling_factor=1.5,
    ),
)
V2_CASES = {
    "greedy": {},
    "group-limited-compressed-queries": dict(
        mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        moe=dict(
            num_experts=8,
            top_k=3,
            expert_ffn_dim=16,
            score_func="softmax",
            renormalize=False,
            n_group=4,
            topk_group=2,
            group_score="max",
            routed_scaling_factor=16.0,
        ),
    ),
    "yarn-no-shared-tied": dict(
        tie_embeddings=True,
        dense_layers=0,
        rope_theta=500.0,
        rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=16, mscale=1.0, mscale_all_dim=0.8),
        moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16, score_func="softmax", renormalize=False),
    ),
}


def v2_config(case: str) -> ModelConfig:
    return ModelConfig.model_validate({**V2_BASE, **V2_CASES[case]})


@pytest.mark.parametrize("case", sorted(V2_CASES))
def test_an_export_as_deepseek_v2_gives_ferrys_logits_and_greedy_tokens(case):
    config = v2_config(case)
    assert refusals(config, "deepseek_v2") == []
    ours = _random_model(config)
    theirs = exported(ours, "deepseek_v2", DeepseekV2ForCausalLM)
    tokens_BS = torch.randint(0, config.vocab_size, (3, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert relative(ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE
    assert greedy_tokens_agree(ours, theirs, tokens_BS[0, :5], 12)


@pytest.mark.parametrize("case", sorted(V2_CASES))
def test_a_v2_directory_imports_to_the_same_logits_and_round_trips_bit_for_bit(case, tmp_path):
    """transformers writes a V2 model of random weights (its rotary rows interleaved, as V2's checkpoints are);
    ferry reads it as the model it is, and writing that back gives the same tensors."""
    config = v2_config(case)
    hf = hf_config(config, "deepseek_v2", 0, "float32")
    torch.manual_seed(1)
    theirs = DeepseekV2ForCausalLM(hf).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    theirs.save_pretrained(tmp_path / "hf")
    imported_config, arch, state = read_hf_dir(tmp_path / "hf")
    assert arch == "deepseek_v2" and imported_config.moe == config.moe
    assert model_config_from_hf(DeepseekV2Config.from_pretrained(tmp_path / "hf"))[0] == imported_config
    ours = Transformer(imported_config).eval()
    ours.load_state_dict(state)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert relative(ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE
    back = to_hf_state(ours.state_dict(), imported_config, "deepseek_v2")
    for name, tensor in theirs.state_dict().items():
        if tensor.numel() and name in back:
            assert torch.equal(back[name], tensor), name
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    assert {name for name, tensor in theirs.state_dict().items() if tensor.numel()} - tied <= set(back)
    again = from_hf_state(back, imported_config, arch="deepseek_v2")
    assert all(torch.equal(again[name], tensor) for name, tensor in ours.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(moe=dict(num_experts=8, top_k=2, expert_ffn_dim=16, score_func="sigmoid")), "model.moe.score_func"),
        (dict(moe=dict(num_experts=8, top_k=2, expert_ffn_dim=16, renormalize=True)), "model.moe.renormalize"),
        (dict(moe=dict(num_experts=8, top_k=2, expert_ffn_dim=16, n_group=4, topk_group=2)), "model.moe.group_score"),
    ],
)
def test_what_deepseek_v2_cannot_express_is_named(overrides, named):
    config = ModelConfig.model_validate({**V2_BASE, **overrides})
    assert any(problem.startswith(named) for problem in refusals(config, "deepseek_v2")), refusals(
        config, "deepseek_v2"
    )

"""GPT-OSS against transformers' `GptOssForCausalLM` on the same weights: attention sinks, sliding windows
(alternating with full layers, or every layer), projection biases, the clamped SwiGLU experts with their biases,
the biased router, YaRN without truncation. A ferry model exports as gpt_oss with logits within 1e-5 (fp32) and
the same greedy tokens, decoded past the window; a directory transformers writes imports to the same logits and
writes back bit for bit; what gpt_oss cannot express, and what other architectures cannot, is named."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import exported, greedy_tokens_agree, relative
from test_interop import _random_model
from transformers import GptOssConfig, GptOssForCausalLM

from ferry.interop.architectures import from_hf_state, hf_config, model_config_from_hf, refusals, to_hf_state
from ferry.interop.importing import read_hf_dir
from ferry.model import ModelConfig, Transformer

TOLERANCE = 1e-5  # relative: fp32 kernels in another order, never more

BASE = dict(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=12,
    max_seq_len=64,
    attention_bias=True,
    attention_sinks=True,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_theta=150000.0,
    moe=dict(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=16,
        score_func="softmax",
        renormalize=True,
        router_bias=True,
        expert_biases=True,
        activation="clamped_swiglu",
        swiglu_limit=1.5,
    ),
)
CASES = {
    "alternating-yarn-untruncated": dict(
        rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=16, truncate=False),
    ),
    "every-layer-windowed-tied": dict(n_layers=3, sliding_window_pattern=1, tie_embeddings=True),
    "full-attention-no-projection-bias": dict(sliding_window=0, attention_bias=False),
}


def gpt_oss_config(case: str) -> ModelConfig:
    return ModelConfig.model_validate({**BASE, **CASES[case]})


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_as_gpt_oss_gives_ferrys_logits_and_greedy_tokens(case):
    config = gpt_oss_config(case)
    assert refusals(config, "gpt_oss") == []
    ours = _random_model(config)
    theirs = exported(ours, "gpt_oss", GptOssForCausalLM)
    tokens_BS = torch.randint(0, config.vocab_size, (3, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert relative(ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE
    assert greedy_tokens_agree(ours, theirs, tokens_BS[0, :5], 12)


def test_the_parts_change_the_logits():
    """Each part is computed, not carried: the sinks, the window and the clamp each move the logits."""
    config = gpt_oss_config("alternating-yarn-untruncated")
    model = _random_model(config)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(tokens_BS).logits_BSV
        for overrides in (
            dict(attention_sinks=False),
            dict(sliding_window=0),
            dict(moe={**BASE["moe"], "swiglu_limit": 100.0}),
        ):
            other = Transformer(
                config.model_copy(update=overrides)
                if "moe" not in overrides
                else ModelConfig.model_validate({**BASE, **CASES["alternating-yarn-untruncated"], **overrides})
            ).eval()
            other.load_state_dict(model.state_dict(), strict=False)
            assert relative(other(tokens_BS).logits_BSV, reference) > 1e-3, overrides


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gpt_oss_directory_imports_to_the_same_logits_and_round_trips_bit_for_bit(case, tmp_path):
    config = gpt_oss_config(case)
    hf = hf_config(config, "gpt_oss", 0, "float32")
    torch.manual_seed(1)
    theirs = GptOssForCausalLM(hf).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    theirs.save_pretrained(tmp_path / "hf")
    imported_config, arch, state = read_hf_dir(tmp_path / "hf")
    assert arch == "gpt_oss"
    assert model_config_from_hf(GptOssConfig.from_pretrained(tmp_path / "hf"))[0] == imported_config
    ours = Transformer(imported_config).eval()
    ours.load_state_dict(state)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert relative(ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE
    back = to_hf_state(ours.state_dict(), imported_config, "gpt_oss")
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    assert set(theirs.state_dict()) - tied == set(back)
    for name, tensor in theirs.state_dict().items():
        if name not in tied:
            assert torch.equal(back[name], tensor), name
    again = from_hf_state(back, imported_config, arch="gpt_oss")
    assert all(torch.equal(again[name], tensor) for name, tensor in ours.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(attention_sinks=False), "model.attention_sinks"),
        (dict(qk_norm=True), "model.qk_norm"),
        (dict(moe={**BASE["moe"], "activation": "swiglu"}), "model.moe.activation"),
        (dict(moe={**BASE["moe"], "renormalize": False}), "model.moe.score_func / renormalize"),
        (dict(dense_layers=1), "model.dense_layers"),
    ],
)
def test_what_gpt_oss_cannot_express_is_named(overrides, named):
    config = ModelConfig.model_validate({**BASE, **overrides})
    assert any(problem.startswith(named) for problem in refusals(config, "gpt_oss")), refusals(config, "gpt_oss")


def test_gpt_oss_parts_are_named_where_another_architecture_cannot_hold_them():
    config = gpt_oss_config("alternating-yarn-untruncated")
    problems = refusals(config, "qwen3_moe")
    for field in (
        "model.attention_bias",
        "model.attention_sinks",
        "model.sliding_window",
        "model.moe.router_bias",
        "model.moe.expert_biases",
        "model.moe.activation",
    ):
        assert any(problem.startswith(field) for problem in problems), (field, problems)


def test_a_window_pattern_ferry_cannot_say_is_refused_on_import():
    hf = hf_config(gpt_oss_config("alternating-yarn-untruncated"), "gpt_oss", 0, "float32")
    hf.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(Exception, match="layer_types: ferry windows every layer but each sliding_window_pattern-th"):
        model_config_from_hf(hf)


def test_mxfp4_experts_import_as_transformers_dequantises_them(tmp_path):
    """A GPT-OSS directory whose expert projections are stored as the release stores them (MXFP4 blocks and
    E8M0 scales, packed here from random codes and exponents: transformers writes MXFP4 only on a GPU) imports
    to exactly the weights transformers' own dequantisation gives, and to its model's logits."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = ModelConfig.model_validate({**BASE, "moe": {**BASE["moe"], "expert_ffn_dim": 32}})
    hf = hf_config(config, "gpt_oss", 0, "float32")
    torch.manual_seed(2)
    theirs = GptOssForCausalLM(hf).eval()
    theirs.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    stored = load_file(weights)
    codes = torch.Generator().manual_seed(3)
    for index in range(config.n_layers):
        for projection in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{index}.mlp.experts.{projection}"
            experts, inputs, outputs = stored.pop(name).shape
            blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=codes).to(torch.uint8)
            scales = torch.randint(122, 128, (experts, outputs, inputs // 32), generator=codes).to(torch.uint8)
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            theirs.get_parameter(name).data.copy_(dense)
    save_file(stored, weights, metadata={"format": "pt"})
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_json))

    imported_config, arch, state = read_hf_dir(tmp_path / "hf")
    assert arch == "gpt_oss" and imported_config.moe.expert_ffn_dim == 32
    back = to_hf_state(state, imported_config, "gpt_oss")
    for index in range(config.n_layers):
        for projection in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{index}.mlp.experts.{projection}"
            assert torch.equal(back[name], theirs.get_parameter(name).data), name
    ours = Transformer(imported_config).eval()
    ours.load_state_dict(state)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert relative(ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE


def test_mxfp4_blocks_without_their_scales_are_named(tmp_path):
    from safetensors.torch import save_file

    from ferry.config import UserError
    from ferry.interop.mxfp4 import read_mxfp4_state

    save_file(
        {"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8)},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(UserError, match="down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales"):
        read_mxfp4_state(tmp_path)

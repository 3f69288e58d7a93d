"""DeepSeek-V3 interop and MLA decoding: a trained tiny MLA run exports as `DeepseekV3ForCausalLM` (loaded offline
in a fresh process, logits equal ferry's within 1e-5), imports back bit for bit and trains on; greedy decoding
with the latent cache equals the no-cache path and transformers' `generate` on the export (with YaRN too); `ferry
generate` reports the cache's bytes per token; what DeepSeek-V3 cannot express (a gated MLA) exits 2."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_offline import load_offline
from test_mla import MLA_BASE, mla_config, random_model, transformers_model

from ferry.cli.main import main
from ferry.inference import GenerationConfig, generate
from ferry.interop.architectures import refusals
from ferry.model import ModelConfig
from ferry.train import Trainer

GREEDY = GenerationConfig(max_new_tokens=10, temperature=0.0)
MLA_RUN = (  # the tiny run of conftest, its attention and routing DeepSeek-V3's
    "model.attention=mla",
    "model.n_kv_heads=4",
    "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
    "model.moe.score_func=sigmoid",
    "model.moe.n_group=2",
    "model.moe.topk_group=1",
    "model.moe.renormalize=true",
    "model.moe.routed_scaling_factor=2.0",
    "model.moe.shared_expert_ffn_dim=32",
    "model.moe.bias_balancing.enabled=true",
)


def greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits_BSV[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_decoding_equals_the_no_cache_path_and_transformers_generate_with_yarn():
    """Full queries under YaRN here; the compressed queries' greedy tokens are compared on the trained run's export
    below."""
    config = mla_config("full-queries-yarn")
    ours = random_model(config)
    theirs = transformers_model(config, ours.state_dict())
    prompts = [[5, 17, 33, 2, 9, 41, 8], [60, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    result = generate(ours, prompts, GREEDY)
    for prompt, completion in zip(prompts, result.completions):
        assert completion.tokens == greedy_without_cache(ours, prompt, 10), prompt
        expected = theirs.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=10,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.tokens == expected, prompt
    assert result.cache_bytes_per_token == config.n_layers * (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * 4


def test_a_gated_mla_model_is_refused_by_every_architecture_naming_the_gate():
    config = ModelConfig.model_validate({**MLA_BASE, "attention_gate": "head"})
    for arch in ("deepseek_v3", "olmoe", "qwen3_moe"):
        assert any(problem.startswith("model.attention_gate") for problem in refusals(config, arch)), arch
    assert any("transformers has no gated MLA model" in problem for problem in refusals(config, "deepseek_v3"))
    gqa = ModelConfig.model_validate(dict(dim=32, n_heads=4, qk_norm=True, moe=dict(score_func="sigmoid")))
    assert any(problem.startswith("model.attention: deepseek_v3") for problem in refusals(gqa, "deepseek_v3"))


@pytest.fixture(scope="module")
def mla_run(stdlib_dataset, tmp_path_factory):
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("mla") / "run"
    Trainer(tiny_config(stdlib_dataset, run_dir, *MLA_RUN, "train.steps=3")).fit()
    return run_dir


def test_an_mla_run_exports_as_deepseek_v3_and_loads_offline_with_ferrys_logits(mla_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(mla_run), str(out)]) == 0
    assert "as deepseek_v3" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    loaded = load_offline(out, "def main():\n    return 0", 8)
    assert loaded["type"] == "deepseek_v3"
    from ferry.inference import load_model

    model = load_model(mla_run, device="cpu").model
    with torch.no_grad():
        ours_SV = model(torch.tensor([loaded["ids"]])).logits_BSV[0]
    theirs_SV = torch.tensor(loaded["logits"])
    assert ((ours_SV - theirs_SV).norm() / theirs_SV.norm()).item() < 1e-5
    ours_greedy = generate(model, [loaded["ids"]], GenerationConfig(max_new_tokens=8, temperature=0.0))
    assert ours_greedy.completions[0].tokens == loaded["greedy"]


def test_import_of_the_export_is_bitwise_and_training_continues_from_it(mla_run, stdlib_dataset, tmp_path, capsys):
    from conftest import tiny_config

    from ferry.checkpoint import latest_checkpoint
    from ferry.interop.weights import read_model_state

    hf_dir, imported = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(mla_run), str(hf_dir)]) == 0
    assert main(["import", str(hf_dir), str(imported)]) == 0
    captured = capsys.readouterr()
    assert "imported deepseek_v3" in captured.out
    exported = re.search(r"as deepseek_v3 \(([\d,]+) parameters", captured.out).group(1)
    assert f"imported deepseek_v3 ({exported} parameters)" in captured.out, "both sides count the same weights"
    assert "Writing model shards" not in captured.err and "Loading weights" not in captured.err
    original = read_model_state(latest_checkpoint(mla_run))
    back = read_model_state(latest_checkpoint(imported))
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert any(name.endswith("expert_bias_E") and tensor.any() for name, tensor in back.items()), "biases travel"

    def losses(name: str, *overrides: str) -> list[float]:
        config = tiny_config(stdlib_dataset, tmp_path / name, *MLA_RUN, "train.steps=2", *overrides)
        return Trainer(config).fit().losses

    continued = losses("a", f"init_from={imported / 'checkpoints' / 'step-00000000'}")
    assert continued == losses("b", f"init_from={latest_checkpoint(mla_run).path}")
    assert continued != losses("c")


def test_ferry_generate_reports_the_latent_caches_bytes_per_token(mla_run, capsys):
    argv = ["generate", str(mla_run), "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens", "4"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "cache 192 bytes per token (MLA latent: 16 + 8 rotary values a layer)" in err  # 2 layers x 24 x 4 bytes


def test_a_gated_run_cannot_export_and_exit_2_says_why(stdlib_dataset, tmp_path, capsys):
    from conftest import tiny_config

    run_dir = tmp_path / "gated"
    Trainer(tiny_config(stdlib_dataset, run_dir, *MLA_RUN, "model.attention_gate=elementwise", "train.steps=1")).fit()
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    assert "model.attention_gate 'elementwise': transformers has no gated MLA model" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_deepseek_checkpoint_as_deepseek_ships_it_imports_with_its_logits(tmp_path, capsys):
    """Interleaved rotary rows, a multi-token-prediction module declared, a correction bias, YaRN with DeepSeek's
    magnitudes: `ferry import` reads it and ferry's logits are transformers'."""
    import yaml
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from ferry.inference import load_model

    hf = DeepseekV3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_interleave=True,
        num_mtp_layers=1,
        rms_norm_eps=1e-6,
        eos_token_id=0,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(hf).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            param.normal_(0.0, 0.2) if not name.endswith("norm.weight") else param.uniform_(0.5, 1.5)
        theirs.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    theirs.save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ferry")]) == 0
    assert "imported deepseek_v3" in capsys.readouterr().out
    section = yaml.safe_load((tmp_path / "ferry" / "model.yaml").read_text())["model"]
    assert section["attention"] == "mla" and section["moe"]["bias_balancing"]["enabled"] is True
    assert section["rope_scaling"]["mscale_all_dim"] == 1.0
    ours = load_model(tmp_path / "ferry", device="cpu").model
    tokens_BS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_BSV, theirs_BSV = ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits
    assert ((ours_BSV - theirs_BSV).norm() / theirs_BSV.norm()).item() < 1e-5

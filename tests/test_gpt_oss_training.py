"""Training a GPT-OSS-shaped model: every layout equals one process (experts with their biases split over EP ranks,
ZeRO-1, FSDP, a pipeline of two stages, activation checkpointing); a trained run exports as `GptOssForCausalLM`,
which transformers loads offline in a fresh process with ferry's logits and greedy tokens; importing the export
gives the weights back bit for bit and trains on as the original; biases and sinks take neither weight decay nor
Muon; what cannot be computed under context parallelism or QK-clip is refused by name."""

from __future__ import annotations

import json
import re

import distributed_training as runs
import pytest
import torch
from hf_offline import load_offline

from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.config import ConfigError
from ferry.inference import GenerationConfig, generate, load_model
from ferry.model import ModelConfig, Transformer
from ferry.parallel.optimizers.muon import muon_parameter_names
from ferry.train import Trainer
from ferry.train.optimizer import decayed_parameter_names

LAYOUT_TOLERANCE = 1e-5  # as tests/test_distributed_training.py: sums in another order over 2 ranks

GPT_OSS_RUN = (  # the tiny run of conftest with GPT-OSS's parts; its window (8) shorter than its rows (32)
    "model.dense_layers=0",
    "model.head_dim=12",
    "model.attention_bias=true",
    "model.attention_sinks=true",
    "model.sliding_window=8",
    "model.rope_theta=150000.0",
    "model.rope_scaling={kind: yarn, factor: 2.0, original_max_seq_len: 32, truncate: false}",
    "model.moe={num_experts: 4, top_k: 2, expert_ffn_dim: 32, score_func: softmax, renormalize: true, "
    "router_bias: true, expert_biases: true, activation: clamped_swiglu, swiglu_limit: 2.0}",
)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def gpt_oss_run(stdlib_dataset, tmp_path_factory):
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("gpt-oss") / "run"
    result = Trainer(tiny_config(stdlib_dataset, run_dir, *GPT_OSS_RUN, "train.steps=4")).fit()
    return run_dir, result.losses


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.ep=2", "optim.zero=true"),
        ("parallel.mode=fsdp",),
        ("parallel.pp=2",),
        ("parallel.ep=2", "train.activation_checkpointing=selective"),
    ],
    ids=["ep2-zero", "fsdp2", "pp2", "ep2-recomputed"],
)
def test_every_layout_trains_a_gpt_oss_model_as_one_process(gpt_oss_run, stdlib_dataset, tmp_path, layout):
    _, single = gpt_oss_run
    ranks = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), *GPT_OSS_RUN, "train.steps=4", *layout)
    assert _relative(ranks[0]["losses"], single) < LAYOUT_TOLERANCE
    assert ranks[1]["losses"] == ranks[0]["losses"]


def test_a_gpt_oss_run_exports_and_loads_offline_with_ferrys_logits_and_greedy_tokens(gpt_oss_run, tmp_path, capsys):
    run_dir, _ = gpt_oss_run
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert "as gpt_oss" in capsys.readouterr().out
    hf_json = json.loads((out / "config.json").read_text())
    assert hf_json["architectures"] == ["GptOssForCausalLM"]
    assert hf_json["layer_types"] == ["sliding_attention", "full_attention"] and hf_json["sliding_window"] == 8
    loaded = load_offline(out, "def main(argv):\n    for name in argv:\n        print(name)\n    return 0", 12)
    assert loaded["type"] == "gpt_oss" and len(loaded["ids"]) > 8, "the prompt reaches past the window"
    model = load_model(run_dir, device="cpu").model
    with torch.no_grad():
        ours_SV = model(torch.tensor([loaded["ids"]])).logits_BSV[0]
    theirs_SV = torch.tensor(loaded["logits"])
    assert ((ours_SV - theirs_SV).norm() / theirs_SV.norm()).item() < 1e-5
    ours_greedy = generate(model, [loaded["ids"]], GenerationConfig(max_new_tokens=12, temperature=0.0))
    assert ours_greedy.completions[0].tokens == loaded["greedy"]


def test_import_of_the_export_is_bitwise_and_training_continues_from_it(gpt_oss_run, stdlib_dataset, tmp_path, capsys):
    from conftest import tiny_config

    from ferry.checkpoint import latest_checkpoint
    from ferry.interop.weights import read_model_state

    run_dir, _ = gpt_oss_run
    hf_dir, imported = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(run_dir), str(hf_dir)]) == 0
    assert main(["import", str(hf_dir), str(imported)]) == 0
    captured = capsys.readouterr()
    exported = re.search(r"as gpt_oss \(([\d,]+) parameters", captured.out).group(1)
    assert f"imported gpt_oss ({exported} parameters)" in captured.out, "both sides count the same weights"
    original = read_model_state(latest_checkpoint(run_dir))
    back = read_model_state(latest_checkpoint(imported))
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert any(name.endswith("attn.sinks_H") and tensor.any() for name, tensor in back.items()), "sinks trained"

    def losses(name: str, *overrides: str) -> list[float]:
        config = tiny_config(stdlib_dataset, tmp_path / name, *GPT_OSS_RUN, "train.steps=2", *overrides)
        return Trainer(config).fit().losses

    continued = losses("a", f"init_from={imported / 'checkpoints' / 'step-00000000'}")
    assert continued == losses("b", f"init_from={latest_checkpoint(run_dir).path}")


def test_biases_and_sinks_take_neither_weight_decay_nor_muon():
    config = ModelConfig.model_validate(
        dict(
            dim=32,
            n_heads=4,
            attention_bias=True,
            attention_sinks=True,
            moe=dict(router_bias=True, expert_biases=True, activation="clamped_swiglu"),
        )
    )
    model = Transformer(config)
    biases = {name for name, _ in model.named_parameters() if "bias" in name or "sinks" in name}
    assert {"layers.0.ffn.experts.bias_gate_EF", "layers.0.attn.sinks_H", "layers.0.attn.wq.bias"} <= biases
    assert not biases & decayed_parameter_names(model)
    assert not biases & muon_parameter_names(model)
    assert "layers.0.ffn.experts.w_gate_EFD" in muon_parameter_names(model) & decayed_parameter_names(model)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("parallel.cp=2", "model.sliding_window=8"), "cp 2: model.sliding_window is not computed over a split"),
        (("parallel.cp=2", "model.attention_sinks=true"), "cp 2: model.attention_sinks is not computed over a split"),
        (
            ("optim.name=muon", "optim.muon.qk_clip=50.0", "model.attention_bias=true"),
            "muon.qk_clip scales the query and key weights to scale the logits, which model.attention_bias",
        ),
        (
            ("model.attention=mla", "model.n_kv_heads=4", "model.attention_sinks=true"),
            "attention_sinks: grouped-query attention's",
        ),
    ],
)
def test_what_a_layout_or_an_optimizer_cannot_compute_is_refused_by_name(stdlib_dataset, tmp_path, overrides, message):
    from conftest import tiny_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(stdlib_dataset, tmp_path, *overrides)

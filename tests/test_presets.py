"""Named model shapes: every preset loads, `ferry models` prints its counts (OLMoE-1B-7B's published 6.9B / 1.3B
among them), each tiny variant keeps its big one's structure and counts as the built model does, `ferry train
--model` trains one, a bad name exits 2; the mla-tiny bench suite measures an MLA model."""

from __future__ import annotations

import json

import pytest
import yaml

from ferry.cli.main import main
from ferry.model import Transformer, count_model
from ferry.model.presets import load_preset, preset_name, preset_names


def test_every_preset_has_a_tiny_variant_of_the_same_structure():
    names = preset_names()
    big = [name for name in names if not name.endswith("-tiny")]
    assert set(big) >= {"olmoe-1b-7b", "qwen3-30b-a3b", "moonlight-16b-a3b", "instella-moe-16b-a3b", "gpt-oss-20b"}
    for name in big:
        large, tiny = load_preset(name), load_preset(f"{name}-tiny")
        assert (tiny.attention, tiny.attention_gate, tiny.qk_norm, tiny.qk_norm_scope) == (
            large.attention,
            large.attention_gate,
            large.qk_norm,
            large.qk_norm_scope,
        ), name
        assert (
            tiny.moe.score_func,
            tiny.moe.renormalize,
            bool(tiny.moe.shared_expert_ffn_dim),
            bool(tiny.dense_layers),
        ) == (
            large.moe.score_func,
            large.moe.renormalize,
            bool(large.moe.shared_expert_ffn_dim),
            bool(large.dense_layers),
        ), name
        parts = ("attention_bias", "attention_sinks", "sliding_window_pattern")
        assert [getattr(tiny, part) for part in parts] == [getattr(large, part) for part in parts], name
        assert bool(tiny.sliding_window) == bool(large.sliding_window), name
        moe_parts = ("router_bias", "expert_biases", "activation")
        assert [getattr(tiny.moe, part) for part in moe_parts] == [getattr(large.moe, part) for part in moe_parts], name
        model = Transformer(tiny)
        size = count_model(tiny, 16)
        assert size.total_params == sum(param.numel() for param in model.parameters()), name


def test_ferry_models_prints_every_presets_counts(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert f"\n{name} " in out
    olmoe = next(line for line in out.splitlines() if line.startswith("olmoe-1b-7b "))
    assert "6.92B" in olmoe and "1.28B" in olmoe and "131,072" in olmoe  # OLMoE's card: 6.9B, 1.3B active
    moonlight = next(line for line in out.splitlines() if line.startswith("moonlight-16b-a3b "))
    assert "15.96B" in moonlight and "31,104" in moonlight  # 27 layers x (512 + 64) latent values x 2 bytes
    for name, total in (("gpt-oss-20b", "20.91B"), ("gpt-oss-120b", "116.83B")):  # the model card's totals
        row = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        assert total in row, row
    assert main(["models", "moonlight-16b-a3b-tiny", "--show"]) == 0
    shown = capsys.readouterr().out
    assert yaml.safe_load(shown[shown.index("model:") :])["model"]["attention"] == "mla"


def test_ferry_train_takes_a_preset_and_overrides_after_it(stdlib_dataset, tmp_path):
    run = tmp_path / "run"
    argv = [
        "train",
        "configs/tiny.yaml",
        "--model",
        "instella-moe-16b-a3b-tiny",
        "model.max_seq_len=32",
        f"data.sources=[{{name: stdlib, path: {stdlib_dataset}}}]",
        "data.seq_len=32",
        f"run.dir={run}",
        "train.steps=2",
        "train.global_batch=4",
        "train.micro_batch=4",
        "train.log_every=1",
    ]
    assert main(argv) == 0
    resolved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert resolved == {**load_preset("instella-moe-16b-a3b-tiny").model_dump(mode="json"), "max_seq_len": 32}


@pytest.fixture(scope="module")
def demo_vocabulary_dataset(tmp_path_factory):
    """The embedded corpus in a BPE of the demo's 4,096 tokens (a slice: the vocabulary is what matters)."""
    from ferry.data import PrepareSpec, prepare_dataset

    output = tmp_path_factory.mktemp("demo-vocabulary") / "stdlib"
    prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=300_000, vocab_size=4096), output)
    return output


@pytest.mark.parametrize("name", [name for name in preset_names() if name.endswith("-tiny")])
def test_each_tiny_preset_trains_on_the_demo_config_as_it_stands_and_the_run_names_it(
    name, demo_vocabulary_dataset, tmp_path, capsys
):
    run = tmp_path / "run"
    argv = [
        "train",
        "configs/tiny.yaml",
        "--model",
        name,
        f"data.sources.0.path={demo_vocabulary_dataset}",
        f"run.dir={run}",
        "train.steps=2",
        "train.log_every=1",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert f"— model {name}, " in capsys.readouterr().out
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["model_preset"] == name
    assert json.loads((run / "run.json").read_text())["config"]["run"]["model_preset"] == name


def test_a_model_yaml_that_ferry_import_writes_is_named_by_its_directory_in_the_banner(
    demo_vocabulary_dataset, tmp_path, capsys
):
    """`ferry import` writes `OUT/model.yaml`: the run is named after OUT, never "model model"; a preset file of
    another name keeps its stem."""
    imported = tmp_path / "qwen-imported"
    imported.mkdir()
    (imported / "model.yaml").write_text(
        yaml.safe_dump({"model": load_preset("olmoe-1b-7b-tiny").model_dump(mode="json")})
    )
    run = tmp_path / "run"
    argv = [
        "train",
        "configs/tiny.yaml",
        "--model",
        str(imported / "model.yaml"),
        f"data.sources.0.path={demo_vocabulary_dataset}",
        f"run.dir={run}",
        "train.steps=1",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "— model qwen-imported, " in out and "model model" not in out
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["model_preset"] == "qwen-imported"
    assert preset_name(str(imported / "olmoe-variant.yaml")) == "olmoe-variant"
    assert preset_name("olmoe-1b-7b-tiny") == "olmoe-1b-7b-tiny"


def test_a_vocabulary_smaller_than_the_tokenizers_says_the_override_that_fits(
    demo_vocabulary_dataset, tmp_path, capsys
):
    argv = [
        "train",
        "configs/tiny.yaml",
        "--model",
        "olmoe-1b-7b-tiny",
        "model.vocab_size=512",
        f"data.sources.0.path={demo_vocabulary_dataset}",
        f"run.dir={tmp_path}",
        "train.steps=1",
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "model.vocab_size (512) is smaller than the tokenizer's vocabulary (4096)" in error
    assert "set model.vocab_size=4096 (or more)" in error and "init_from" not in error


def test_ferry_models_compares_every_preset_at_one_sequence_length(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("training FLOPs per token at a sequence length of 4,096 (--seq-len); ")
    qwen = next(line for line in out.splitlines() if line.startswith("qwen3-30b-a3b "))
    assert "@4096" in qwen, "its 32k context is not the length it is compared at"
    tiny = next(line for line in out.splitlines() if line.startswith("qwen3-30b-a3b-tiny "))
    assert "@256" in tiny and "qwen3-30b-a3b-tiny at their whole context" in out.splitlines()[0]
    assert main(["models", "--seq-len", "2048", "olmoe-1b-7b"]) == 0
    assert "@2048" in capsys.readouterr().out


def test_an_unknown_preset_exits_2_naming_it_and_the_known_ones(capsys):
    assert main(["models", "deepseek-v9"]) == 2
    error = capsys.readouterr().err
    assert "model preset 'deepseek-v9' is neither a file nor a known model preset" in error and "olmoe-1b-7b" in error
    assert main(["train", "configs/tiny.yaml", "--model", "deepseek-v9"]) == 2


def test_the_mla_bench_suite_resolves_to_an_mla_run(tmp_path):
    """Its measurement is `ferry bench mla-tiny` (the bench machinery has its own tests on moe-tiny); here, that
    the suite is an MLA model of the DeepSeek-V3 family at moe-tiny's size and batch."""
    from ferry.portability.bench.suites import load_suite

    suite, plain = load_suite("mla-tiny"), load_suite("moe-tiny")
    config = suite.run_config(tmp_path, "cpu", [])
    model = config.model
    assert model.attention == "mla" and model.moe.score_func == "sigmoid" and model.moe.topk_group < model.moe.n_group
    for key in ("dim", "n_layers", "vocab_size", "dense_layers"):
        assert getattr(model, key) == plain.config["model"][key], key
    assert config.train.global_batch == plain.config["train"]["global_batch"] and config.data.seq_len == 128


def test_the_mla_demo_config_is_the_suites_model_and_exports_as_deepseek_v3():
    from ferry.interop.architectures import natural_architecture, refusals
    from ferry.portability.bench.suites import load_suite
    from ferry.train import load_run_config

    config = load_run_config("configs/mla-tiny.yaml")
    suite_model = load_suite("mla-tiny").config["model"]
    assert config.model.attention == "mla"
    assert config.model.mla.model_dump(exclude={"latent_norm_eps"}) == suite_model["mla"]
    assert natural_architecture(config.model) == "deepseek_v3" and refusals(config.model, "deepseek_v3") == []

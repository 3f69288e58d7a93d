"""Export to transformers: logits of the exported OLMoE / Qwen3-MoE equal ferry's for odd configs (GQA,
top-k 1 and 3, renormalised or not, tied and untied, dense first layers, YaRN (with its ramp's ends rounded
or exact) and linear RoPE scaling),
a trained checkpoint loads
with AutoModelForCausalLM and AutoTokenizer in a fresh process without network, and configs the
target cannot express are refused (exit 2) before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from ferry.cli.main import main
from ferry.interop.architectures import hf_config, refusals, to_hf_state
from ferry.model import ModelConfig, Transformer
from ferry.train import Trainer

# vocab_size fits the byte-level BPE tokenizers of these tests (257 tokens before their first merge, 280 at most)
BASE = dict(vocab_size=288, dim=32, n_layers=3, n_heads=4, max_seq_len=64, dense_ffn_dim=40, qk_norm=True)
CASES = {
    "olmoe-gqa-top1": ("olmoe", dict(n_kv_heads=2, moe=dict(num_experts=4, top_k=1, expert_ffn_dim=24))),
    "olmoe-top3-renorm-tied": (
        "olmoe",
        dict(n_kv_heads=4, tie_embeddings=True, moe=dict(num_experts=6, top_k=3, expert_ffn_dim=16, renormalize=True)),
    ),
    "qwen3-dense-first-renorm": (
        "qwen3_moe",
        dict(
            n_kv_heads=2,
            qk_norm_scope="head",
            dense_layers=1,
            moe=dict(num_experts=4, top_k=2, expert_ffn_dim=24, renormalize=True),
        ),
    ),
    "olmoe-yarn-x4": (
        "olmoe",
        dict(
            n_kv_heads=2,
            rope_theta=500.0,
            rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=16),
            moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16),
        ),
    ),
    "qwen3-yarn-x8-untruncated": (  # GPT-OSS's YaRN: the ramp's ends not rounded to whole dimensions
        "qwen3_moe",
        dict(
            n_kv_heads=2,
            qk_norm_scope="head",
            rope_theta=500.0,
            rope_scaling=dict(kind="yarn", factor=8.0, original_max_seq_len=32, truncate=False),
            moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16),
        ),
    ),
    "qwen3-linear-x2": (
        "qwen3_moe",
        dict(
            n_kv_heads=2,
            qk_norm_scope="head",
            rope_scaling=dict(kind="linear", factor=2.0),
            moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16),
        ),
    ),
    "qwen3-mqa-top1-tied": (
        "qwen3_moe",
        dict(
            n_kv_heads=1, qk_norm_scope="head", tie_embeddings=True, moe=dict(num_experts=8, top_k=1, expert_ffn_dim=8)
        ),
    ),  # heads twice as wide as dim // n_heads, as Qwen3-30B-A3B's (128 at width 2,048 over 32 heads)
    "qwen3-own-head-dim": (
        "qwen3_moe",
        dict(n_kv_heads=2, head_dim=16, qk_norm_scope="head", moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16)),
    ),
}


def _random_model(config: ModelConfig):
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_logits_equal_ferrys(case):
    arch, overrides = CASES[case]
    config = ModelConfig.model_validate({**BASE, **overrides})
    assert refusals(config, arch) == []
    ours = _random_model(config)
    theirs = AutoModelForCausalLM.from_config(hf_config(config, arch, 0, "float32"), attn_implementation="eager")
    missing, unexpected = theirs.load_state_dict(to_hf_state(ours.state_dict(), config), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if config.tie_embeddings else [])
    tokens_BS = torch.randint(0, config.vocab_size, (3, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_BSV = ours(tokens_BS).logits_BSV
        theirs_BSV = theirs(tokens_BS).logits.float()
    relative = ((ours_BSV - theirs_BSV).norm() / theirs_BSV.norm()).item()
    assert relative < 1e-5, f"{case}: relative difference {relative:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_transformers_config_reads_back_as_the_same_model(case):
    from ferry.interop.architectures import model_config_from_hf

    arch, overrides = CASES[case]
    config = ModelConfig.model_validate({**BASE, **overrides})
    back, back_arch = model_config_from_hf(hf_config(config, arch, 0, "float32"))
    assert back_arch == arch
    assert back.rope_scaling == config.rope_scaling and back.rope_theta == config.rope_theta
    assert back.moe.model_dump() == {**config.moe.model_dump(), "aux_loss_coef": back.moe.aux_loss_coef}


def test_a_head_width_of_its_own_goes_to_transformers_and_back_and_olmoe_refuses_it():
    arch, overrides = CASES["qwen3-own-head-dim"]
    config = ModelConfig.model_validate({**BASE, **overrides})
    assert Transformer(config).layers[0].attn.wq.weight.shape == (4 * 16, 32)
    hf = hf_config(config, arch, 0, "float32")
    assert hf.head_dim == 16
    from ferry.interop.architectures import model_config_from_hf, natural_architecture

    back, _ = model_config_from_hf(hf)
    assert back.head_dim == 16 and back.model_dump()["head_dim"] == 16
    assert natural_architecture(config.model_copy(update={"qk_norm_scope": "projection"})) == "qwen3_moe"
    olmoe = config.model_copy(update={"qk_norm_scope": "projection"})
    assert any(problem.startswith("model.head_dim 16: olmoe") for problem in refusals(olmoe, "olmoe"))
    default = ModelConfig.model_validate({**BASE, **CASES["qwen3-linear-x2"][1]})
    assert "head_dim" not in hf_config(default, "qwen3_moe", 0, "float32").to_dict(), "an export writes what it wrote"


@pytest.mark.parametrize(
    "arch, overrides, named",
    [
        ("olmoe", dict(moe=dict(score_func="sigmoid")), "model.moe.score_func"),
        ("olmoe", dict(moe=dict(shared_expert_ffn_dim=16)), "model.moe.shared_expert_ffn_dim"),
        ("olmoe", dict(dense_layers=1), "model.dense_layers"),
        ("olmoe", dict(qk_norm=False), "model.qk_norm"),
        ("qwen3_moe", dict(), "model.qk_norm_scope"),
    ],
)
def test_what_the_target_cannot_express_is_named(arch, overrides, named):
    config = ModelConfig.model_validate({**BASE, "n_kv_heads": 2, **overrides})
    assert any(problem.startswith(named) for problem in refusals(config, arch))


@pytest.fixture(scope="module")
def trained_checkpoint(stdlib_dataset, tmp_path_factory):
    """A Qwen3-MoE-shaped tiny run (dense first layer, per-head q/k norm), trained a few steps."""
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("export") / "run"
    config = tiny_config(stdlib_dataset, run_dir, "model.qk_norm=true", "model.qk_norm_scope=head", "train.steps=2")
    Trainer(config).fit()
    return sorted((run_dir / "checkpoints").iterdir())[-1]


def test_an_export_loads_offline_in_a_fresh_process_and_gives_ferrys_logits(trained_checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(trained_checkpoint), str(out)]) == 0
    assert "qwen3_moe" in capsys.readouterr().out
    probe = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, local_files_only=True)
tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, local_files_only=True)
ids = tokenizer("def main():\\n    return 0", return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({{"type": model.config.model_type, "ids": ids[0].tolist(), "logits": logits[0, -1, :8].tolist(),
                  "eos": tokenizer.eos_token, "round": tokenizer.decode(ids[0])}}))
"""
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=offline, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["type"] == "qwen3_moe" and loaded["eos"] == "<|endoftext|>"
    assert loaded["round"] == "def main():\n    return 0"
    from ferry.checkpoint import verify_checkpoint
    from ferry.interop.weights import checkpoint_model_config, read_model_state

    checkpoint = verify_checkpoint(trained_checkpoint)
    model = Transformer(checkpoint_model_config(checkpoint))
    model.load_state_dict(read_model_state(checkpoint))
    with torch.no_grad():
        ours = model.eval()(torch.tensor([loaded["ids"]])).logits_BSV[0, -1, :8]
    assert torch.allclose(ours, torch.tensor(loaded["logits"]), rtol=1e-5, atol=1e-5)


def test_an_unexportable_checkpoint_exits_2_and_writes_nothing(trained_checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(trained_checkpoint), str(out), "--arch", "olmoe"]) == 2
    error = capsys.readouterr().err
    assert "model.qk_norm_scope" in error and "model.dense_layers" in error
    assert not out.exists()


def _model_tensors(path) -> dict[str, torch.Tensor]:
    from ferry.checkpoint import verify_checkpoint
    from ferry.interop.weights import read_model_state

    return read_model_state(verify_checkpoint(path))


def test_import_of_an_export_gives_the_same_weights_bit_for_bit_and_trains_from_them(
    trained_checkpoint, stdlib_dataset, tmp_path, capsys
):
    from conftest import tiny_config

    hf_dir, imported = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(trained_checkpoint), str(hf_dir)]) == 0
    assert main(["import", str(hf_dir), str(imported)]) == 0
    assert "weights only" in capsys.readouterr().out
    checkpoint = imported / "checkpoints" / "step-00000000"
    original, back = _model_tensors(trained_checkpoint), _model_tensors(checkpoint)
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    from tokenizers import Tokenizer

    ours, theirs = (
        Tokenizer.from_file(str(path)) for path in (stdlib_dataset / "tokenizer.json", imported / "tokenizer.json")
    )
    assert theirs.get_vocab() == ours.get_vocab()
    sample = "import os\n\ndef main(argv):\n    return len(argv)  # <|endoftext|>"
    assert theirs.encode(sample).ids == ours.encode(sample).ids
    model_section = yaml.safe_load((imported / "model.yaml").read_text())["model"]
    assert model_section["qk_norm_scope"] == "head" and model_section["dense_layers"] == 1

    def first_losses(name: str, *overrides: str) -> list[float]:
        run_dir = tmp_path / name
        config = tiny_config(
            stdlib_dataset, run_dir, "model.qk_norm=true", "model.qk_norm_scope=head", "train.steps=2", *overrides
        )
        return Trainer(config).fit().losses

    from_import = first_losses("a", f"init_from={checkpoint}")
    assert from_import == first_losses("b", f"init_from={trained_checkpoint}")
    assert from_import != first_losses("c")


def test_an_olmoe_round_trip_is_bitwise_too(tmp_path):
    from ferry.checkpoint import Layout, TensorPiece
    from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint
    from ferry.interop import export_checkpoint, import_hf

    arch, overrides = CASES["olmoe-top3-renorm-tied"]
    config = ModelConfig.model_validate({**BASE, **overrides})
    state = _random_model(config).state_dict()
    meta = CheckpointMeta(
        0, 0, Layout(world_size=1, ep_degree=1, mode="ep"), config.model_dump(mode="json"), {}, {}, {}
    )
    path = save_checkpoint(
        tmp_path / "ckpt", {f"model.{n}": TensorPiece.whole(t.contiguous()) for n, t in state.items()}, meta
    )
    tokenizer = tmp_path / "tokenizer.json"
    _write_tokenizer(tokenizer, config.vocab_size)
    exported = export_checkpoint(path, tmp_path / "hf", arch, tokenizer=tokenizer)
    result = import_hf(tmp_path / "hf", tmp_path / "back")
    back = _model_tensors(result.checkpoint)
    assert result.arch == "olmoe" and sorted(back) == sorted(state)
    unique = sum(param.numel() for param in _random_model(config).parameters())  # the tied matrix counted once
    assert result.parameters == exported.parameters == unique
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def _write_tokenizer(path, vocab_size: int) -> None:
    from ferry.data.tokenizer import BPETokenizer

    text = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
    path.write_text(BPETokenizer.train(text, vocab_size).to_json())


def test_import_refuses_what_ferry_cannot_compute(tmp_path, capsys):
    from transformers import OlmoeConfig

    hf_dir = tmp_path / "hf"
    config = OlmoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        clip_qkv=8.0,
        eos_token_id=0,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    assert main(["import", str(hf_dir), str(tmp_path / "out")]) == 2
    assert "clip_qkv" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["import", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2


def test_export_overwrite_replaces_an_earlier_export_only(tmp_path, capsys):
    """Never the run directory that holds the checkpoint, never a directory that is not a transformers one."""
    from ferry.checkpoint import Layout, TensorPiece
    from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint

    arch, overrides = CASES["olmoe-top3-renorm-tied"]
    config = ModelConfig.model_validate({**BASE, **overrides})
    state = _random_model(config).state_dict()
    meta = CheckpointMeta(
        0, 0, Layout(world_size=1, ep_degree=1, mode="ep"), config.model_dump(mode="json"), {}, {}, {}
    )
    run = tmp_path / "run"
    pieces = {f"model.{n}": TensorPiece.whole(t.contiguous()) for n, t in state.items()}
    path = save_checkpoint(run / "checkpoints", pieces, meta)
    tokenizer = tmp_path / "tokenizer.json"
    _write_tokenizer(tokenizer, config.vocab_size)
    export = ["export", str(path), "--tokenizer", str(tokenizer), "--arch", arch, "--overwrite"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("kept")
    for out in (run, tmp_path / "notes"):
        assert main([*export[:2], str(out), *export[2:]]) == 2
        assert "is not an earlier export" in capsys.readouterr().err
    assert (tmp_path / "notes" / "keep.txt").read_text() == "kept" and (path / "manifest.json").is_file()
    assert main([*export[:2], str(tmp_path / "hf"), *export[2:]]) == 0
    assert main([*export[:2], str(tmp_path / "hf"), *export[2:]]) == 0, "an earlier export is replaced"


def test_import_of_a_truncated_weights_file_exits_2_naming_the_directory(tmp_path, capsys):
    from transformers import OlmoeConfig

    hf_dir = tmp_path / "hf"
    config = OlmoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=0,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["import", str(hf_dir), str(tmp_path / "out")]) == 2
    assert f"{hf_dir}: transformers cannot load its weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_both_ways(tmp_path, capsys):
    from ferry.checkpoint import Layout, TensorPiece
    from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint
    from ferry.data.tokenizer import load_tokenizer

    arch, overrides = CASES["olmoe-top3-renorm-tied"]
    config = ModelConfig.model_validate({**BASE, **overrides, "vocab_size": 272})
    state = _random_model(config).state_dict()
    meta = CheckpointMeta(
        0, 0, Layout(world_size=1, ep_degree=1, mode="ep"), config.model_dump(mode="json"), {}, {}, {}
    )
    path = save_checkpoint(
        tmp_path / "ckpt", {f"model.{n}": TensorPiece.whole(t.contiguous()) for n, t in state.items()}, meta
    )
    larger = tmp_path / "larger.json"
    _write_tokenizer(larger, BASE["vocab_size"])
    tokens = load_tokenizer(larger).vocab_size
    assert tokens > config.vocab_size
    assert main(["export", str(path), str(tmp_path / "hf"), "--tokenizer", str(larger), "--arch", arch]) == 2
    assert f"has {tokens} tokens, more than the model's vocabulary ({config.vocab_size})" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    fitting = tmp_path / "tokenizer.json"
    _write_tokenizer(fitting, config.vocab_size)
    assert main(["export", str(path), str(tmp_path / "hf"), "--tokenizer", str(fitting), "--arch", arch]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back"), "--tokenizer", str(larger)]) == 2
    assert f"has {tokens} tokens, more than the model's vocabulary ({config.vocab_size})" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()


def test_export_of_a_run_directory_takes_its_newest_checkpoint_and_names_it(tmp_path, capsys):
    """As `ferry generate` and `ferry eval` do; a directory that is neither a checkpoint nor a run is named."""
    from ferry.checkpoint import Layout, TensorPiece
    from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint
    from ferry.interop import import_hf

    config = ModelConfig.model_validate({**BASE, **CASES["olmoe-top3-renorm-tied"][1]})
    run = tmp_path / "run"
    base, states = _random_model(config).state_dict(), {}
    layout = Layout(world_size=1, ep_degree=1, mode="ep")
    for step in (3, 5):  # the bias stays zero: OLMoE has none
        states[step] = {name: value if name.endswith("expert_bias_E") else value + step for name, value in base.items()}
        meta = CheckpointMeta(step, 0, layout, config.model_dump(mode="json"), {}, {}, {})
        pieces = {f"model.{name}": TensorPiece.whole(tensor.contiguous()) for name, tensor in states[step].items()}
        save_checkpoint(run / "checkpoints", pieces, meta)
    tokenizer = tmp_path / "tokenizer.json"
    _write_tokenizer(tokenizer, config.vocab_size)
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--tokenizer", str(tokenizer)]) == 0
    assert f"ferry: exported {run / 'checkpoints' / 'step-00000005'} (step 5) as olmoe" in capsys.readouterr().out
    back = _model_tensors(import_hf(out, tmp_path / "back").checkpoint)
    assert sorted(back) == sorted(states[5])
    for name, tensor in back.items():
        assert torch.equal(tensor, states[5][name]), name

    (tmp_path / "notes").mkdir()
    (tmp_path / "started" / "checkpoints").mkdir(parents=True)  # a run that has saved nothing yet
    for source in (tmp_path / "notes", tmp_path / "started"):
        for command in (["export", str(source), str(tmp_path / "other")], ["generate", str(source), "--prompt", "a"]):
            assert main(command) == 2
            error = capsys.readouterr().err
            assert f"{source} is not a checkpoint (it has no manifest.json)" in error and "Traceback" not in error
    assert not (tmp_path / "other").exists()

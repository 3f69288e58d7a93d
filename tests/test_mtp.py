"""Multi-token prediction (`model.mtp`): module k predicts the token k + 1 places past the next; its targets stop at
the row's and the document's end; its loss joins the objective and trains the model's trunk; each depth's loss is
in the step record; expert parallelism with ZeRO-1, FSDP and recomputation train it as one process; what cannot
compute it is refused by name. DeepSeek-V3's export keeps the modules at layers `n_layers` onward: transformers
loads the export reporting them as unexpected keys, with ferry's main logits, and transformers' own MTP layer
(`MtpModel`) given those weights gives ferry's logits at every depth; the import reads them back bit for bit."""

from __future__ import annotations

import json
import re

import distributed_training as runs
import pytest
import torch
from test_mla import mla_config

from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.config import ConfigError
from ferry.data.targets import IGNORE_INDEX
from ferry.model import ModelConfig, Transformer
from ferry.model.mtp import ahead, targets_ahead
from ferry.train import Trainer

LAYOUT_TOLERANCE = 1e-5  # as tests/test_distributed_training.py
MTP_RUN = ("model.mtp.depth=2", "model.mtp.loss_weight=0.5", "train.steps=4")


def test_module_k_reads_the_token_k_ahead_and_predicts_within_the_row_and_the_document():
    tokens_BS = torch.tensor([[10, 11, 12, 13, 14, 15]])
    assert ahead(tokens_BS, 2, 0).tolist() == [[12, 13, 14, 15, 0, 0]]
    targets_BS = torch.tensor([[11, 12, 13, 14, 15, IGNORE_INDEX]])
    documents_BS = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert targets_ahead(targets_BS, 1, None).tolist() == [[12, 13, 14, 15, IGNORE_INDEX, IGNORE_INDEX]]
    within_documents = [[12, 13, IGNORE_INDEX, 15, IGNORE_INDEX, IGNORE_INDEX]]
    assert targets_ahead(targets_BS, 1, documents_BS).tolist() == within_documents


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("mtp") / "run"
    result = Trainer(tiny_config(stdlib_dataset, run_dir, *MTP_RUN)).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, result.losses, records


def test_each_depths_loss_is_recorded_and_the_modules_train_the_trunk(single, stdlib_dataset, tmp_path):
    from conftest import tiny_config

    _, losses, records = single
    assert all(set(record["mtp.loss"]) == {"1", "2"} for record in records)
    assert all(4.0 < value < 8.0 for record in records for value in record["mtp.loss"].values())
    Trainer(tiny_config(stdlib_dataset, tmp_path / "plain", "train.steps=4")).fit()
    plain = [json.loads(line)["lm_loss"] for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    ours = [record["lm_loss"] for record in records]
    assert plain[0] == pytest.approx(ours[0], rel=1e-6), "the modules draw after the model: the same first forward"
    assert all(abs(a - b) > 1e-5 for a, b in zip(plain[1:], ours[1:])), "their gradients reach the shared trunk"


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.ep=2", "optim.zero=true"),
        ("parallel.mode=fsdp",),
        ("parallel.ep=2", "train.activation_checkpointing=selective"),
    ],
    ids=["ep2-zero", "fsdp2", "ep2-recomputed"],
)
def test_every_layout_that_holds_whole_rows_trains_mtp_as_one_process(single, stdlib_dataset, tmp_path, layout):
    _, losses, records = single
    ranks = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), *MTP_RUN, *layout)
    assert max(abs(a - b) / b for a, b in zip(ranks[0]["losses"], losses, strict=True)) < LAYOUT_TOLERANCE
    for ours, theirs in zip(ranks[0]["records"], records, strict=True):
        for depth in ("1", "2"):
            assert ours["mtp.loss"][depth] == pytest.approx(theirs["mtp.loss"][depth], rel=LAYOUT_TOLERANCE)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("parallel.pp=2",), "pp 2: model.mtp's modules need the embedding on the last stage"),
        (("parallel.cp=2",), "cp 2: model.mtp's modules read tokens further on in the row"),
        (("train.objective=dpo",), "model.mtp trains with the next-token objective (lm); dpo scores sequences"),
    ],
)
def test_what_cannot_compute_mtp_is_refused_by_name(stdlib_dataset, tmp_path, overrides, message):
    from conftest import tiny_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(stdlib_dataset, tmp_path, "model.mtp.depth=1", *overrides)


def _mtp_model() -> Transformer:
    config = ModelConfig.model_validate({**mla_config("full-queries-yarn").model_dump(), "mtp": {"depth": 2}})
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0.0, 0.2)
    return model.eval()


def _transformers_mtp(directory, main_model, config: ModelConfig):
    """transformers' own MTP layers (`MtpModel`) with the export's modules: its loader finds them only at
    DeepSeek-V3's layer 61, so they are renamed here by the conversions it registers for DeepSeek's names."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(main_model, config.mtp.depth)
    renamed = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        for depth in range(config.mtp.depth):
            prefix = f"model.layers.{config.n_layers + depth}."
            rest = name.removeprefix(prefix)
            if rest == name or rest in ("embed_tokens.weight", "shared_head.head.weight"):
                continue
            if rest == "shared_head.norm.weight":
                renamed[f"layers.{depth}.post_norm.weight"] = tensor
            elif rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                renamed[f"layers.{depth}.{rest}"] = tensor
            else:
                renamed[f"layers.{depth}.mtp_block.{rest}"] = tensor
    result = mtp.load_state_dict(renamed, strict=False)
    assert sorted(result.missing_keys) == ["embed_tokens.weight", "shared_head.weight"] and not result.unexpected_keys
    return mtp.eval()


def test_a_deepseek_v3_export_keeps_the_modules_where_deepseek_does_and_transformers_computes_them_as_ferry(
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    from ferry.interop.architectures import hf_config, to_hf_state
    from ferry.interop.deepseek import mtp_layer_prefixes
    from ferry.interop.importing import read_hf_dir
    from ferry.interop.weights import append_safetensors

    ours = _mtp_model()
    config = ours.config
    state = to_hf_state(ours.state_dict(), config, "deepseek_v3")
    prefixes = tuple(mtp_layer_prefixes(config.n_layers, config.mtp.depth))
    writer = AutoModelForCausalLM.from_config(hf_config(config, "deepseek_v3", 0, "float32"))
    writer.load_state_dict({name: tensor for name, tensor in state.items() if not name.startswith(prefixes)})
    writer.save_pretrained(tmp_path / "hf")
    append_safetensors(tmp_path / "hf", {name: tensor for name, tensor in state.items() if name.startswith(prefixes)})

    theirs, report = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager"
    )
    assert not report["missing_keys"] and not report["mismatched_keys"]
    unexpected_layers = {name.split(".")[2] for name in report["unexpected_keys"]}
    assert unexpected_layers == {str(config.n_layers), str(config.n_layers + 1)}
    tokens_BS = torch.randint(0, config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(3))
    mtp = _transformers_mtp(tmp_path / "hf", theirs, config)
    with torch.no_grad():
        output = theirs(tokens_BS, output_hidden_states=True)
        assert ((output.logits - ours(tokens_BS).logits_BSV).norm() / output.logits.norm()) < 1e-5
        ours_logits = ours.mtp_logits(tokens_BS)
        h_BSD, positions = output.hidden_states[-1], torch.arange(tokens_BS.shape[1])[None]
        for depth in range(1, config.mtp.depth + 1):  # module k reads token i + k, at position i + k
            h_BSD = mtp.forward_layer(
                depth - 1, h_BSD[:, :-1], positions[:, depth:], None, input_ids=tokens_BS[:, depth:]
            )
            their_logits = mtp._project_to_logits(h_BSD)
            ours_at = ours_logits[depth - 1][:, : tokens_BS.shape[1] - depth]
            assert ((their_logits - ours_at).norm() / their_logits.norm()) < 1e-5, depth

    imported_config, arch, imported = read_hf_dir(tmp_path / "hf")
    assert arch == "deepseek_v3" and imported_config.mtp.depth == config.mtp.depth
    for name, tensor in ours.state_dict().items():
        assert torch.equal(imported[name], tensor), name


def test_a_trained_mtp_run_exports_imports_and_refuses_an_architecture_without_modules(
    stdlib_dataset, tmp_path, capsys
):
    from conftest import tiny_config
    from test_interop_deepseek import MLA_RUN

    from ferry.checkpoint import latest_checkpoint
    from ferry.interop.weights import read_model_state

    run_dir = tmp_path / "run"
    Trainer(tiny_config(stdlib_dataset, run_dir, *MLA_RUN, "model.mtp.depth=1", "train.steps=2")).fit()
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    original = read_model_state(latest_checkpoint(run_dir))
    back = read_model_state(latest_checkpoint(tmp_path / "imported"))
    assert sorted(original) == sorted(back) and any(name.startswith("mtp.0.") for name in back)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    capsys.readouterr()
    gqa = tmp_path / "gqa"
    Trainer(
        tiny_config(
            stdlib_dataset, gqa, "model.mtp.depth=1", "model.qk_norm=true", "model.qk_norm_scope=head", "train.steps=1"
        )
    ).fit()
    assert main(["export", str(gqa), str(tmp_path / "qwen")]) == 2
    assert "model.mtp.depth: qwen3_moe has no multi-token-prediction modules (deepseek_v3 keeps them)" in (
        capsys.readouterr().err
    )

"""Muon for the hidden matrices (each expert's on its own), AdamW for the rest: equal to torch.optim.Muon where both
apply, on every layout equal to one process (Newton-Schulz in fp32; in bf16 a last-bit change of its input moves
its output by ~0.5%), its state in the neutral checkpoint, and a change of optimizer refused at a resume.

Layout tolerance, fixed before measuring: 1e-5 relative on the loss of every step over 10 steps."""

from __future__ import annotations

import json
import math

import distributed_training as runs
import pytest
import torch

from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.config import UserError
from ferry.model import ModelConfig, Transformer
from ferry.parallel.newton_schulz import orthogonalise
from ferry.parallel.optimizers.muon import MuonSettings, MuonWithAdamW, muon_parameter_names
from ferry.parallel.ownership import slices_by_owner
from ferry.train import Trainer
from ferry.train.memory import memory_estimate

MODEL = ModelConfig(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=32,
    dense_layers=1,
    dense_ffn_dim=64,
    moe={"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16, "shared_expert_ffn_dim": 16},
)
FP32_MUON = ("optim.name=muon", "optim.muon.ns_dtype=fp32")
TOLERANCE = 1e-5


def _settings(names: set[str], ns_dtype: str = "bf16") -> MuonSettings:
    return MuonSettings(frozenset(names), 0.95, True, 5, ns_dtype, "match_rms_adamw")


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    names = muon_parameter_names(Transformer(MODEL))
    assert {
        "layers.0.attn.wq.weight",
        "layers.0.ffn.w_down.weight",
        "layers.1.ffn.experts.w_gate_EFD",
        "layers.1.ffn.shared_expert.w_up.weight",
    } <= names
    assert not names & {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.1.ffn.router.weight_ED",
        "layers.0.attn_norm.weight",
    }


def test_on_matrices_in_bf16_it_is_torch_muon():
    """Same momentum form (PyTorch's lerp, Nesterov), Newton-Schulz, RMS-matched scale and decoupled decay."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in ((48, 32), (16, 40), (32, 32))]
    theirs = [torch.nn.Parameter(param.detach().clone()) for param in ours]
    named = [(f"w{index}", param) for index, param in enumerate(ours)]
    names = {name for name, _ in named}
    muon = MuonWithAdamW(named, names, 0.1, _settings(names), lr=0.02)
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(5):
        for mine, peer in zip(ours, theirs):
            mine.grad = torch.randn_like(mine)
            peer.grad = mine.grad.clone()
        muon.step()
        reference.step()
    for mine, peer in zip(ours, theirs):  # the same operations on the same machine: the same bits
        assert torch.equal(mine, peer)
        assert torch.equal(muon.state[mine]["momentum_buffer"], reference.state[peer]["momentum_buffer"])


def test_each_expert_matrix_is_orthogonalised_on_its_own():
    torch.manual_seed(1)
    experts_EFD = torch.randn(4, 16, 32)
    batched = orthogonalise(experts_EFD, 5, torch.float32)
    for expert in range(4):
        torch.testing.assert_close(
            batched[expert], orthogonalise(experts_EFD[expert], 5, torch.float32), rtol=1e-5, atol=1e-5
        )
    singular = torch.linalg.svdvals(batched)
    assert 0.5 < singular.min() and singular.max() < 1.5, "Newton-Schulz's quintic lands near 1, not on it"


def test_a_muon_run_trains_saves_its_momentum_and_resumes_as_if_never_stopped(make_config, tmp_path, capsys):
    whole = Trainer(make_config("optim.name=muon", "train.steps=6", run_dir=tmp_path / "whole")).fit()
    assert whole.losses[-1] < whole.losses[0]
    first = Trainer(
        make_config("optim.name=muon", "train.steps=6", "checkpoint.interval=3", run_dir=tmp_path / "split")
    )
    first.fit(stop_at=3)
    manifest = json.loads((tmp_path / "split" / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert manifest["format_version"] == 4 and manifest["train_state"]["optimizer"]["kind"] == "Muon"
    tensors = manifest["tensors"]
    assert "optim.momentum_buffer.layers.0.attn.wq.weight" in tensors
    assert tensors["optim.momentum_buffer.layers.1.ffn.experts.w_up_EFD"]["shape"] == [4, 32, 32]
    assert "optim.exp_avg.layers.0.attn.wq.weight" not in tensors and "optim.exp_avg.output.weight" in tensors
    assert main(["ckpt", "inspect", str(tmp_path / "split" / "checkpoints" / "step-00000003")]) == 0
    inspected = capsys.readouterr().out
    assert "  format      ferry-checkpoint v4" in inspected
    assert (
        "  optimizer   Muon: step of 8 parameters, exp_avg of 8 parameters, exp_avg_sq of 8 parameters, "
        "momentum_buffer of 14 parameters" in inspected
    )  # the embedding, head, 4 norms and the router: AdamW
    resumed = Trainer(make_config("optim.name=muon", "train.steps=6", "resume=latest", run_dir=tmp_path / "split"))
    assert resumed.fit().losses == whole.losses[3:]
    record = json.loads((tmp_path / "split" / "run.json").read_text())
    assert record["resumed_from"]["carried"]["optimizer"].startswith("carried (Muon momentum")


def test_a_resume_across_optimizers_is_refused_naming_the_way_to_switch(make_config, tmp_path, capsys):
    Trainer(make_config("train.steps=2", "checkpoint.interval=2", run_dir=tmp_path / "adamw")).fit()
    with pytest.raises(UserError) as refused:
        Trainer(make_config("optim.name=muon", "train.steps=4", "resume=latest", run_dir=tmp_path / "adamw")).fit()
    assert "holds AdamW state and this run trains with Muon (optim.name muon)" in str(refused.value)
    checkpoint = tmp_path / "adamw" / "checkpoints" / "step-00000002"
    assert f"init_from={checkpoint} init_optimizer=false" in str(refused.value)
    switched = Trainer(
        make_config("optim.name=muon", "train.steps=2", f"init_from={checkpoint}", run_dir=tmp_path / "muon")
    )
    assert len(switched.fit().losses) == 2


def test_the_memory_model_counts_one_buffer_for_the_matrices(make_config):
    adamw = memory_estimate(make_config(), 1, "cpu")
    muon = memory_estimate(make_config("optim.name=muon"), 1, "cpu")
    assert muon.state_bytes < adamw.state_bytes and muon.backward_bytes == adamw.backward_bytes


@pytest.fixture(scope="module")
def one_process(stdlib_dataset, tmp_path_factory):
    return runs.train_run(
        str(stdlib_dataset),
        str(tmp_path_factory.mktemp("muon-one")),
        *FP32_MUON,
        "model.n_layers=4",
        "train.micro_batch=2",
    )


@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        (2, ("parallel.ep=2",)),
        (2, ("parallel.ep=2", "optim.zero=true")),
        (2, ("optim.zero=true",)),
        (2, ("parallel.pp=2",)),
        (4, ("parallel.pp=2", "parallel.ep=2", "optim.zero=true")),
        (2, ("parallel.mode=fsdp",)),
    ],
    ids=["ep2", "ep2-zero", "dp2-zero", "pp2", "pp2-ep2-zero", "fsdp2"],
)
def test_every_layout_trains_as_one_process_does(one_process, stdlib_dataset, tmp_path, ranks, layout):
    """Whole matrices everywhere: experts resident, each ZeRO owner orthogonalising the matrices it owns whole,
    each pipeline stage its own, FSDP's shards gathered whole first."""
    laid_out = run_on_ranks(
        runs.train_run,
        ranks,
        str(stdlib_dataset),
        str(tmp_path),
        *FP32_MUON,
        "model.n_layers=4",
        "train.micro_batch=2",
        *layout,
    )
    losses, alone = laid_out[0]["losses"], one_process["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, alone, strict=True)) < TOLERANCE
    assert math.isfinite(laid_out[0]["records"][-1]["grad_norm"])


# Three layers over two ZeRO owners: rank 0 owns experts 0-2 of layer 1's w_up, rank 1 expert 3
SPLIT_STACK = ModelConfig(
    vocab_size=512,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    dense_layers=1,
    dense_ffn_dim=64,
    moe={"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32},
)


@pytest.mark.parametrize("ranks", [2, 4])
def test_zero_owns_each_expert_matrix_and_spreads_the_matrices_by_size(ranks):
    params = list(Transformer(SPLIT_STACK).named_parameters())
    by_owner = slices_by_owner(params, ranks)
    assert any(not piece.whole for owned in by_owner for piece in owned), "a stack is split between owners"
    for name, param in params:
        rows = sorted((piece.start, piece.stop) for owned in by_owner for piece in owned if piece.name == name)
        assert [start for start, _ in rows] == [0] + [stop for _, stop in rows[:-1]] and rows[-1][1] == param.shape[0]
    loads = [sum(piece.tensor.numel() for piece in owned) for owned in by_owner]
    largest_piece = max(param[0].numel() if param.ndim >= 3 else param.numel() for _, param in params)
    assert max(loads) - min(loads) <= largest_piece, "every rank's load within one piece of another's"


def test_a_stack_split_between_zero_owners_trains_and_resumes_as_one_process(stdlib_dataset, tmp_path):
    """The owners of one layer's experts orthogonalise their own experts' matrices, and the checkpoint holds each
    owner's rows of the momentum: it resumes in one process, and one process's checkpoint in the split layout."""
    split_stack = ("model.n_layers=3", *FP32_MUON)
    alone = runs.train_run(str(stdlib_dataset), str(tmp_path / "one"), *split_stack)["losses"]
    zero = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "zero"), *split_stack, "optim.zero=true"
    )[0]["losses"]
    from_zero = runs.train_run(
        str(stdlib_dataset),
        str(tmp_path / "from-zero"),
        *split_stack,
        f"resume={tmp_path / 'zero' / 'checkpoints' / 'step-00000005'}",
    )["losses"]
    into_zero = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path / "into-zero"),
        *split_stack,
        "optim.zero=true",
        f"resume={tmp_path / 'one' / 'checkpoints' / 'step-00000005'}",
    )
    for losses, expected in [(zero, alone), (from_zero, alone[5:]), (into_zero[0]["losses"], alone[5:])]:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)) < TOLERANCE


def test_under_fsdp_each_matrix_is_orthogonalised_once_by_its_owner(stdlib_dataset, tmp_path):
    """Each rank gathers the matrices it owns and orthogonalises only those; the experts, sharded by expert, where
    they are: over the ranks, every matrix once a step (on every rank alike it would be twice)."""
    ranks = run_on_ranks(
        runs.train_counting_orthogonalised,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        *FP32_MUON,
        "parallel.mode=fsdp",
        "train.steps=3",
    )
    model = Transformer(runs.tiny_config(str(stdlib_dataset), str(tmp_path)).model)
    matrices = sum(
        param.shape[0] if param.ndim >= 3 else 1
        for name, param in model.named_parameters()
        if name in muon_parameter_names(model)
    )
    assert sum(rank["matrices"] for rank in ranks) == 3 * matrices
    assert all(rank["matrices"] > 0 for rank in ranks)


def test_ferry_train_takes_muon_from_the_command_line(stdlib_dataset, tmp_path, capsys):
    from conftest import REPO

    code = main(
        [
            "train",
            str(REPO / "configs" / "tiny.yaml"),
            f"data.sources.0.path={stdlib_dataset}",
            "model.vocab_size=512",
            f"run.dir={tmp_path}",
            "train.steps=3",
            "eval.sources=[]",
            "optim.name=muon",
        ]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    config = json.loads((tmp_path / "run.json").read_text())["config"]["optim"]
    assert config["name"] == "muon" and config["muon"]["ns_steps"] == 5 and config["muon"]["nesterov"] is True


def test_ferry_launch_explains_the_memory_a_muon_rank_holds(tmp_path):
    """At Moonlight's shape on two 8-GPU nodes: Muon's one buffer for the matrices where AdamW keeps two moments."""
    from conftest import REPO

    from ferry.launch.environment import explain
    from ferry.launch.spec import build_launch_spec
    from ferry.model.presets import preset_overrides

    def memory_line(*overrides: str) -> str:
        spec = build_launch_spec(
            str(REPO / "configs" / "tiny.yaml"),
            [*preset_overrides("moonlight-16b-a3b"), "train.micro_batch=1", "parallel.ep=16", *overrides],
            platform="p5.48xlarge",
            nodes=2,
            master_addr="10.1.0.11",
            image="registry.example.com/ferry:0.1.0",
            workdir=tmp_path,
        )
        return explain(spec).splitlines()[1]

    adamw, muon = memory_line(), memory_line("optim.name=muon")
    assert "parameters, gradients and AdamW moments" in adamw
    assert "parameters, gradients and Muon momentum and AdamW moments" in muon

    def state_gib(line: str) -> float:
        return float(line.split("moments ")[1].split(" GiB")[0].replace(",", ""))

    assert state_gib(muon) < state_gib(adamw)

"""How a step runs on a device: weights cast once a step, the micro-batch the memory model picks, compiling by
default where it pays."""

import json

import pytest
import torch

from ferry.config import UserError
from ferry.kernels import select_kernels
from ferry.kernels.config import KernelsConfig
from ferry.metrics.parameter_traffic import ParameterTraffic
from ferry.model import ModelConfig, Transformer
from ferry.precision.step_weights import StepWeights
from ferry.train import Trainer
from ferry.train import memory as memory_model
from ferry.train.assembly import resolve_compile

BF16 = "precision.compute_dtype=bf16"


def test_weights_cast_once_a_step_train_bit_for_bit_as_autocast_does(make_config, tmp_path):
    """bf16 compute on fp32 parameters, 2 micro-batches a step, 4 steps: the same casts and the same fp32 sums
    in the same order, so identical losses and final weights."""
    per_use = Trainer(make_config(BF16, "train.steps=4", "precision.weight_casts=micro_batch", run_dir=tmp_path / "a"))
    per_step = Trainer(make_config(BF16, "train.steps=4", run_dir=tmp_path / "b"))
    assert per_step.fit().losses == per_use.fit().losses
    reference = per_use.model.state_dict()
    for name, tensor in per_step.model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
    casts = json.loads((tmp_path / "b" / "run.json").read_text())["weight_casts"]
    parameters = per_step.model.named_parameters()
    copied = sum(p.numel() for name, p in parameters if p.dim() >= 2 and "embeddings" not in name)
    assert casts == {"mode": "once a step", "parameters": copied, "dtype": "torch.bfloat16"}


def _traffic(weight_casts: str, micro_batches: int) -> ParameterTraffic:
    """One step of 8 sequences in `micro_batches` forwards and backwards, bf16 compute on fp32 weights."""
    config = {
        "vocab_size": 97,
        "dim": 40,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 64,
        "dense_layers": 1,
        "dense_ffn_dim": 56,
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 24},
    }
    torch.manual_seed(0)
    kernels = select_kernels(KernelsConfig(), "cpu", torch.float32)
    model = Transformer(ModelConfig.model_validate(config), kernels)
    step_weights = StepWeights(model, torch.bfloat16) if weight_casts == "step" else None
    tokens_BS = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(0))
    with ParameterTraffic(model) as traffic:
        for micro_BS in tokens_BS.split(8 // micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if step_weights is not None:
                    step_weights.hold()
                loss = model(micro_BS).logits_BSV.float().logsumexp(-1).mean()
            loss.backward()
        if step_weights is not None:
            step_weights.release()
    return traffic


def test_weight_and_gradient_casts_do_not_grow_with_the_micro_batches():
    """Counted op by op: cast once a step, the bytes of weight and gradient casts stay those of one micro-batch
    (382,560 here) at 2, 4 and 8; cast per use they grow 8-fold. What still grows is the accumulation of each
    micro-batch's gradient into the fp32 one, fused (bf16 read into fp32): 15% fewer bytes than autocast's cast
    then add."""
    once = {m: _traffic("step", m) for m in (1, 2, 4, 8)}
    per_use = {m: _traffic("micro_batch", m) for m in (1, 2, 4, 8)}
    assert once[1].bytes["weight_casts"] == per_use[1].bytes["weight_casts"] > 0
    assert {once[m].bytes["weight_casts"] for m in (2, 4, 8)} == {once[1].bytes["weight_casts"]}
    assert per_use[8].bytes["weight_casts"] == 8 * per_use[1].bytes["weight_casts"]
    assert once[1].bytes["gradient_adds"] == per_use[1].bytes["gradient_adds"] == 0
    assert 0 < once[8].bytes["gradient_adds"] < 0.9 * per_use[8].bytes["gradient_adds"]


def test_step_weights_leave_tied_weights_to_autocast_and_put_the_parameters_back():
    config = ModelConfig.model_validate(
        {
            "vocab_size": 97,
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 32,
            "dense_layers": 1,
            "dense_ffn_dim": 48,
            "tie_embeddings": True,
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16},
        }
    )
    model = Transformer(config)
    originals = dict(model.named_parameters())
    step_weights = StepWeights(model, torch.bfloat16)
    assert all(module is not model.output for module, _, _ in step_weights.slots)
    step_weights.hold()
    assert model.layers[1].ffn.experts.w_up_EFD.dtype == torch.bfloat16
    assert model.output.weight is model.tok_embeddings.weight and model.output.weight.dtype == torch.float32
    step_weights.release()
    assert all(param is originals[name] for name, param in model.named_parameters())


def test_micro_batch_auto_takes_the_largest_that_fits(make_config, monkeypatch, tmp_path):
    """global_batch 8 on one rank: candidates 8, 4, 2, 1; with room for the estimate of 4 but not of 8, auto
    takes 4, trains on it and records the choice with the estimates it refused."""
    config = make_config("train.micro_batch=auto", "train.activation_checkpointing=full", "train.steps=1")
    estimates = {m: memory_model.memory_estimate(config, 1, "cpu", m).total_bytes for m in (8, 4)}
    room = (estimates[4] + estimates[8]) / 2 / memory_model.HEADROOM
    monkeypatch.setattr(memory_model, "device_memory_bytes", lambda device, ranks=1: ("a small host", room))
    trainer = Trainer(config)
    assert trainer.config.train.micro_batch == 4
    trainer.fit()
    choice = json.loads((tmp_path / "run" / "run.json").read_text())["micro_batch"]
    assert choice["requested"] == "auto" and choice["chosen"] == 4 and list(choice["larger_refused"]) == ["8"]
    assert choice["activation_checkpointing"] == "full"


def test_micro_batch_auto_with_nothing_fitting_is_refused_with_the_estimate(make_config, monkeypatch):
    monkeypatch.setattr(memory_model, "device_memory_bytes", lambda device, ranks=1: ("a tiny host", 2**20))
    with pytest.raises(
        UserError,
        match=r"train.micro_batch: auto found no micro-batch that fits: one sequence a "
        r"forward needs about .* GiB per rank .* and a tiny host has 0.0 GiB",
    ):
        Trainer(make_config("train.micro_batch=auto"))


def test_checkpointing_lets_auto_take_a_larger_micro_batch_at_the_olmoe_shape():
    """The memory model at OLMoE-1B-7B (6.9B parameters, sequences of 4,096, a step of 8) on an H200's 139 GiB,
    where the fp32 weights, gradients and moments take 103 GiB: plain, one sequence a micro-batch fits and two do
    not; selective checkpointing fits 2, full 4, and full with the head and loss by chunks the whole step."""
    from pathlib import Path

    from ferry.portability.bench.suites import load_suite

    config = load_suite("olmoe-1b-7b").run_config(Path("/nonexistent"), "cuda", [])
    h200 = 143_771 * 2**20

    def largest(mode: str, loss_chunk: int = 0) -> int:
        train = config.train.model_copy(update={"activation_checkpointing": mode, "loss_chunk": loss_chunk})
        shaped = config.model_copy(update={"train": train})
        limit = memory_model.HEADROOM * h200
        return max(m for m in (1, 2, 4, 8) if memory_model.memory_estimate(shaped, 1, "cuda", m).total_bytes <= limit)

    assert [largest("none"), largest("selective"), largest("full"), largest("full", 4096)] == [1, 2, 4, 8]


def test_compile_auto_compiles_blocks_on_gpus_only():
    assert resolve_compile("auto", torch.device("cuda")) == "blocks"
    assert resolve_compile("auto", torch.device("cpu")) == "none"
    assert resolve_compile("blocks", torch.device("cpu")) == "blocks"
    assert resolve_compile("none", torch.device("cuda")) == "none"

"""An MLA model of the DeepSeek-V3 family (group-limited sigmoid routing with the correction bias, shared expert)
in ferry's other layouts and modes: expert parallelism 2 with ZeRO-1 on 2 gloo ranks trains as one process does;
its checkpoint resumes in an FSDP layout and in one process (resharded); activation checkpointing changes no bit;
MXFP8 expert GEMMs train it; an MLA block compiles without a graph break; and every objective (SFT, DPO, GRPO,
whose rollouts decode with the latent cache) trains it.

Tolerance: as tests/test_distributed_training.py, the layouts differ only in the order of floating-point sums:
1e-5 relative on every loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import distributed_training as runs
import pytest
import torch

from ferry.comm.spawn import run_on_ranks
from ferry.data import PrepareSpec, prepare_dataset
from ferry.model import ModelConfig, Transformer
from ferry.train import Trainer
from ferry.train.trainer import train

LAYOUT_TOLERANCE = 1e-5
MLA = (
    "model.attention=mla",
    "model.n_kv_heads=4",
    "model.attention_gate=head",
    "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
    "model.moe.score_func=sigmoid",
    "model.moe.n_group=2",
    "model.moe.topk_group=1",
    "model.moe.renormalize=true",
    "model.moe.routed_scaling_factor=2.0",
    "model.moe.shared_expert_ffn_dim=32",
    "model.moe.bias_balancing.enabled=true",
    "train.steps=4",
    "checkpoint.interval=2",
)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(stdlib_dataset, tmp_path_factory):
    """The 1-process MLA run and the (world 2, ep 2, ZeRO-1) one, each checkpointed at step 2."""
    single_dir, ep_dir = tmp_path_factory.mktemp("mla-single"), tmp_path_factory.mktemp("mla-ep2")
    single = Trainer(runs.tiny_config(str(stdlib_dataset), str(single_dir), *MLA)).fit().losses
    ep = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(ep_dir), *MLA, "parallel.ep=2", "optim.zero=true")
    return {"single": single, "ep": ep, "ep_dir": ep_dir}


def test_mla_under_expert_parallelism_and_zero_trains_as_one_process(reference):
    assert len(reference["single"]) == 4 and all(math.isfinite(loss) for loss in reference["single"])
    assert _relative(reference["ep"][0]["losses"], reference["single"]) < LAYOUT_TOLERANCE
    record = reference["ep"][0]["records"][-1]
    assert sum(map(sum, record["moe.tokens_per_expert"])) == 8 * 32 * 2, "every assignment counted, both ranks"


def test_an_ep2_mla_checkpoint_resumes_under_fsdp_and_in_one_process(reference, stdlib_dataset, tmp_path):
    checkpoint = reference["ep_dir"] / "checkpoints" / "step-00000002"
    fsdp = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path / "fsdp"),
        *MLA,
        f"resume={checkpoint}",
        "parallel.mode=fsdp",
    )
    assert _relative(fsdp[0]["losses"], reference["single"][2:]) < LAYOUT_TOLERANCE
    alone = Trainer(runs.tiny_config(str(stdlib_dataset), str(tmp_path / "one"), *MLA, f"resume={checkpoint}"))
    assert _relative(alone.fit().losses, reference["single"][2:]) < LAYOUT_TOLERANCE


def test_mla_trains_with_low_precision_expert_gemms(reference, stdlib_dataset, tmp_path):
    """MXFP8 expert GEMMs (emulated on a CPU) beside MLA: the first loss, before any update, within 2% of fp32's
    (the experts' rounding only), and every step finite."""
    config = runs.tiny_config(str(stdlib_dataset), str(tmp_path), *MLA, "train.steps=2", "precision.experts=mxfp8")
    losses = Trainer(config).fit().losses
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[0] != reference["single"][0], "the experts' GEMMs must have run in MXFP8"
    assert abs(losses[0] - reference["single"][0]) / reference["single"][0] < 0.02


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_mla_run_equals_the_plain_one_bit_for_bit(stdlib_dataset, tmp_path, mode):
    """Activation checkpointing replays MLA's ops on the same inputs: the same losses and final weights, exactly
    (both on the portable routed path, which a recompute can replay)."""
    same_kernels = ('kernels.ops."moe.routed_experts"=portable', "train.steps=2", "checkpoint.interval=0")
    plain = Trainer(runs.tiny_config(str(stdlib_dataset), str(tmp_path / "plain"), *MLA, *same_kernels))
    checkpointed = Trainer(
        runs.tiny_config(
            str(stdlib_dataset), str(tmp_path / mode), *MLA, *same_kernels, f"train.activation_checkpointing={mode}"
        )
    )
    assert checkpointed.fit().losses == plain.fit().losses
    plain_state, checkpointed_state = plain.model.state_dict(), checkpointed.model.state_dict()
    assert all(torch.equal(plain_state[name], checkpointed_state[name]) for name in plain_state)


def test_an_mla_block_compiles_whole_and_computes_as_eager():
    """One graph for the attention and its gate (no break): the compiled region inductor would fuse."""
    config = ModelConfig.model_validate(
        dict(
            dim=32,
            n_heads=4,
            attention="mla",
            attention_gate="elementwise",
            n_layers=1,
            vocab_size=64,
            mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
            rope_scaling=dict(kind="yarn", factor=2.0, original_max_seq_len=512, mscale_all_dim=1.0),
        )
    )
    attention = Transformer(config).layers[0].attn
    x_BSD = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x_BSD), attention(x_BSD), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def task(stdlib_dataset, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla-task")
    views = {
        "chat": {"chat": True, "seq_len": 64},
        "pairs": {"records": "preferences"},
        "prompts": {"records": "prompts"},
    }
    for name, flags in views.items():
        spec = PrepareSpec(
            embedded="largest", tokenizer=str(stdlib_dataset / "tokenizer.json"), embedded_max_bytes=20_000, **flags
        )
        prepare_dataset(spec, root / name)
    return {name: root / name for name in views}


def _objective_config(tmp_path: Path, name: str, source: Path, *overrides: str):
    from conftest import tiny_config

    return tiny_config(
        Path("unused"),
        tmp_path / name,
        *MLA,
        "model.vocab_size=576",
        "data.seq_len=64",
        "train.steps=2",
        "checkpoint.interval=0",
        f"data.sources=[{{name: d, path: {source}}}]",
        *overrides,
    )


@pytest.fixture(scope="module")
def sft(task, tmp_path_factory) -> Path:
    """SFT (the lm objective on chat data, loss on the assistant's tokens): the parent DPO and GRPO start from."""
    root = tmp_path_factory.mktemp("mla-sft")
    losses = train(_objective_config(root, "sft", task["chat"])).losses
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    return root / "sft" / "checkpoints"


@pytest.mark.parametrize(
    "objective, source, extra",
    [
        ("dpo", "pairs", ()),
        (
            "grpo",
            "prompts",
            ("grpo.group_size=2", "grpo.max_new_tokens=4", "train.global_batch=4", "train.micro_batch=4"),
        ),
    ],
)
def test_every_objective_trains_an_mla_model(task, sft, tmp_path, objective, source, extra):
    config = _objective_config(
        tmp_path, objective, task[source], f"train.objective={objective}", f"init_from={sft}", *extra
    )
    losses = train(config).losses
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), objective


def test_an_mla_model_rehearses_from_two_ranks_to_one(stdlib_dataset, tmp_path):
    """`ferry rehearse` of the tiny MLA model from EP2 with ZeRO-1 to one process passes under same-hardware, both
    the resumed half and the run from scratch (demo size, by hand: max |diff| 1.4e-7 over 35 steps)."""
    from conftest import rehearse_ep2_to_one

    model_only = [override for override in MLA if not override.startswith(("train.", "checkpoint."))]
    code, verdict = rehearse_ep2_to_one(stdlib_dataset, tmp_path, *model_only)
    assert code == 0 and verdict["verdict"] == "PASS" and verdict["profile"] == "same-hardware"

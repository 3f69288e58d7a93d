"""Long context: RoPE scaling (position interpolation, YaRN) and document masking of packed windows; a stage
may change the model's length and RoPE over its parent's checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from ferry.config import UserError
from ferry.data import document_ids
from ferry.model import ModelConfig, Transformer
from ferry.model.config import RopeScalingConfig
from ferry.model.rope import scaled_inverse_frequencies
from ferry.train import Trainer

EOS = 0
MODEL = dict(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    dense_layers=1,
    dense_ffn_dim=48,
    moe=dict(num_experts=4, top_k=2, expert_ffn_dim=16),
)


def test_document_ids_start_a_new_document_after_each_end_of_text():
    tokens_BS = torch.tensor([[5, EOS, 7, 8, EOS, 9], [EOS, EOS, 3, 4, 5, 6]])
    assert document_ids(tokens_BS, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]


def test_a_document_packed_between_others_gives_its_logits_alone():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.model_validate(MODEL)).eval()
    first, middle, last = [3, 9, 4, 7, EOS], [11, 5, 6, 20, 31, 2, EOS], [8, 8, 1]
    packed_BS = torch.tensor([first + middle + last])
    start, stop = len(first), len(first) + len(middle)
    with torch.no_grad():
        alone = model(torch.tensor([middle])).logits_BSV[0]
        masked = model(packed_BS, document_ids_BS=document_ids(packed_BS, EOS)).logits_BSV[0, start:stop]
        unmasked = model(packed_BS).logits_BSV[0, start:stop]
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert (unmasked - alone).abs().max() > 1e-3, "without the mask the middle document sees the first"


def test_yarn_without_truncation_keeps_the_ramps_ends_exact():
    """`truncate: false` (GPT-OSS) ramps between the exact dimensions where the frequencies turn beta_fast and
    beta_slow times; the default rounds them outward to whole dimensions, which moves the middle frequencies."""
    exact = RopeScalingConfig(kind="yarn", factor=8.0, original_max_seq_len=16, truncate=False)
    rounded = RopeScalingConfig(kind="yarn", factor=8.0, original_max_seq_len=16)
    untruncated = scaled_inverse_frequencies(16, 1000.0, exact)
    truncated = scaled_inverse_frequencies(16, 1000.0, rounded)
    assert not torch.allclose(untruncated, truncated)
    torch.testing.assert_close(untruncated[[0, -1]], truncated[[0, -1]])  # the ends: kept and interpolated alike
    with pytest.raises(ValueError, match="truncate: false shapes yarn's ramp"):
        RopeScalingConfig(kind="linear", factor=2.0, truncate=False)


def test_linear_scaling_divides_every_frequency_and_yarn_keeps_the_fast_ones():
    plain = scaled_inverse_frequencies(16, 10000.0, RopeScalingConfig())
    linear = scaled_inverse_frequencies(16, 10000.0, RopeScalingConfig(kind="linear", factor=4.0))
    torch.testing.assert_close(linear, plain / 4)
    yarn = scaled_inverse_frequencies(16, 10000.0, RopeScalingConfig(kind="yarn", factor=4.0, original_max_seq_len=64))
    turns = plain * 64 / (2 * math.pi)  # rotations over the original length
    assert torch.equal(yarn[turns > 32], plain[turns > 32]), "fast dimensions extrapolate unchanged"
    torch.testing.assert_close(yarn[turns < 1], plain[turns < 1] / 4)
    assert ((yarn >= plain / 4 - 1e-12) & (yarn <= plain + 1e-12)).all()


def test_yarn_needs_its_original_length():
    with pytest.raises(ValueError, match="original_max_seq_len"):
        RopeScalingConfig(kind="yarn", factor=2.0)


def test_a_stage_extends_the_length_and_rope_of_its_parent(make_config, tmp_path):
    parent = make_config("train.steps=2", run_dir=tmp_path / "short")
    Trainer(parent).fit()
    checkpoint = tmp_path / "short" / "checkpoints" / "step-00000002"
    longer = make_config(
        "train.steps=1",
        f"init_from={checkpoint}",
        "model.max_seq_len=128",
        "data.seq_len=128",
        "model.rope_scaling.kind=yarn",
        "model.rope_scaling.factor=2.0",
        "model.rope_scaling.original_max_seq_len=64",
        "data.document_masking=true",
        run_dir=tmp_path / "long",
    )
    assert len(Trainer(longer).fit().losses) == 1
    wider = make_config("train.steps=1", f"init_from={checkpoint}", "model.dim=48", run_dir=tmp_path / "wide")
    with pytest.raises(UserError, match="model.dim"):
        Trainer(wider).fit()

"""QK-clip and the largest attention logit: the tracker finds what a brute-force product finds, each attention kind's
rescale scales every head's logits by exactly its factor, a run records the figure without changing a number, and
QK-clip acts only where it can (Muon, no query/key norm)."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.config import ConfigError
from ferry.model import ModelConfig, Transformer
from ferry.train import Trainer

BASE = {
    "vocab_size": 64,
    "dim": 32,
    "n_layers": 2,
    "max_seq_len": 32,
    "dense_layers": 1,
    "dense_ffn_dim": 64,
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16},
}
KINDS = {
    "gqa": {"n_heads": 4, "n_kv_heads": 2},
    "gqa-own-head-dim": {"n_heads": 4, "n_kv_heads": 1, "head_dim": 16},
    "mla": {"attention": "mla", "n_heads": 4, "mla": {"kv_lora_rank": 16, "q_lora_rank": 0}},
    "mla-compressed-queries": {"attention": "mla", "n_heads": 4, "mla": {"kv_lora_rank": 16, "q_lora_rank": 24}},
}


def _maxima(model: Transformer, tokens_BS: torch.Tensor, documents_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Each layer's per-head maxima of one training forward, [layers, heads]."""
    model(tokens_BS, document_ids_BS=documents_BS).logits_BSV.sum().backward()
    return torch.stack([block.attn.max_logits.take() for block in model.layers])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_clipping_scales_each_heads_logits_by_its_own_factor(kind):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.model_validate({**BASE, **KINDS[kind]}), track_max_logits=True)
    tokens_BS = torch.randint(0, 64, (2, 24))
    before_LH = _maxima(model, tokens_BS)
    gamma_H = torch.tensor([1.0, 0.5, 0.25, 0.8])
    values = {name: param.detach().clone() for name, param in model.named_parameters() if "wv" in name or "wo" in name}
    model.layers[-1].attn.clip_logits(gamma_H)  # the last layer: its input stays what it was
    after_LH = _maxima(model, tokens_BS)
    torch.testing.assert_close(after_LH[-1], before_LH[-1] * gamma_H, rtol=1e-5, atol=1e-6)
    assert torch.equal(after_LH[:-1], before_LH[:-1])
    assert all(torch.equal(param, values[name]) for name, param in model.named_parameters() if name in values)


def test_the_tracked_maximum_is_the_brute_force_one_within_documents():
    torch.manual_seed(1)
    config = ModelConfig.model_validate({**BASE, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1, "dense_layers": 1})
    model = Transformer(config, track_max_logits=True)
    tokens_BS = torch.randint(0, 64, (2, 20))
    documents_BS = (torch.arange(20) >= 7).long().expand(2, 20)
    tracked_H = _maxima(model, tokens_BS, documents_BS)[0]
    attention = model.layers[0].attn
    x_BSD = model.layers[0].attn_norm(model.tok_embeddings(tokens_BS))
    q_BHSC = attention.rope(attention.wq(x_BSD).view(2, 20, 4, 8).transpose(1, 2))
    k_BHSC = attention.rope(attention.wk(x_BSD).view(2, 20, 2, 8).transpose(1, 2)).repeat_interleave(2, dim=1)
    logits_BHSS = q_BHSC @ k_BHSC.mT / 8**0.5
    visible_BSS = (documents_BS[:, :, None] == documents_BS[:, None, :]).tril()
    brute_H = logits_BHSS.masked_fill(~visible_BSS[:, None], float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(tracked_H, brute_H.detach(), rtol=1e-5, atol=1e-6)


def test_a_run_records_its_largest_logit_without_changing_a_number(make_config, tmp_path):
    plain = Trainer(make_config("train.steps=3", run_dir=tmp_path / "plain")).fit()
    tracked = Trainer(make_config("train.steps=3", "metrics.attn_max_logit=true", run_dir=tmp_path / "tracked")).fit()
    assert tracked.losses == plain.losses
    records = [json.loads(line) for line in (tmp_path / "tracked" / "metrics.jsonl").read_text().splitlines()]
    assert all(record["attn.max_logit"] > 0 and record["attn.clipped_heads"] == 0 for record in records)


def test_qk_clip_scales_the_heads_past_its_threshold(make_config, tmp_path):
    """A threshold below every head's logit: every head of every layer clipped after each update; the logits
    of the next step start near the threshold rather than where they were."""
    tau = 0.01  # the tiny model's logits start near 0.06
    run = make_config(
        "optim.name=muon",
        f"optim.muon.qk_clip={tau}",
        "model.qk_norm=false",
        "train.steps=3",
        run_dir=tmp_path / "clipped",
    )
    Trainer(run).fit()
    records = [json.loads(line) for line in (tmp_path / "clipped" / "metrics.jsonl").read_text().splitlines()]
    heads = run.model.n_layers * run.model.n_heads
    assert records[0]["attn.max_logit"] > tau and records[0]["attn.clipped_heads"] == heads
    free = make_config(
        "optim.name=muon",
        "model.qk_norm=false",
        "metrics.attn_max_logit=true",
        "train.steps=3",
        run_dir=tmp_path / "free",
    )
    Trainer(free).fit()
    unclipped = [json.loads(line) for line in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["attn.max_logit"] == pytest.approx(unclipped[0]["attn.max_logit"], rel=1e-6)
    assert records[1]["attn.max_logit"] < 0.5 * unclipped[1]["attn.max_logit"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("optim.muon.qk_clip=10",),
            "muon.qk_clip rescales the query and key weights after Muon's update: set name=muon",
        ),
        (
            ("optim.name=muon", "optim.muon.qk_clip=10", "model.qk_norm=true"),
            "model.qk_norm normalises back, and its gains are shared by the heads",
        ),
        (
            ("optim.name=muon", "optim.muon.qk_clip=10", "model.qk_norm=false", "parallel.mode=fsdp"),
            "optim.muon.qk_clip scales rows of the query and key weights by head, and FSDP holds a shard",
        ),
    ],
    ids=["adamw", "qk-norm", "fsdp"],
)
def test_qk_clip_is_refused_where_it_cannot_act(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(*overrides)


def test_replicas_clip_alike_and_train_as_one_process(stdlib_dataset, tmp_path):
    """Expert parallel with ZeRO-1: every rank clips from the same agreed maxima, so the replicated query and key
    weights stay equal and the run is the single process's (Newton-Schulz in fp32; 1e-5 relative, as
    tests/test_muon.py)."""
    import distributed_training as runs

    from ferry.comm.spawn import run_on_ranks

    clipped = (
        "optim.name=muon",
        "optim.muon.ns_dtype=fp32",
        "optim.muon.qk_clip=0.01",
        "model.qk_norm=false",
        "train.steps=4",
    )
    alone = runs.train_run(str(stdlib_dataset), str(tmp_path / "one"), *clipped)
    ranks = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "two"), *clipped, "parallel.ep=2", "optim.zero=true"
    )
    assert max(abs(a - b) / abs(b) for a, b in zip(ranks[0]["losses"], alone["losses"], strict=True)) < 1e-5
    assert all(record["attn.clipped_heads"] > 0 for record in ranks[0]["records"])

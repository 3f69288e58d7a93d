"""Parameter and FLOP accounting (MFU needs FLOPs per token; sizing needs total vs active)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ferry.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSize:
    total_params: int
    active_params: int
    embedding_params: int
    flops_per_token: int

    def as_dict(self) -> dict:
        return asdict(self)


def count_model(config: ModelConfig, seq_len: int) -> ModelSize:
    """Counts from the config alone, so they are the same on every rank and every layout.

    Active parameters are those one token touches: everything except the experts it
    was not routed to. FLOPs per token for a training step (forward + backward) are
    6 x active matmul parameters plus causal attention's 6 x n_layers x seq_len x
    (n_heads * head_dim) for the score and value products (half the square, as causal).
    """
    dim, layers = config.dim, config.n_layers
    q_width = config.n_heads * config.head_dim
    kv_width = config.n_kv_heads * config.head_dim
    attention = dim * q_width * 2 + dim * kv_width * 2
    if config.qk_norm:
        attention += 2 * config.head_dim if config.qk_norm_scope == "head" else q_width + kv_width
    norms = 2 * dim
    dense_ffn = 3 * dim * config.dense_ffn_dim
    moe = config.moe
    router = moe.num_experts * dim
    expert = 3 * dim * moe.expert_ffn_dim
    shared = 3 * dim * moe.shared_expert_ffn_dim
    moe_layers = layers - config.dense_layers

    embedding = config.vocab_size * dim
    head = 0 if config.tie_embeddings else config.vocab_size * dim
    common = layers * (attention + norms) + config.dense_layers * dense_ffn + moe_layers * (router + shared) + dim
    total = embedding + head + common + moe_layers * moe.num_experts * expert
    active = embedding + head + common + moe_layers * moe.top_k * expert

    matmul_active = active - embedding + (config.vocab_size * dim if config.tie_embeddings else 0)
    attention_flops = 6 * layers * seq_len * q_width
    return ModelSize(
        total_params=total,
        active_params=active,
        embedding_params=embedding,
        flops_per_token=6 * matmul_active + attention_flops,
    )

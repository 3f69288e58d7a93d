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
    6 x active matmul parameters plus causal attention's score and value products:
    3 x n_layers x seq_len x n_heads x (query/key width + value width), half the square
    as causal (6 x n_layers x seq_len x n_heads x head_dim when the widths are equal, as
    in GQA); a windowed layer's positions each see at most `window` keys. What each attention
    kind counts is its own (`ferry/model/variants/`). Multi-token-prediction modules count as the blocks,
    projections and norms they hold, and their logits as one more pass through the head each.
    """
    dim, layers = config.dim, config.n_layers
    attention, score_width, value_width = _attention_params(config)
    norms = 2 * dim
    dense_ffn = 3 * dim * config.dense_ffn_dim
    moe = config.moe
    router = moe.num_experts * (dim + moe.router_bias)
    expert = 3 * dim * moe.expert_ffn_dim + (2 * moe.expert_ffn_dim + dim if moe.expert_biases else 0)
    shared = 3 * dim * moe.shared_expert_ffn_dim
    moe_layers = config.moe_layer_count

    embedding = config.vocab_size * dim
    head = 0 if config.tie_embeddings else config.vocab_size * dim
    depth = config.mtp.depth  # each MTP module: two input norms, the projection, a block, its output norm
    mtp_dense = depth * dense_ffn if layers == config.dense_layers else 0  # dense blocks where the model's are
    common = (
        (layers + depth) * (attention + norms)
        + config.dense_layers * dense_ffn
        + mtp_dense
        + moe_layers * (router + shared)
        + dim
        + depth * (3 * dim + 2 * dim * dim)
    )
    total = embedding + head + common + moe_layers * moe.num_experts * expert
    active = embedding + head + common + moe_layers * moe.top_k * expert

    matmul_active = active - embedding + (config.vocab_size * dim if config.tie_embeddings else 0)
    matmul_active += depth * config.vocab_size * dim  # each MTP module's logits through the shared head
    attended = sum(_keys_doubled(seq_len, config.attention_window(layer)) for layer in range(layers))
    attended += depth * seq_len  # the MTP modules' blocks attend causally over the whole row
    attention_flops = 3 * attended * config.n_heads * (score_width + value_width)
    return ModelSize(
        total_params=total,
        active_params=active,
        embedding_params=embedding,
        flops_per_token=6 * matmul_active + attention_flops,
    )


def _keys_doubled(seq_len: int, window: int) -> int:
    """Twice the keys a position attends to on average (so `seq_len` for causal attention): with a window shorter
    than the sequence, the first `window` positions see 1, 2, ... keys and the rest `window` each."""
    if not window or window >= seq_len:
        return seq_len
    return (window * (window + 1) + 2 * (seq_len - window) * window) // seq_len


def _attention_params(config: ModelConfig) -> tuple[int, int, int]:
    """One layer's attention parameters (its kind's, and the output gate's), and a head's query/key and value
    widths."""
    kind = config.attention_kind
    score_width, value_width = kind.head_widths(config)
    heads = config.n_heads
    gate_width = {"none": 0, "head": heads, "elementwise": heads * value_width}[config.attention_gate]
    return kind.parameters(config) + config.dim * gate_width, score_width, value_width

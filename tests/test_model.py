"""Model behaviour: shapes, causality, GQA, routing variants, balancing, and the size counter."""

import torch
import torch.nn.functional as F

from ferry.model import ModelConfig, MoEConfig, MoELayer, Transformer, count_model
from ferry.model.attention import Attention
from ferry.model.moe import RowDispatcher
from ferry.model.rope import RotaryEmbedding


def _config(**overrides) -> ModelConfig:
    base = {
        "vocab_size": 97,
        "dim": 32,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 32,
        "dense_layers": 1,
        "dense_ffn_dim": 48,
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16},
    }
    for key, value in overrides.items():
        if key == "moe":
            base["moe"] = {**base["moe"], **value}
        else:
            base[key] = value
    return ModelConfig.model_validate(base)


def test_counter_matches_the_built_model():
    for overrides in [
        {},
        {"qk_norm": True, "moe": {"shared_expert_ffn_dim": 8}},
        {"qk_norm": True, "qk_norm_scope": "head"},
        {"tie_embeddings": True},
    ]:
        config = _config(**overrides)
        model = Transformer(config)
        size = count_model(config, seq_len=16)
        assert size.total_params == sum(p.numel() for p in model.parameters())
        expert_params = sum(layer.experts.w_gate_EFD.numel() * 3 for layer in model.moe_layers())
        assert size.active_params == size.total_params - expert_params // 2  # top 2 of 4 experts active


def test_flops_per_token_follow_six_n_plus_attention():
    config = _config()
    size = count_model(config, seq_len=16)
    matmul_params = size.active_params - size.embedding_params
    assert size.flops_per_token == 6 * matmul_params + 6 * config.n_layers * 16 * config.dim


def test_first_layers_are_dense_and_stats_come_from_moe_layers():
    model = Transformer(_config(dense_layers=2))
    assert len(model.moe_layers()) == 1
    output = model(torch.randint(0, 97, (2, 8)))
    assert output.logits_BSV.shape == (2, 8, 97)
    assert len(output.moe_stats) == 1
    assert int(output.moe_stats[0].tokens_per_expert_E.sum()) == 2 * 8 * 2


def test_the_model_is_causal():
    torch.manual_seed(0)
    model = Transformer(_config())
    tokens = torch.randint(0, 97, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 97
    assert torch.allclose(model(tokens).logits_BSV[0, :8], model(changed).logits_BSV[0, :8], atol=1e-6)
    assert not torch.allclose(model(tokens).logits_BSV[0, 8:], model(changed).logits_BSV[0, 8:])


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
    torch.manual_seed(0)
    config = _config()
    rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
    attention = Attention(config, rope)
    for param in attention.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x_BSD = torch.randn(2, 10, config.dim)
    batch, seq, heads, kv, c = 2, 10, config.n_heads, config.n_kv_heads, config.head_dim
    q = rope(attention.wq(x_BSD).view(batch, seq, heads, c).transpose(1, 2))
    k = rope(attention.wk(x_BSD).view(batch, seq, kv, c).transpose(1, 2)).repeat_interleave(heads // kv, dim=1)
    v = attention.wv(x_BSD).view(batch, seq, kv, c).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / c**0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    expected = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1))
    assert torch.allclose(attention(x_BSD), expected, atol=1e-5)


def _layer(**moe) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_ffn_dim": 8, **moe}))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return layer


def _reference(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token-by-token evaluation of the routed experts, the definition the fast path must meet."""
    routing = layer.router(x_TD)
    experts = layer.experts
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(layer.top_k):
            e = int(routing.expert_ids_TK[t, k])
            hidden = F.silu(experts.w_gate_EFD[e] @ x_TD[t]) * (experts.w_up_EFD[e] @ x_TD[t])
            out[t] += routing.weights_TK[t, k] * (experts.w_down_EDF[e] @ hidden)
    if layer.shared_expert is not None:
        out += layer.shared_expert(x_TD)
    return out


def test_sigmoid_scores_and_shared_expert_match_the_reference():
    for moe in [{"score_func": "sigmoid", "renormalize": True}, {"shared_expert_ffn_dim": 8}]:
        layer = _layer(**moe)
        x_TD = torch.randn(9, 16)
        y_BSD, _ = layer(x_TD.view(1, 9, 16))
        assert torch.allclose(y_BSD.view(9, 16), _reference(layer, x_TD), atol=1e-5)


def test_aux_loss_is_one_at_perfect_balance_and_z_loss_is_logsumexp_squared():
    layer = _layer()
    with torch.no_grad():
        layer.router.weight_ED.zero_()  # uniform probabilities
    routing = layer.router(torch.randn(8, 16))
    # all scores tie; whatever was chosen, uniform probabilities make f . p = 1 / E
    assert torch.isclose(routing.aux_loss, torch.tensor(1.0))
    assert torch.isclose(routing.z_loss, torch.log(torch.tensor(4.0)) ** 2)


def test_bias_balancing_steers_choice_but_not_weights_or_gradients():
    layer = _layer(bias_balancing={"enabled": True, "update_rate": 0.01})
    x_TD = torch.randn(256, 16)
    with torch.no_grad():
        layer.router.weight_ED[0] += 0.5 * x_TD.mean(0) / x_TD.mean(0).norm()  # skew toward expert 0
    first = layer.router(x_TD)
    for _ in range(60):
        layer.router.update_bias(layer.router(x_TD).tokens_per_expert_E)
    last = layer.router(x_TD)

    def imbalance(counts_E):
        return (counts_E.max() / counts_E.float().mean()).item()

    assert imbalance(last.tokens_per_expert_E) < imbalance(first.tokens_per_expert_E)
    assert layer.router.expert_bias_E[0] < 0
    assert not layer.router.expert_bias_E.requires_grad
    scores_TE = F.linear(x_TD, layer.router.weight_ED).softmax(-1)
    assert torch.allclose(last.weights_TK, scores_TE.gather(1, last.expert_ids_TK)), "bias must not enter weights"


def test_bias_is_ignored_when_balancing_is_off():
    layer = _layer()
    layer.router.update_bias(torch.tensor([100, 0, 0, 0]))
    assert torch.equal(layer.router.expert_bias_E, torch.zeros(4))


def test_under_autocast_experts_compute_in_its_dtype_on_the_local_and_the_dispatched_path():
    """The dispatched path (permute, experts behind a dispatcher, combine) must take the same dtypes as the
    local one. Tolerance 2e-2: both compute the expert GEMMs in bfloat16 (2^-8 per rounding), in other orders."""
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, shared_expert_ffn_dim=8))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.2)
    x_BSD = torch.randn(2, 5, 16)
    results = []
    for dispatcher in (None, LocalDispatcher()):
        layer.dispatcher = dispatcher
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_BSD, _ = layer(x_BSD)
        out_BSD.float().square().sum().backward()
        assert out_BSD.dtype == torch.bfloat16 and layer.experts.w_up_EFD.grad.dtype == torch.float32
        results.append((out_BSD.float(), layer.experts.w_up_EFD.grad))
    (out_local, grad_local), (out_dispatched, grad_dispatched) = results
    assert (out_local - out_dispatched).norm() < 2e-2 * out_local.norm()
    assert (grad_local - grad_dispatched).norm() < 2e-2 * grad_local.norm()


def test_padding_is_routed_but_left_out_of_the_routers_losses_and_statistics():
    """A row padded to a batch's longest: the real positions' routing statistics are those of the row alone,
    the experts still run the padding, and nothing of the router's losses reaches the padding's inputs."""
    torch.manual_seed(0)
    model = Transformer(_config(moe={"bias_balancing": {"enabled": True, "update_rate": 0.01}}))
    real_BS = torch.randint(1, 97, (1, 11))
    padded_BS = torch.cat([real_BS, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    padding_BS = torch.arange(18)[None, :] >= 11
    alone = model(real_BS).moe_stats
    padded = model(padded_BS, padding_BS=padding_BS).moe_stats
    counted_as_real = model(padded_BS).moe_stats
    for layer_alone, layer_padded, layer_unmasked in zip(alone, padded, counted_as_real):
        assert torch.equal(layer_padded.tokens_per_expert_E, layer_alone.tokens_per_expert_E)
        for name in ("aux_loss", "z_loss", "mean_prob_E", "entropy"):
            assert torch.allclose(getattr(layer_padded, name), getattr(layer_alone, name), rtol=1e-5, atol=1e-7), name
        assert layer_unmasked.tokens_per_expert_E.sum() == 18 * 2, "unmarked, the padding would count"

    layer = _layer()
    x_TD = torch.randn(18, 16, requires_grad=True)
    routing = layer.router(x_TD, padding_BS.reshape(-1))
    assert routing.tokens_per_expert_E.sum() == 18 * 2, "the experts run every position"
    assert routing.load_E.sum() == 11 * 2
    (routing.aux_loss + routing.z_loss).backward()
    assert x_TD.grad[11:].abs().max() == 0 and x_TD.grad[:11].abs().max() > 0


class LocalDispatcher(RowDispatcher):
    """A dispatcher that runs the sorted rows on the layer's own experts: the dispatched path, without ranks."""

    def rows(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts) -> torch.Tensor:
        return experts(x_ND, tokens_per_expert_E)

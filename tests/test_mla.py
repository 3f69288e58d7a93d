"""Multi-head latent attention against transformers' DeepSeek-V3 on the same weights: one attention layer and
whole tiny models (query compression or not, dense first layers, group-limited sigmoid routing with a correction
bias, shared experts, YaRN with DeepSeek's magnitudes, interleaved rotary checkpoints), forward and gradients
within 1e-5 relative in fp32; decoding keeps the latent only and equals the full forward; the gate and the
config's checks."""

from __future__ import annotations

import pytest
import torch
from test_interop import _random_model
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as reference

from ferry.config import ConfigError
from ferry.config.loader import load_config
from ferry.inference.config import GenerationConfig
from ferry.inference.generate import generate
from ferry.interop.architectures import from_hf_state, hf_config, to_hf_state
from ferry.model import KVCache, ModelConfig, Transformer
from ferry.model.kv_cache import cache_bytes_per_token
from ferry.model.latent_attention import LatentAttention
from ferry.model.rope import RotaryEmbedding

TOLERANCE = 1e-5  # relative (norm of the difference over the norm): fp32 kernels in another order, never more

MLA_BASE = dict(
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    max_seq_len=64,
    attention="mla",
    dense_layers=1,
    dense_ffn_dim=40,
    mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    moe=dict(
        num_experts=8,
        top_k=2,
        expert_ffn_dim=16,
        score_func="sigmoid",
        renormalize=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        shared_expert_ffn_dim=32,
        bias_balancing=dict(enabled=True),
    ),
)
YARN = dict(kind="yarn", factor=4.0, original_max_seq_len=16, mscale=1.0, mscale_all_dim=0.8)
MLA_CASES = {
    "compressed-queries": {},
    "full-queries-yarn": dict(
        mla=dict(q_lora_rank=0, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=4),
        rope_theta=500.0,
        rope_scaling=YARN,
    ),
    "no-groups-no-shared-tied": dict(
        tie_embeddings=True,
        dense_layers=0,
        moe=dict(
            num_experts=4,
            top_k=3,
            expert_ffn_dim=16,
            score_func="sigmoid",
            renormalize=False,
            bias_balancing=dict(enabled=True),
        ),
    ),
}


def mla_config(case: str) -> ModelConfig:
    return ModelConfig.model_validate({**MLA_BASE, **MLA_CASES[case]})


def random_model(config: ModelConfig) -> Transformer:
    """Weights far from their initial scale (norms not one, routers' biases not zero), so nothing passes by luck."""
    model = _random_model(config)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.expert_bias_E.normal_(0.0, 0.1)
    return model


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


def transformers_model(config: ModelConfig, state: dict[str, torch.Tensor]):
    hf = hf_config(config, "deepseek_v3", 0, "float32")
    theirs = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
    missing, unexpected = theirs.load_state_dict(to_hf_state(state, config), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if config.tie_embeddings else [])
    return theirs.eval()


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_one_attention_layer_equals_deepseek_v3s_forward_and_backward(case):
    config = mla_config(case)
    hf = hf_config(config, "deepseek_v3", 0, "float32")
    hf._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = reference.DeepseekV3Attention(hf, layer_idx=0)
    rope = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
    ours = LatentAttention(config, rope)
    names = _attention_names()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.normal_(0.0, 0.3) if not name.endswith("norm.weight") else param.uniform_(0.5, 1.5)
            theirs.get_parameter(names[name]).copy_(param)
    x_BSD = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(2))
    x_ours, x_theirs = x_BSD.clone().requires_grad_(), x_BSD.clone().requires_grad_()
    positions_BS = torch.arange(11)[None].expand(2, 11)
    cos_sin = reference.DeepseekV3RotaryEmbedding(hf)(x_BSD, positions_BS)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    out_ours, out_theirs = ours(x_ours), theirs(x_theirs, cos_sin, causal)[0]
    assert relative(out_ours, out_theirs) < TOLERANCE
    probe_BSD = torch.randn(out_ours.shape, generator=torch.Generator().manual_seed(3))
    (out_ours * probe_BSD).sum().backward()
    (out_theirs * probe_BSD).sum().backward()
    assert relative(x_ours.grad, x_theirs.grad) < TOLERANCE
    for name, param in ours.named_parameters():
        their_grad = theirs.get_parameter(names[name]).grad
        assert relative(param.grad, their_grad) < TOLERANCE, name


def _attention_names() -> dict[str, str]:
    """The attention module's own parameter names, ferry's against DeepSeek-V3's."""
    from ferry.interop.deepseek import _layer_names

    names = _layer_names(dense=True).items()
    return {name.removeprefix("attn."): hf.removeprefix("self_attn.") for name, hf in names if name.startswith("attn.")}


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_a_whole_model_equals_deepseek_v3s_forward_and_gradients(case):
    config = mla_config(case)
    ours = random_model(config)
    theirs = transformers_model(config, ours.state_dict())
    theirs.model.embed_tokens.padding_idx = None  # the export's pad token (EOS) would get no embedding gradient there
    tokens_BS = torch.randint(0, config.vocab_size, (3, 23), generator=torch.Generator().manual_seed(4))
    ours_BSV, theirs_BSV = ours(tokens_BS).logits_BSV, theirs(tokens_BS).logits
    assert relative(ours_BSV, theirs_BSV) < TOLERANCE
    probe_BSV = torch.randn(ours_BSV.shape, generator=torch.Generator().manual_seed(5))
    (ours_BSV * probe_BSV).sum().backward()
    (theirs_BSV * probe_BSV).sum().backward()
    our_grads = to_hf_state({name: param.grad for name, param in ours.named_parameters()}, config)
    their_params = dict(theirs.named_parameters())
    checked = 0
    for name, grad in our_grads.items():
        if grad.numel():
            assert relative(grad, their_params[name].grad) < TOLERANCE, name
            checked += 1
    assert checked == len([param for param in their_params.values() if param.numel()])


def test_an_interleaved_rotary_checkpoint_reads_as_rotate_half():
    """DeepSeek's own checkpoints pair rotary dims (x0, x1), (x2, x3), ...: import moves those rows once."""
    config = mla_config("full-queries-yarn")
    hf = hf_config(config, "deepseek_v3", 0, "float32")
    hf.rope_interleave = True
    torch.manual_seed(6)
    theirs = AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            param.normal_(0.0, 0.2) if not name.endswith("norm.weight") else param.uniform_(0.5, 1.5)
    ours = Transformer(config)
    ours.load_state_dict(from_hf_state(theirs.state_dict(), config, rope_interleave=True))
    tokens_BS = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert relative(ours.eval()(tokens_BS).logits_BSV, theirs(tokens_BS).logits) < TOLERANCE
        plain = Transformer(config)
        plain.load_state_dict(from_hf_state(theirs.state_dict(), config, rope_interleave=False))
        assert relative(plain.eval()(tokens_BS).logits_BSV, theirs(tokens_BS).logits) > 1e-3


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_decoding_keeps_the_latent_only_and_equals_the_full_forward(case):
    config = mla_config(case)
    model = random_model(config)
    tokens_BS = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(8))
    pad_B = torch.tensor([0, 3, 6])
    padded_BS = torch.zeros_like(tokens_BS)
    for row, pad in enumerate(pad_B.tolist()):
        padded_BS[row, pad:] = tokens_BS[row, : 17 - pad]
    cache = KVCache(config, pad_B, 17, torch.float32, torch.device("cpu"))
    mla = config.mla
    assert [buffer.shape for buffer in cache.buffers] == [
        (config.n_layers, 3, 17, mla.kv_lora_rank),
        (config.n_layers, 3, 17, mla.qk_rope_head_dim),
    ]
    stored = sum(buffer.numel() * buffer.element_size() for buffer in cache.buffers) // (3 * 17)
    assert cache.bytes_per_token == stored == config.n_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    with torch.no_grad():
        full_BSV = model(tokens_BS).logits_BSV
        pieces = [model(padded_BS[:, :8], cache).logits_BSV]
        pieces += [model(padded_BS[:, slot : slot + 1], cache).logits_BSV for slot in range(8, 17)]
    cached_BSV = torch.cat(pieces, dim=1)
    for row, pad in enumerate(pad_B.tolist()):
        torch.testing.assert_close(cached_BSV[row, pad:], full_BSV[row, : 17 - pad], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_absorbed_decoding_equals_expanded_decoding_and_greedy_tokens_agree(case):
    """The up-projections absorbed into the query and output: the same logits as attending over the expanded keys
    and values, at the prefill and every decoding step (within 1e-5, fp32), and the same greedy completions."""
    config = mla_config(case)
    model = random_model(config).eval()
    tokens_BS = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(8))
    pad_B = torch.tensor([0, 3, 6])
    logits = {}
    for form in ("absorbed", "expanded"):
        cache = KVCache(config, pad_B, 17, torch.float32, torch.device("cpu"), latent_decoding=form)
        with torch.no_grad():
            pieces = [model(tokens_BS[:, :8], cache).logits_BSV]
            pieces += [model(tokens_BS[:, slot : slot + 1], cache).logits_BSV for slot in range(8, 17)]
        logits[form] = torch.cat(pieces, dim=1)
    for row, pad in enumerate(pad_B.tolist()):
        assert relative(logits["absorbed"][row, pad:], logits["expanded"][row, pad:]) < TOLERANCE
    prompts = [tokens_BS[row, : 4 + row].tolist() for row in range(3)]
    completions = {
        form: [
            c.tokens
            for c in generate(
                model, prompts, GenerationConfig(max_new_tokens=12, temperature=0.0, latent_decoding=form)
            ).completions
        ]
        for form in ("absorbed", "expanded", "auto")
    }
    assert completions["absorbed"] == completions["expanded"] == completions["auto"]


def test_auto_latent_decoding_absorbs_a_decoding_step_and_expands_a_long_prompt():
    """The form with fewer multiply-adds: one new token over 4,096 cached latents is absorbed; a prompt of 4,096
    tokens at once is expanded (its queries would each attend in the latent's 576 dimensions, not 192)."""
    moonlight = ModelConfig.model_validate(
        dict(
            dim=2048,
            n_layers=2,
            n_heads=16,
            attention="mla",
            mla=dict(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        )
    )
    rope = RotaryEmbedding(moonlight.rope_dim, moonlight.max_seq_len, moonlight.rope_theta, moonlight.rope_scaling)
    attention = LatentAttention(moonlight, rope)
    assert attention._absorbs("auto", 1, 4096) and attention._absorbs("auto", 8, 1024)
    assert not attention._absorbs("auto", 4096, 4096)
    assert attention._absorbs("absorbed", 4096, 4096) and not attention._absorbs("expanded", 1, 4096)


def test_the_latent_cache_is_a_fraction_of_the_full_keys_and_values():
    """DeepSeek-V3's shape: 576 cached values a token and layer where full keys and values take 128 heads x 320."""
    v3 = ModelConfig.model_validate(
        dict(
            dim=7168,
            n_layers=61,
            n_heads=128,
            attention="mla",
            mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        )
    )
    assert cache_bytes_per_token(v3, 2) == 61 * 576 * 2
    expanded = 61 * 128 * (192 + 128) * 2
    assert expanded / cache_bytes_per_token(v3, 2) > 71


@pytest.mark.parametrize("kind", ["head", "elementwise"])
def test_a_closed_gate_silences_attention_and_an_open_one_passes_it_halved(kind):
    config = ModelConfig.model_validate({**MLA_BASE, "attention_gate": kind})
    model = random_model(config)
    attention = model.layers[0].attn
    x_BSD = torch.randn(2, 5, config.dim, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        attention.gate.w_gate.weight.zero_()
        half = attention(x_BSD)
        attention.gate = None
        whole = attention(x_BSD)
    torch.testing.assert_close(half, whole / 2, rtol=1e-6, atol=1e-6)
    widths = {"head": config.n_heads, "elementwise": config.n_heads * config.mla.v_head_dim}
    assert model.layers[1].attn.gate.w_gate.weight.shape == (widths[kind], config.dim)
    gqa = Transformer(ModelConfig.model_validate(dict(dim=32, n_heads=4, n_kv_heads=2, attention_gate=kind)))
    assert gqa.layers[0].attn.gate.w_gate.weight.shape[0] == {"head": 4, "elementwise": 32}[kind]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["attention=mla", "qk_norm=true"], "model: qk_norm: MLA normalises its latents instead"),
        (["attention=mla", "n_kv_heads=2"], "n_kv_heads 2: MLA gives every head its own keys and values"),
        (["mla.qk_rope_head_dim=5"], "model.mla.qk_rope_head_dim: qk_rope_head_dim 5 must be even"),
        (["rope_scaling.kind=linear", "rope_scaling.factor=2", "rope_scaling.mscale=1"], "belong to yarn scaling"),
        (
            ["rope_scaling={kind: yarn, factor: 4, original_max_seq_len: 16, mscale_all_dim: 1}"],
            "mscale_all_dim scales MLA's softmax",
        ),
        (["moe.n_group=3"], "model.moe: n_group 3 must divide num_experts (8)"),
        (["moe.n_group=4", "moe.topk_group=1", "moe.top_k=3"], "top_k 3 exceeds the 2 experts of topk_group 1"),
        (["attention_gate=head_wise"], "model.attention_gate: Input should be 'none', 'head' or 'elementwise'"),
    ],
)
def test_bad_attention_and_routing_settings_name_the_field(overrides, named):
    from ferry.train import RunConfig

    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, None, [f"model.{override}" for override in overrides])
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_gate": "elementwise"},
        {"mla": {"q_lora_rank": 0}},
        {"attention": "gqa", "attention_gate": "head", "dim": 32, "n_kv_heads": 2, "dense_layers": 0},
    ],
)
def test_the_counter_knows_mla_and_the_gate(overrides):
    from ferry.model import count_model

    merged = {**MLA_BASE, **overrides, "mla": {**MLA_BASE["mla"], **overrides.get("mla", {})}}
    if merged["attention"] == "gqa":
        merged.pop("mla")
    config = ModelConfig.model_validate(merged)
    model = Transformer(config)
    size = count_model(config, seq_len=16)
    assert size.total_params == sum(param.numel() for param in model.parameters())
    routed = sum(layer.experts.w_gate_EFD.numel() * 3 for layer in model.moe_layers())
    assert size.active_params == size.total_params - routed * (8 - 2) // 8
    matmul = size.active_params - size.embedding_params
    widths = (config.head_dim, config.mla.v_head_dim) if config.attention == "mla" else (config.head_dim,) * 2
    assert size.flops_per_token == 6 * matmul + 3 * config.n_layers * 16 * config.n_heads * sum(widths)

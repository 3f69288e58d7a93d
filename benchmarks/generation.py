"""Decoding speed: ferry's key/value-cache decoder against transformers' `generate` on the same weights,
and against recomputing the whole prefix at every step (what decoding without a cache costs).

    python benchmarks/generation.py [--batch 8] [--prompt-tokens 64] [--new-tokens 64] [--repeats 3]

The model is a Qwen3-MoE-shaped ferry model (dim 256, 6 layers, the first dense, 16 experts,
top-2, per-head q/k norm) with random weights and the kernels `ferry generate` selects (`auto`); transformers
gets the same weights through ferry's export mapping. Every side decodes greedily from the same prompts for the
same number of tokens (transformers with EOS off), and the tokens are checked equal before any time is
reported. Times are medians of the repeats, after one warm-up run each, with one thread count
for all. The last line printed is one JSON object: decode tokens/s of each side (new tokens of
the whole batch over the decode time; transformers' time includes its prefill, so its prefill
is timed alone and subtracted), `vs_transformers` and `vs_no_cache` (ferry's rate over theirs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ferry.inference import GenerationConfig, generate
from ferry.interop.architectures import hf_config, to_hf_state
from ferry.kernels import KernelsConfig, select_kernels
from ferry.model import ModelConfig, Transformer

MODEL = dict(
    vocab_size=4096,
    dim=256,
    n_layers=6,
    n_heads=8,
    n_kv_heads=2,
    max_seq_len=512,
    qk_norm=True,
    qk_norm_scope="head",
    dense_layers=1,
    dense_ffn_dim=768,
    moe=dict(num_experts=16, top_k=2, expert_ffn_dim=256),
)


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.inference_mode()
def _no_cache(model, prompts_BS: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens_BS = prompts_BS
    for _ in range(new_tokens):
        chosen_B = model(tokens_BS).logits_BSV[:, -1].argmax(-1)
        tokens_BS = torch.cat([tokens_BS, chosen_B[:, None]], dim=1)
    return tokens_BS[:, prompts_BS.shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    config = ModelConfig.model_validate(MODEL)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    ours = Transformer(
        config, select_kernels(KernelsConfig(), cpu, torch.float32)
    ).eval()  # as `ferry generate` builds it
    theirs = AutoModelForCausalLM.from_config(hf_config(config, "qwen3_moe", 0, "float32"))
    theirs.load_state_dict(to_hf_state(ours.state_dict(), config), strict=False)
    theirs.eval()
    prompts_BS = torch.randint(
        1, config.vocab_size, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(1)
    )
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0)
    new = args.batch * args.new_tokens

    result = generate(ours, prompts_BS.tolist(), greedy)
    ferry_tokens = torch.tensor([completion.tokens for completion in result.completions])
    hf_options = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf_tokens = theirs.generate(
            prompts_BS, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **hf_options
        )
    same = torch.equal(ferry_tokens, hf_tokens[:, args.prompt_tokens :])
    same_no_cache = torch.equal(ferry_tokens, _no_cache(ours, prompts_BS, args.new_tokens))
    if not (same and same_no_cache):
        raise SystemExit(f"the decoders disagree (transformers: {same}, no cache: {same_no_cache}); no timing reported")

    decode_s = []
    for _ in range(args.repeats):
        decode_s.append(generate(ours, prompts_BS.tolist(), greedy).decode_s)
    ferry_rate = new / statistics.median(decode_s)
    with torch.inference_mode():
        hf_total = _median_seconds(
            lambda: theirs.generate(
                prompts_BS, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **hf_options
            ),
            args.repeats,
        )
        hf_prefill = _median_seconds(lambda: theirs(prompts_BS, use_cache=True), args.repeats)
    hf_rate = new / (hf_total - hf_prefill)
    no_cache_rate = new / _median_seconds(
        lambda: _no_cache(ours, prompts_BS, args.new_tokens), max(1, args.repeats // 2)
    )
    figures = {
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "ferry_decode_tokens_per_s": round(ferry_rate, 1),
        "ferry_prefill_tokens_per_s": round(result.prefill_tokens_per_s, 1),
        "transformers_decode_tokens_per_s": round(hf_rate, 1),
        "no_cache_decode_tokens_per_s": round(no_cache_rate, 1),
        "vs_transformers": round(ferry_rate / hf_rate, 3),
        "vs_no_cache": round(ferry_rate / no_cache_rate, 3),
    }
    print(f"ferry {ferry_rate:,.0f} tok/s, transformers {hf_rate:,.0f} tok/s, no cache {no_cache_rate:,.0f} tok/s")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

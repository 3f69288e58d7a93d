"""Prefill, then one token per step against a key/value cache: the decoder `ferry generate` and later
stages (sampling completions for RL) call on a batch of prompts."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ferry.config import UserError
from ferry.inference.config import GenerationConfig
from ferry.inference.sampling import next_tokens
from ferry.model import KVCache, Transformer

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class Completion:
    """One prompt's continuation: its tokens (the end token included when it ended at one), the log-probability
    of each under the model, why it ended, and, with a tokenizer, its text (up to a stop string, without the end
    token)."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text: str | None = None


@dataclass
class GenerationResult:
    completions: list[Completion]
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    cache_bytes_per_token: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


@dataclass(frozen=True)
class GenerationSync:
    """How the ranks of a job that share every forward (expert parallelism) keep decoding in step:
    agree on the longest prompt (so every cache has one capacity) and on whether every row of
    every rank has finished."""

    longest: Callable[[int], int]
    all_finished: Callable[[bool], bool]


@torch.no_grad()  # not inference_mode: FSDP gathers a rollout's weights into buffers the next step gathers into
@torch.compiler.set_stance("force_eager")  # a cache's shapes change every step: compiled blocks would recompile
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    end_ids: Collection[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    row_seeds: Sequence[int] | None = None,
    sync: GenerationSync | None = None,
    progress: Callable[[], None] | None = None,
) -> GenerationResult:
    """Continue every prompt until one of `end_ids`, a stop string (needs `decode`) or `max_new_tokens`.

    The prompts are left-padded into one batch and run once (prefill); then each step
    feeds every row's newest token. A row that has finished keeps being fed (its
    outputs are ignored) so the batch stays rectangular. The cache holds the longest
    prompt plus the new tokens, within `model.config.max_seq_len` (a prompt of that length gets one
    token). `end_ids` are the tokens that end a completion (finish reason "eos"), as a transformers
    generation config's `eos_token_id` lists them. `row_seeds` gives each
    row its own sampling generator (default: one generator seeded with `config.seed`). `progress()` is called
    after the prefill and after each decoding step: a long generation (a held-out evaluation of hundreds of
    prompts) restarts the hang watchdog's clock and says how far it is as it goes.
    """
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise UserError("generate: every prompt needs at least one token")
    if config.stop and decode is None:
        raise UserError("generate: stop strings need a tokenizer to decode the completions")
    max_len = model.config.max_seq_len
    longest = max(len(prompt) for prompt in prompts)
    if sync is not None:
        longest = sync.longest(longest)
    if longest > max_len:
        raise UserError(f"generate: a prompt of {longest} tokens exceeds model.max_seq_len ({max_len})")
    parameter = next(model.parameters())
    device = parameter.device
    lengths_B = torch.tensor([len(prompt) for prompt in prompts])
    pad_B = longest - lengths_B
    tokens_BS = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens_BS[row, int(pad_B[row]) :] = torch.tensor(list(prompt), dtype=torch.long)
    capacity = min(longest + config.max_new_tokens - 1, max_len)
    cache = KVCache(model.config, pad_B, capacity, parameter.dtype, device, model.held_blocks(), config.latent_decoding)
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"generate: {len(row_seeds)} row seeds for {len(prompts)} prompts")
    generator: torch.Generator | list[torch.Generator] = (
        torch.Generator().manual_seed(config.seed)
        if row_seeds is None
        else [torch.Generator().manual_seed(seed) for seed in row_seeds]
    )
    completions = [Completion(prompt_tokens=list(prompt)) for prompt in prompts]
    end_ids = frozenset(end_ids)
    was_training = model.training
    model.eval()
    try:
        timings = _decode(
            model, tokens_BS.to(device), cache, config, generator, completions, end_ids, decode, sync, progress
        )
    finally:
        model.train(was_training)
    if decode is not None:
        for completion in completions:
            completion.text = _text(completion, config.stop, decode)
    return GenerationResult(
        completions,
        prefill_tokens=int(lengths_B.sum()),
        prefill_s=timings[0],
        decode_tokens=sum(len(completion.tokens) for completion in completions),
        decode_s=timings[1],
        cache_bytes_per_token=cache.bytes_per_token,
    )


def _decode(
    model: Transformer,
    tokens_BS: torch.Tensor,
    cache: KVCache,
    config: GenerationConfig,
    generator: torch.Generator | list[torch.Generator],
    completions: list[Completion],
    end_ids: frozenset[int],
    decode: Callable[[list[int]], str] | None,
    sync: GenerationSync | None = None,
    progress: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Prefill, then a token per step until every completion has ended; the seconds of each phase."""
    device = tokens_BS.device

    started = time.perf_counter()
    logits_BV = model(tokens_BS, cache).logits_BSV[:, -1]
    _synchronize(device)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    while True:
        if progress is not None:
            progress()
        chosen_B, logprobs_B = next_tokens(logits_BV, config, generator)
        for completion, token, logprob in zip(completions, chosen_B.tolist(), logprobs_B.tolist()):
            if completion.finish_reason is None:
                completion.tokens.append(token)
                completion.logprobs.append(logprob)
                completion.finish_reason = _finished(completion, token, end_ids, config, decode, cache)
        finished = all(completion.finish_reason is not None for completion in completions)
        if sync.all_finished(finished) if sync is not None else finished:
            break
        logits_BV = model(chosen_B[:, None].to(device), cache).logits_BSV[:, -1]
    _synchronize(device)
    return prefill_s, time.perf_counter() - started


def _finished(
    completion: Completion,
    token: int,
    end_ids: frozenset[int],
    config: GenerationConfig,
    decode: Callable[[list[int]], str] | None,
    cache: KVCache,
) -> FinishReason | None:
    if token in end_ids:
        return "eos"
    if config.stop and any(stop in decode(completion.tokens) for stop in config.stop):
        return "stop"
    if len(completion.tokens) >= config.max_new_tokens or cache.length >= cache.capacity:
        return "length"
    return None


def _text(completion: Completion, stop: list[str], decode: Callable[[list[int]], str]) -> str:
    tokens = completion.tokens[:-1] if completion.finish_reason == "eos" else completion.tokens
    text = decode(tokens)
    if completion.finish_reason == "stop":
        text = text[: min(text.index(word) for word in stop if word in text)]
    return text


def _synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work, so that a time covers the kernels and not only their launch."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)

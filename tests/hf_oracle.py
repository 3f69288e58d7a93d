"""transformers' own model of an architecture, given a ferry model's weights: the oracle of the interop tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ferry.inference.config import GenerationConfig
from ferry.inference.generate import generate
from ferry.interop.architectures import hf_config, to_hf_state
from ferry.model import Transformer


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


def exported(model: Transformer, arch: str, model_class: type):
    """transformers' `model_class` (eager attention) holding `model`'s weights as `arch` names them: every tensor
    it has is given (but a tied head), and no tensor is left over."""
    theirs = AutoModelForCausalLM.from_config(hf_config(model.config, arch, 0, "float32"), attn_implementation="eager")
    assert isinstance(theirs, model_class)
    missing, unexpected = theirs.load_state_dict(to_hf_state(model.state_dict(), model.config, arch), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if model.config.tie_embeddings else [])
    return theirs.eval()


def greedy_tokens_agree(ours: Transformer, theirs, prompt_S: torch.Tensor, new_tokens: int) -> bool:
    """Whether ferry's greedy decoding with its cache and transformers' `generate` give the same tokens."""
    with torch.no_grad():
        their_tokens = theirs.generate(
            prompt_S[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, prompt_S.numel() :].tolist()
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0)
    return generate(ours, [prompt_S.tolist()], config).completions[0].tokens == their_tokens

"""`ferry export CKPT OUT`: a checkpoint (or a run's newest valid one) as a transformers model directory that
`AutoModelForCausalLM` and `AutoTokenizer` load offline.

The config is built with transformers' own class, the weights go through `save_pretrained` (which
shards and indexes them), and the tokenizer becomes a `PreTrainedTokenizerFast` with its end-of-text
token as EOS and padding. Everything the target cannot express is refused before OUT is created.
Every written file takes the umask's mode: safetensors writes its tensor files 0600, which another
account (an evaluation job) could not read beside a `config.json` it can.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.checkpoint import latest_checkpoint
from ferry.config import UserError
from ferry.data.chat import CHAT_TEMPLATE_JINJA, CHAT_TOKENS
from ferry.data.chat_template import chat_of, read_chat_template, template_beside
from ferry.data.tokenizer import END_OF_TEXT, BPETokenizer, load_tokenizer
from ferry.interop.architectures import hf_config, natural_architecture, refusals, to_hf_state
from ferry.interop.deepseek import mtp_layer_prefixes
from ferry.interop.quiet import no_progress_bars
from ferry.interop.weights import (
    append_safetensors,
    checkpoint_model_config,
    checkpoint_tokenizer_path,
    read_model_state,
    weight_count,
)
from ferry.platform.file_modes import give_ordinary_mode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ExportResult:
    checkpoint: Path
    out: Path
    arch: str
    step: int
    parameters: int
    files: list[str]


def export_checkpoint(
    checkpoint_path: str | Path,
    out: str | Path,
    arch: str | None = None,
    dtype: str = "fp32",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> ExportResult:
    out = Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    checkpoint = latest_checkpoint(checkpoint_path)
    config = checkpoint_model_config(checkpoint)
    arch = arch or natural_architecture(config)
    state = read_model_state(checkpoint)
    biased = any(name.endswith("expert_bias_E") and bool(tensor.any()) for name, tensor in state.items())
    problems = refusals(config, arch, expert_bias_nonzero=biased)
    if problems:
        raise UserError(f"cannot export {checkpoint.path} as {arch}: " + "; ".join(problems))
    tokenizer_path = _tokenizer_path(checkpoint, tokenizer)
    fast_tokenizer = _fast_tokenizer(tokenizer_path)
    if len(fast_tokenizer) > config.vocab_size:
        raise UserError(
            f"export: the tokenizer {str(tokenizer_path)!r} has {len(fast_tokenizer)} tokens, more than the model's "
            f"vocabulary ({config.vocab_size}): its last ids have no embedding row; give the run's (--tokenizer PATH)"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"export: {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"export: {out} exists and is not empty; pass --overwrite to replace it")
        if not (out / "config.json").is_file() or checkpoint.path.resolve().is_relative_to(out.resolve()):
            raise UserError(
                f"export: {out} is not an earlier export (a transformers directory without the checkpoint): "
                "--overwrite replaces only such a directory; choose another OUT"
            )
    from transformers import AutoModelForCausalLM

    hf = hf_config(config, arch, fast_tokenizer.eos_token_id, _DTYPE_NAMES[dtype])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=DTYPES[dtype])
    hf_state = {name: tensor.to(DTYPES[dtype]) for name, tensor in to_hf_state(state, config, arch).items()}
    mtp = tuple(mtp_layer_prefixes(config.n_layers, config.mtp.depth))  # written beside transformers' model
    beside = {name: tensor for name, tensor in hf_state.items() if mtp and name.startswith(mtp)}
    held = {name: tensor for name, tensor in hf_state.items() if name not in beside}
    model.load_state_dict(held, strict=not config.tie_embeddings, assign=True)
    if config.tie_embeddings:
        model.tie_weights()
    if fast_tokenizer.chat_template is not None:  # a chat model's answer ends at its end token, a text's at EOS
        model.generation_config.eos_token_id = [fast_tokenizer.eos_token_id, *chat_of(tokenizer_path).end_ids]
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    with no_progress_bars():
        model.save_pretrained(staging)
        append_safetensors(staging, beside)
        fast_tokenizer.save_pretrained(staging)
    for written in staging.rglob("*"):
        if written.is_file():
            give_ordinary_mode(written)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return ExportResult(
        checkpoint=checkpoint.path,
        out=out,
        arch=arch,
        step=checkpoint.step,
        parameters=weight_count(state, config),
        files=sorted(path.name for path in out.iterdir()),
    )


def _tokenizer_path(checkpoint, tokenizer: str | Path | None) -> Path:
    """`--tokenizer`, else the run's (its first dataset's, or the one `ferry import` wrote)."""
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise UserError(f"--tokenizer {str(tokenizer)!r} does not exist")
    found = checkpoint_tokenizer_path(checkpoint, tokenizer)
    if found is None:
        raise UserError(f"export: no tokenizer found for {checkpoint.path}; pass --tokenizer")
    return found


def _fast_tokenizer(path: Path):
    """ferry's BPE tokenizer as a `PreTrainedTokenizerFast`, end-of-text as EOS, BOS-free, padding with EOS;
    one with a chat template beside it (an imported model's, or its SFT data's) carries that template, and one
    holding the ChatML tokens (an SFT run's) ferry's, for `apply_chat_template`."""
    from transformers import PreTrainedTokenizerFast

    loaded = load_tokenizer(path)
    if not isinstance(loaded, BPETokenizer):
        raise UserError(
            f"--tokenizer {str(path)!r}: the byte tokenizer has no transformers form; export needs a BPE one"
        )
    template = template_beside(path)
    if template is not None:
        chat_template = read_chat_template(template)
    else:
        chatml = all(loaded.token_id(token) is not None for token in CHAT_TOKENS)
        chat_template = CHAT_TEMPLATE_JINJA if chatml else None
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
    )

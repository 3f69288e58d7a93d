"""A trained model ready to run: from a checkpoint, a run (or `ferry import`) directory, or a transformers
directory, with the tokenizer that goes with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.checkpoint import latest_checkpoint
from ferry.config import UserError
from ferry.data.manifest import TOKENIZER_NAME
from ferry.data.tokenizer import Tokenizer, load_tokenizer
from ferry.interop import (
    checkpoint_model_config,
    checkpoint_tokenizer_path,
    is_hf_dir,
    read_hf_dir,
    read_model_state,
)
from ferry.kernels import KernelsConfig, select_kernels
from ferry.model import ModelConfig, Transformer
from ferry.platform import resolve_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """The model in eval mode on its device, its tokenizer (None when none was found), where both came from,
    and the config of the run that saved it (empty for a transformers directory)."""

    model: Transformer
    tokenizer: Tokenizer | None
    tokenizer_path: Path | None
    origin: str
    step: int | None
    run_config: dict


def load_model(
    source: str | Path,
    device: str = "auto",
    dtype: str = "fp32",
    tokenizer: str | Path | None = None,
) -> LoadedModel:
    """`source` is a checkpoint (`.../step-N`), a directory of checkpoints, a run or `ferry import` directory
    (its newest valid checkpoint), or a transformers model directory; the kernels are chosen for `device`."""
    path = Path(source)
    if not path.exists():
        raise UserError(f"{source!r} does not exist")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise UserError(f"--tokenizer {str(tokenizer)!r} does not exist")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if is_hf_dir(path):
        config, arch, state = read_hf_dir(path)
        origin, step, found_tokenizer, run_config = f"{path} (transformers, {arch})", None, path / TOKENIZER_NAME, {}
    else:
        checkpoint = latest_checkpoint(path)
        config, state = checkpoint_model_config(checkpoint), read_model_state(checkpoint)
        origin, step = str(checkpoint.path), checkpoint.step
        found_tokenizer = checkpoint_tokenizer_path(checkpoint, tokenizer)
        run_config = checkpoint.manifest.run_config
    tokenizer_path = Path(tokenizer) if tokenizer is not None else found_tokenizer
    if tokenizer_path is not None and not tokenizer_path.is_file():
        tokenizer_path = None
    model = build_model(config, state, device, dtype)
    return LoadedModel(model, _tokenizer(tokenizer_path, config), tokenizer_path, origin, step, run_config)


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: str, dtype: str) -> Transformer:
    target = resolve_device(device)
    kernels = select_kernels(KernelsConfig(), target, DTYPES[dtype])
    model = Transformer(config, kernels)
    model.load_state_dict(state)
    return model.to(target, DTYPES[dtype]).eval()


def _tokenizer(path: Path | None, config: ModelConfig) -> Tokenizer | None:
    """The tokenizer at `path` (None for none); one larger than the model's vocabulary is refused."""
    if path is None:
        return None
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(
            f"tokenizer {path}: its {tokenizer.vocab_size} tokens do not fit the model's vocabulary "
            f"({config.vocab_size})"
        )
    return tokenizer

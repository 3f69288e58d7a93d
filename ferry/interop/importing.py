"""`ferry import HF_DIR OUT`: an OLMoE, Qwen3-MoE, DeepSeek-V3 / V2 or GPT-OSS transformers directory as a ferry
checkpoint (GPT-OSS's MXFP4 experts dequantised, `mxfp4.py`).

OUT holds the checkpoint (`OUT/checkpoints/step-00000000`: the weights, in fp32, and no optimizer
state: training it starts its optimizer afresh), `OUT/model.yaml` (the `model:` section a run config needs
to train it, e.g. `ferry train CONFIG model=... init_from=OUT/checkpoints/step-00000000`), and
`OUT/tokenizer.json` when the directory has one, for `ferry data prepare --tokenizer`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError

from ferry.checkpoint import Layout, TensorPiece
from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint
from ferry.config import UserError
from ferry.data.chat_template import TEMPLATE_FILE, read_chat_template
from ferry.data.tokenizer import encoding_digest, load_tokenizer
from ferry.interop.architectures import from_hf_state, model_config_from_hf
from ferry.interop.deepseek import mtp_layer_prefixes
from ferry.interop.mxfp4 import is_mxfp4, read_mxfp4_state
from ferry.interop.quiet import no_progress_bars, quiet_loading
from ferry.interop.weights import MODEL, read_safetensors, weight_count
from ferry.model import ModelConfig, Transformer
from ferry.platform.fingerprint import environment_fingerprint

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.yaml"


@dataclass(frozen=True)
class ImportResult:
    checkpoint: Path
    model_file: Path
    tokenizer: Path | None
    arch: str
    parameters: int
    chat_template: Path | None = None


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def read_hf_dir(hf_dir: Path) -> tuple[ModelConfig, str, dict[str, torch.Tensor]]:
    """The ferry model config, the architecture and the fp32 weights under ferry's names of a transformers
    directory (offline)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError(
            f"{hf_dir} is a transformers directory; reading it needs: pip install 'ferry-moe[hf]'"
        ) from None
    if not is_hf_dir(hf_dir):
        raise UserError(f"{hf_dir} is not a transformers model directory (no config.json)")
    try:
        hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{hf_dir}/config.json is not a transformers model config: {_first_line(exc)}") from None
    config, arch = model_config_from_hf(hf_config)
    try:
        if is_mxfp4(hf_config):  # GPT-OSS's release: transformers dequantises only where its GPU kernels run
            hf_state = read_mxfp4_state(hf_dir)
        else:
            with no_progress_bars(), quiet_loading(bool(getattr(hf_config, "num_mtp_layers", 0))):
                hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
            hf_state = hf_model.state_dict()
    except (OSError, ValueError, SafetensorError) as exc:  # a truncated weights file is the last of these
        raise UserError(f"{hf_dir}: transformers cannot load its weights: {_first_line(exc)}") from None
    config, hf_state = _with_mtp_modules(hf_dir, hf_config, config, hf_state)
    try:
        state = from_hf_state(hf_state, config, bool(getattr(hf_config, "rope_interleave", False)), arch)
    except KeyError as exc:
        raise UserError(f"{hf_dir} does not hold the tensors its config describes: no {exc}") from None
    expected = set(Transformer(config).state_dict())
    if set(state) != expected:
        raise UserError(f"{hf_dir} does not hold the tensors its config describes: {sorted(expected ^ set(state))[:4]}")
    return config, arch, state


def _with_mtp_modules(
    hf_dir: Path, hf_config, config: ModelConfig, hf_state: dict[str, torch.Tensor]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """DeepSeek-V3's multi-token-prediction modules, which transformers' model leaves out, read from the
    safetensors where the directory holds them (`num_mtp_layers` of them after the layers): the config then has
    `mtp.depth` of them. A config that declares modules whose weights are absent (a model saved by transformers)
    imports without them."""
    declared = getattr(hf_config, "num_mtp_layers", 0) or 0
    prefixes = tuple(mtp_layer_prefixes(config.n_layers, declared))
    if not prefixes:
        return config, hf_state
    found = read_safetensors(hf_dir, lambda name: name.startswith(prefixes))
    depth = sum(1 for prefix in prefixes if prefix + "eh_proj.weight" in found)
    if not depth:
        return config, hf_state
    config = ModelConfig.model_validate({**config.model_dump(), "mtp": {"depth": depth}})
    return config, {**hf_state, **{name: tensor.float() for name, tensor in found.items()}}


def import_hf(hf_dir: str | Path, out: str | Path, tokenizer: str | Path | None = None) -> ImportResult:
    hf_dir, out = Path(hf_dir), Path(out)
    if not is_hf_dir(hf_dir):
        raise UserError(f"import: {hf_dir} is not a transformers model directory (no config.json)")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"import: {out} exists and is not empty")
    config, arch, state = read_hf_dir(hf_dir)
    source_tokenizer = Path(tokenizer) if tokenizer else hf_dir / "tokenizer.json"
    if tokenizer and not source_tokenizer.is_file():
        raise UserError(f"--tokenizer {str(tokenizer)!r} does not exist")
    digest = _encoding_digest(source_tokenizer, config.vocab_size) if source_tokenizer.is_file() else None
    model_config = config.model_dump(mode="json")
    meta = CheckpointMeta(
        step=0,
        tokens_seen=0,
        layout=Layout(world_size=1, ep_degree=1, mode="ep"),
        model_config=model_config,
        run_config={"model": model_config},
        environment={
            **environment_fingerprint(torch.device("cpu")),
            "imported_from": str(hf_dir.resolve()),
            "arch": arch,
        },
        train_state={
            "imported": True,
            "optimizer": "none: training starts its optimizer afresh",
            **({"tokenizer": {"encoding_sha256": digest}} if digest else {}),
        },
    )
    pieces = {MODEL + name: TensorPiece.whole(tensor.detach().contiguous()) for name, tensor in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = save_checkpoint(out / CHECKPOINTS, pieces, meta)
    model_file = out / MODEL_FILE
    model_file.write_text(yaml.safe_dump({"model": model_config}, sort_keys=False))
    copied = template = None
    if source_tokenizer.is_file():
        copied = out / "tokenizer.json"
        shutil.copyfile(source_tokenizer, copied)
        template = _keep_chat_template(hf_dir, out)
    return ImportResult(checkpoint, model_file, copied, arch, weight_count(state, config), template)


def _keep_chat_template(hf_dir: Path, out: Path) -> Path | None:
    """The model's chat template (`chat_template.jinja`, or an older directory's `tokenizer_config.json`) written
    beside the tokenizer, where `ferry data prepare --chat`, `ferry generate` and `ferry export` find it."""
    if not any((hf_dir / name).is_file() for name in (TEMPLATE_FILE, "tokenizer_config.json")):
        return None
    try:
        template = read_chat_template(hf_dir)
    except UserError:  # a tokenizer_config.json without a template: a base model
        return None
    kept = out / TEMPLATE_FILE
    kept.write_text(template, encoding="utf-8")
    return kept


def _encoding_digest(path: Path, vocab_size: int) -> str | None:
    """The tokenizer's `encoding_digest`, recorded so that generation and export find this one and no other;
    None for one ferry cannot read (copied all the same, for `ferry data prepare --tokenizer` to say why).
    A tokenizer with more tokens than the model's vocabulary is refused: its last ids have no embedding row."""
    try:
        loaded = load_tokenizer(path)
    except UserError:
        return None
    if loaded.vocab_size > vocab_size:
        raise UserError(
            f"import: the tokenizer {str(path)!r} has {loaded.vocab_size} tokens, more than the model's vocabulary "
            f"({vocab_size}): give the one it was trained with (--tokenizer PATH)"
        )
    return encoding_digest(loaded)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

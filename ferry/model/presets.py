"""Named model shapes (`configs/models/*.yaml`, each a `model:` section): the published MoE families a user
starts from, and a tiny variant of each (`-tiny`) with the same structure for CPU tests and demos."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ferry.config import ConfigError, UserError
from ferry.config.loader import validate
from ferry.config.named import named_files, read_named_yaml
from ferry.model.config import ModelConfig
from ferry.model.counting import ModelSize, count_model
from ferry.model.kv_cache import cache_bytes_per_token

PRESETS_DIR = Path("configs") / "models"
# the length `ferry models` compares every preset's attention FLOPs at, unless told another (a preset whose context
# is shorter: at its own): one length for all rows, or a 32k-context model's row would look 8x more costly a token
COMPARED_SEQ_LEN = 4096


@dataclass(frozen=True)
class PresetSummary:
    """What a preset costs: its parameters, a training token's FLOPs at `seq_len`, a cached token's bf16 bytes."""

    name: str
    config: ModelConfig
    size: ModelSize
    seq_len: int
    cache_bytes_per_token: int


def preset_names() -> list[str]:
    return sorted(named_files(PRESETS_DIR))


def preset_name(spec: str) -> str:
    """A preset's name: its file's stem, or, for a file named after what it holds (`model.yaml`, which `ferry import`
    writes beside the checkpoint it imported), the directory that holds it."""
    path = Path(spec)
    return path.resolve().parent.name if path.stem == "model" and path.suffix in (".yaml", ".yml") else path.stem


def load_preset(spec: str) -> ModelConfig:
    """The model config of a preset file (a path, or a name in `configs/models/`)."""
    path, raw = read_named_yaml(spec, PRESETS_DIR, "model preset")
    if set(raw) != {"model"}:
        raise UserError(f"model preset {str(path)!r} must hold one `model:` section, not {sorted(raw)}")
    try:
        return validate(ModelConfig, raw["model"])
    except ConfigError as exc:
        raise ConfigError(f"model preset {str(path)!r}: {exc}") from None


def summarise(spec: str, seq_len: int | None = None) -> PresetSummary:
    """A preset's counts, at `seq_len` for the attention FLOPs (default `COMPARED_SEQ_LEN`), or at the preset's
    whole context where that is shorter."""
    if seq_len is not None and seq_len < 1:
        raise UserError(f"--seq-len must be at least 1, got {seq_len}")
    config = load_preset(spec)
    length = min(seq_len or COMPARED_SEQ_LEN, config.max_seq_len)
    return PresetSummary(
        preset_name(spec), config, count_model(config, length), length, cache_bytes_per_token(config, 2)
    )


def preset_overrides(spec: str) -> list[str]:
    """The overrides that put a preset in a run config's place (`ferry train --model`): its whole model section,
    as a flow mapping, so that later overrides (`model.max_seq_len=...`) still apply on top, and its name, which
    the run records (`run.model_preset`)."""
    model = json.dumps(load_preset(spec).model_dump(mode="json"))
    return [f"model={model}", f"run.model_preset={json.dumps(preset_name(spec))}"]

"""The architecture kinds by their name (`--arch`, transformers' `model_type`), in the order an export's default is
asked in: the first whose `natural` takes the model."""

from __future__ import annotations

from ferry.interop.architectures.base import ArchitectureKind
from ferry.interop.architectures.deepseek_v2 import DeepseekV2
from ferry.interop.architectures.deepseek_v3 import DeepseekV3
from ferry.interop.architectures.gpt_oss import GptOss
from ferry.interop.architectures.olmoe import Olmoe
from ferry.interop.architectures.qwen3_moe import Qwen3Moe

ARCHITECTURE_KINDS: dict[str, ArchitectureKind] = {
    kind.name: kind for kind in (DeepseekV3(), GptOss(), Qwen3Moe(), Olmoe(), DeepseekV2())
}
ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_KINDS)

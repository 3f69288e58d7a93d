"""Interop with Hugging Face transformers: export a checkpoint as an OLMoE or Qwen3-MoE model directory,
and import one as a ferry checkpoint."""

from ferry.interop.architectures import ARCHITECTURES, model_config_from_hf, refusals
from ferry.interop.export import ExportResult, export_checkpoint
from ferry.interop.importing import ImportResult, import_hf

__all__ = [
    "ARCHITECTURES",
    "ExportResult",
    "ImportResult",
    "export_checkpoint",
    "import_hf",
    "model_config_from_hf",
    "refusals",
]

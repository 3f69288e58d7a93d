"""Interop with Hugging Face transformers: export a checkpoint as an OLMoE or Qwen3-MoE model directory."""

from ferry.interop.architectures import ARCHITECTURES, model_config_from_hf, refusals
from ferry.interop.export import ExportResult, export_checkpoint

__all__ = ["ARCHITECTURES", "ExportResult", "export_checkpoint", "model_config_from_hf", "refusals"]

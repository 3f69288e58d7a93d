"""Interop with Hugging Face transformers: export a checkpoint as an OLMoE, Qwen3-MoE or DeepSeek-V3 model
directory, and import one as a ferry checkpoint."""

from ferry.interop.architectures import ARCHITECTURES, model_config_from_hf, refusals
from ferry.interop.export import ExportResult, export_checkpoint
from ferry.interop.importing import ImportResult, import_hf, is_hf_dir, read_hf_dir
from ferry.interop.weights import checkpoint_model_config, checkpoint_tokenizer_path, read_model_state

__all__ = [
    "ARCHITECTURES",
    "ExportResult",
    "ImportResult",
    "checkpoint_model_config",
    "checkpoint_tokenizer_path",
    "export_checkpoint",
    "import_hf",
    "is_hf_dir",
    "model_config_from_hf",
    "read_hf_dir",
    "read_model_state",
    "refusals",
]

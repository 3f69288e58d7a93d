"""The model run without training: decoding with a key/value cache (`ferry generate`, and the batch API
later stages sample with) and held-out evaluation (during training and `ferry eval`)."""

from ferry.inference.config import EvalConfig, GenerationConfig, HeldOutSource
from ferry.inference.evaluation import HeldOutEvaluation, SourceLoss, eval_record
from ferry.inference.generate import Completion, GenerationResult, generate
from ferry.inference.loading import LoadedModel, load_model

__all__ = [
    "Completion",
    "EvalConfig",
    "GenerationConfig",
    "GenerationResult",
    "HeldOutEvaluation",
    "HeldOutSource",
    "LoadedModel",
    "SourceLoss",
    "eval_record",
    "generate",
    "load_model",
]

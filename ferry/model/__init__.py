"""The MoE transformer. Model code is device-agnostic: no vendor imports, no device branches."""

from ferry.model.config import BiasBalancingConfig, ModelConfig, MoEConfig
from ferry.model.counting import ModelSize, count_model
from ferry.model.kv_cache import KVCache
from ferry.model.moe import MoELayer, MoEStats
from ferry.model.transformer import ModelOutput, Transformer

__all__ = [
    "BiasBalancingConfig",
    "ModelConfig",
    "MoEConfig",
    "ModelSize",
    "count_model",
    "KVCache",
    "MoELayer",
    "MoEStats",
    "ModelOutput",
    "Transformer",
]

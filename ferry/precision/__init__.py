"""Precision: dtype policy from config and hardware profile, loss scaling, FP8 and MX formats."""

from ferry.precision.config import LossScalingConfig, PrecisionConfig
from ferry.precision.policy import PrecisionPolicy, resolve_precision
from ferry.precision.recipe import LowPrecisionRecipe
from ferry.precision.scaler import LossScaler

__all__ = [
    "LossScalingConfig",
    "PrecisionConfig",
    "PrecisionPolicy",
    "resolve_precision",
    "LowPrecisionRecipe",
    "LossScaler",
]

"""Metrics: step timers, MoE load diagnostics, the step record, and the sinks it goes to.

`ferry.metrics.plots` (matplotlib) is imported by the commands that draw, not here,
so a training process does not pay for it.
"""

from ferry.metrics.config import MetricsConfig, ProfileConfig, PrometheusConfig, SinksConfig, TensorBoardConfig
from ferry.metrics.console import ConsoleProgress
from ferry.metrics.hub import MetricsHub, build_sinks, check_trackers, start_prometheus, start_trackers
from ferry.metrics.jsonl import JsonlSink, metrics_path, read_metrics
from ferry.metrics.moe import dropped_tokens, moe_diagnostics, router_entropy
from ferry.metrics.names import METRICS, METRICS_FILE, Metric, prometheus_names
from ferry.metrics.step import StepMetrics, memory_peak_mib
from ferry.metrics.timer import StepTimer, StepTimes
from ferry.metrics.trace import TorchTrace

__all__ = [
    "ConsoleProgress",
    "JsonlSink",
    "METRICS",
    "METRICS_FILE",
    "Metric",
    "MetricsConfig",
    "MetricsHub",
    "check_trackers",
    "start_trackers",
    "ProfileConfig",
    "PrometheusConfig",
    "SinksConfig",
    "StepMetrics",
    "StepTimer",
    "StepTimes",
    "TensorBoardConfig",
    "TorchTrace",
    "build_sinks",
    "start_prometheus",
    "dropped_tokens",
    "memory_peak_mib",
    "metrics_path",
    "moe_diagnostics",
    "prometheus_names",
    "read_metrics",
    "router_entropy",
]

"""Metrics: where per-step figures go (a JSONL file always, the console for people)."""

from ferry.metrics.console import ConsoleProgress
from ferry.metrics.jsonl import JsonlSink

__all__ = ["ConsoleProgress", "JsonlSink"]

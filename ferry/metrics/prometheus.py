"""A Prometheus endpoint serving the latest step's metrics as gauges, on loopback unless configured otherwise.

Gauges rather than counters: a record is a snapshot of one step, and a resumed
run may legitimately go back in steps. Every series carries a `run` label so one
Prometheus can scrape several runs; per-layer and per-expert metrics add `layer`
and `expert` labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from ferry.config import UserError
from ferry.metrics.config import PrometheusConfig
from ferry.metrics.names import METRICS

_LABELS = {
    "step": ("run",),
    "layer": ("run", "layer"),
    "expert": ("run", "layer", "expert"),
    "source": ("run", "source"),
    "stage": ("run", "stage"),
    "depth": ("run", "depth"),
}


class PrometheusSink:
    """Serves `/metrics` from a thread of its own; `port` is the bound port (useful when configured as 0)."""

    def __init__(self, config: PrometheusConfig, run_name: str):
        self.run_name = run_name
        self.registry = CollectorRegistry()
        self._gauges = [
            (metric, Gauge(metric.prometheus, metric.help, _LABELS[metric.shape], registry=self.registry))
            for metric in METRICS
        ]
        try:
            self._server, self._thread = start_http_server(config.port, config.host, self.registry)
        except OSError as exc:
            raise UserError(
                f"metrics.sinks.prometheus: cannot listen on {config.host}:{config.port} ({exc.strerror or exc}); "
                "choose another metrics.sinks.prometheus.port, or 0 for any free port"
            ) from None
        self.host = config.host
        self.port: int = self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def write(self, record: dict) -> None:
        for metric, gauge in self._gauges:
            value = record.get(metric.key)
            if value is None:
                continue
            if metric.shape == "step":
                gauge.labels(self.run_name).set(value * metric.scale)
            elif metric.shape in ("source", "depth"):
                for source, source_value in value.items():
                    gauge.labels(self.run_name, source).set(source_value * metric.scale)
            elif metric.shape in ("layer", "stage"):
                for index, indexed_value in enumerate(value):
                    gauge.labels(self.run_name, str(index)).set(indexed_value * metric.scale)
            else:
                for layer, values_E in enumerate(value):
                    for expert, expert_value in enumerate(values_E):
                        gauge.labels(self.run_name, str(layer), str(expert)).set(expert_value * metric.scale)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

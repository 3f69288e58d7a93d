"""Metrics configuration: which sinks receive the step records, and which steps get a profiler trace.

`metrics.jsonl` is always written (every tool reads it), so it has no switch;
the other sinks are opt-in except the console.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from ferry.config.section import Section


class PrometheusConfig(Section):
    """An HTTP endpoint for Prometheus to scrape; loopback only unless `host` says otherwise."""

    enabled: bool = False
    host: str = Field("127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 exposes it to the network")
    port: int = Field(9464, ge=0, le=65535, description="0 picks a free port (the sink reports which)")


class TensorBoardConfig(Section):
    """Event files under `<run.dir>/tensorboard`; needs the `tensorboard` extra installed."""

    enabled: bool = False


class SinksConfig(Section):
    console: bool = Field(True, description="progress bar on a terminal, a line every train.log_every steps elsewhere")
    prometheus: PrometheusConfig = PrometheusConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()


class MetricsConfig(Section):
    """Where the per-step records go besides `metrics.jsonl`."""

    sinks: SinksConfig = SinksConfig()
    attn_max_logit: bool = Field(
        False, description="record each step's largest attention logit (`attn.max_logit`): a product of queries and "
        "keys per layer beside the attention, which never forms the logits (on whenever optim.muon.qk_clip is)"
    )


class ProfileConfig(Section):
    """Opt-in torch.profiler trace of a few steps (chrome trace JSON under `<run.dir>/traces`)."""

    torch_trace: list[int] | None = Field(
        None, min_length=2, max_length=2, description="[first, last] step to trace, inclusive, 1-based"
    )

    @field_validator("torch_trace")
    @classmethod
    def _ordered_steps(cls, steps: list[int] | None) -> list[int] | None:
        if steps is not None and not 1 <= steps[0] <= steps[1]:
            raise ValueError("write it as [first, last] with 1 <= first <= last")
        return steps

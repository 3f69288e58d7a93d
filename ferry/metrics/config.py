"""Metrics configuration: which sinks receive the step records, and which steps get a profiler trace.

`metrics.jsonl` is always written (every tool reads it), so it has no switch;
the other sinks are opt-in except the console.
"""

from __future__ import annotations

from typing import Literal

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


TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class WandbConfig(Section):
    """Weights & Biases (`metrics.trackers: [wandb]`, the `wandb` extra): a run per ferry run, its id kept in the
    run directory so a resumed or restarted run continues it. A setting left unset here leaves W&B's own environment
    variable in force (`WANDB_PROJECT`, `WANDB_MODE`, `WANDB_DIR`, `WANDB_ENTITY`, `WANDB_BASE_URL`), and ferry's
    default where that is unset too (ferry/metrics/tracker_settings.py)."""

    project: str | None = Field(None, min_length=1, description="default: WANDB_PROJECT, else ferry")
    entity: str | None = Field(
        None, min_length=1, description="team or user (default: WANDB_ENTITY, else the API key's)"
    )
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="offline: the run is written under dir only, for `wandb sync` later; disabled: no W&B run "
        "(as W&B means it: nothing logged, nothing counted as a failure); default: WANDB_MODE, else online",
    )
    dir: str | None = Field(
        None, min_length=1, description="where W&B writes its files (default: WANDB_DIR, else the run directory)"
    )
    base_url: str | None = Field(
        None, min_length=1, description="a W&B server of your own (default: WANDB_BASE_URL, else W&B's)"
    )
    init_timeout_s: float = Field(60.0, gt=0.0, description="how long W&B may take to open its run")


class MlflowConfig(Section):
    """MLflow (`metrics.trackers: [mlflow]`, the `mlflow` extra): a run per ferry run, its id kept in the run
    directory so a resumed or restarted run continues it. A setting left unset here leaves MLflow's own environment
    variable in force (`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`), and ferry's default where that is unset too."""

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        description="an MLflow server (http://...) or a database (sqlite:///...); default: MLFLOW_TRACKING_URI, else "
        "sqlite:///<run.dir>/mlflow.db",
    )
    experiment: str | None = Field(None, min_length=1, description="default: MLFLOW_EXPERIMENT_NAME, else ferry")


class MetricsConfig(Section):
    """Where the per-step records go besides `metrics.jsonl`."""

    sinks: SinksConfig = SinksConfig()
    trackers: list[TrackerName] = Field(
        default_factory=list,
        description="experiment trackers that get every step record (the names Prometheus and TensorBoard use), the "
        "resolved config and run.json's summary, and at the end run.json and the plots: tensorboard (as "
        "sinks.tensorboard.enabled), wandb, mlflow; rank 0 logs, from a thread of its own, and a tracker that "
        "fails is left with a warning while training goes on (ferry/metrics/tracker_sink.py)",
    )
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    tracker_timeout_s: float = Field(
        60.0, gt=0.0, description="the most a run's end waits for its trackers to take the last records and files"
    )
    attn_max_logit: bool = Field(
        False,
        description="record each step's largest attention logit (`attn.max_logit`): a product of queries and "
        "keys per layer beside the attention, which never forms the logits (on whenever optim.muon.qk_clip is)",
    )

    @field_validator("trackers")
    @classmethod
    def _each_tracker_once(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"{trackers}: name each tracker once")
        return trackers


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

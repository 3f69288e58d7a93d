"""Fault configuration: hang detection, the failure rate the checkpoint interval is balanced against,
what a non-finite gradient does, the restart budget without progress, and faults to inject."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferry.config.section import Section

FaultKind = Literal[
    "kill",
    "hang",
    "raise",
    "nan",
    "corrupt_checkpoint",
    "kill_during_save",
    "disk_full_during_save",
    "permission_denied_during_save",
    "io_error_during_save",
]

# Meta's Llama 3 run: 419 unexpected interruptions in 54 days on 16,384 H100s (Llama 3 paper, 2024):
# 54 x 24 x 16,384 / 419 = 50,678 hours between failures per GPU.
PUBLISHED_MTBF_HOURS_PER_DEVICE = 50_000.0


class FaultSpec(Section):
    """One fault to inject: at the start of `step` on `rank` (for checkpoint faults: at the save of `step`; with
    `checkpoint.interval: auto`, whose saving steps are not known in advance, at the first save at or after it)."""

    step: int = Field(ge=1)
    rank: int = Field(0, ge=0)
    kind: FaultKind
    once: bool = Field(True, description="fire once per run directory; false: at every attempt (a deterministic crash)")


class FaultConfig(Section):
    """How a run detects hangs, balances checkpoints against failures, and which faults it rehearses."""

    hang_timeout_s: float | Literal["auto"] | None = Field(
        "auto",
        description="a rank that completes no step for this long reports where it is stuck and the job restarts; "
        "auto: hang_multiple x the median step time, at least hang_floor_s; null: no watchdog",
    )
    hang_multiple: float = Field(10.0, gt=1.0, description="auto timeout as a multiple of the median step time")
    hang_floor_s: float = Field(60.0, gt=0.0, description="the least auto timeout")
    hang_first_step_s: float = Field(
        300.0, ge=0.0, description="extra allowance for a process's first step (start-up, resume, compilation)"
    )
    hang_checkpoint_s: float = Field(600.0, ge=0.0, description="extra allowance while a checkpoint is saved")
    mtbf_hours_per_device: float = Field(
        PUBLISHED_MTBF_HOURS_PER_DEVICE,
        gt=0.0,
        allow_inf_nan=False,
        description="mean time between failures of one device; the job's is this over the number of devices "
        "(default: Meta's Llama 3 run, about one interruption every 3 hours on 16,384 H100s)",
    )
    on_nonfinite: Literal["skip", "raise"] = Field(
        "skip",
        description="a step whose gradients hold inf/NaN: skip it (as loss scaling does), or fail the job so a "
        "supervised run rolls back to its last checkpoint",
    )
    max_no_progress_restarts: int = Field(
        2, ge=0, description="restarts in a row that complete no new step before the supervisor gives up"
    )
    inject: list[FaultSpec] = Field(default_factory=list, description="faults to inject (rehearsals, tests, drills)")

    @field_validator("hang_timeout_s")
    @classmethod
    def _timeout_positive(cls, timeout: float | str | None) -> float | str | None:
        if isinstance(timeout, (int, float)) and not timeout > 0:
            raise ValueError("must be positive, auto, or null (no watchdog)")
        return timeout

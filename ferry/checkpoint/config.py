"""Checkpoint configuration: when the train state is saved, where, and how many are kept."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ferry.config.section import Section

RUN_CHECKPOINTS = "checkpoints"  # where a run directory keeps its checkpoints by default


class CheckpointConfig(Section):
    """A checkpoint is saved every `interval` steps and at the end of the run (docs/checkpoint-format.md)."""

    enabled: bool = Field(True, description="false: the run saves no checkpoint at all (a benchmark); it cannot resume")
    dir: str | None = Field(None, min_length=1, description="where checkpoints go; default <run.dir>/checkpoints")
    interval: int | Literal["auto"] = Field(
        0,
        description="save every N optimizer steps; 0 saves only at the end of the run; auto: Young/Daly from the "
        "measured cost of a save and the job's failure rate (fault.mtbf_hours_per_device)",
    )
    auto_first_step: int = Field(
        10, ge=1, description="with interval auto: the first save, which measures the cost, this many steps in"
    )
    keep: int = Field(3, ge=1, description="keep the newest K checkpoints and delete older ones")
    file_mb: int = Field(
        256,
        ge=1,
        description="largest tensor file in MiB: a rank's state is split over several, which hash and read on all "
        "cores at once (a tensor larger than this gets a file of its own)",
    )
    direct_io: bool = Field(
        True,
        description="write tensor files past the page cache (O_DIRECT, two 8 MiB aligned buffers a file), where the "
        "OS and filesystem allow: nothing reads a checkpoint soon after it is written, and filling the cache with it "
        "cost a save most of its speed (docs/performance.md); false: through the page cache",
    )
    verify: Literal["xxh3_128", "sha256"] = Field(
        "xxh3_128",
        description="the file digest a resume checks: xxh3_128 finds corrupt and truncated files as surely and "
        "runs ~8x faster than sha256; both are in every manifest, and `ferry ckpt verify` checks both",
    )
    async_save: bool | Literal["auto"] = Field(
        "auto",
        description="true: copy the tensors to host memory, then write them on a background thread per rank while "
        "training goes on; auto: so on a multi-rank run whose snapshot fits in half the host's free memory, "
        "otherwise false (the choice is in run.json)",
    )
    writer_niceness: int = Field(
        10,
        ge=0,
        le=19,
        description="how much lower a background save's writer threads run than training (Linux niceness): 0 "
        "competes for the cores as an equal; 10 takes the time training leaves and a tenth of a busy core; 19 "
        "only what training leaves",
    )
    on_failure: Literal["stop", "continue"] = Field(
        "stop",
        description="a save the storage refuses (full, no permission, an I/O error): stop the run with the error, "
        "or go on training and try again at the next save; counted in the step record either way",
    )

    @field_validator("interval")
    @classmethod
    def _interval_not_negative(cls, interval: int | str) -> int | str:
        if isinstance(interval, int) and interval < 0:
            raise ValueError("must be 0 or more, or auto")
        return interval

    @model_validator(mode="after")
    def _nothing_saved_without_checkpoints(self) -> CheckpointConfig:
        if not self.enabled and self.interval:
            raise ValueError("interval must be 0 when enabled is false: a run that saves nothing has no interval")
        return self

    def path(self, run_dir: Path) -> Path:
        return Path(self.dir) if self.dir else run_dir / RUN_CHECKPOINTS

    def saves_in_background(self, world_size: int, snapshot_fits: bool = True) -> bool:
        """`async_save`, read in one place for the manager and the memory model: true or false as set; `auto` in
        the background on a multi-rank run whose every rank's snapshot fits its share of the free host memory (the
        memory model, which plans before any save, counts the snapshot as held)."""
        if self.async_save == "auto":
            return world_size > 1 and snapshot_fits
        return self.async_save

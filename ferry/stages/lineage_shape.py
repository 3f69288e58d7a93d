"""The shape of `lineage.json` as ferry writes it, checked before the runner or `pipeline show` reads a field.

A lineage edited by hand, cut short by a full disk or written by another tool would otherwise end a
command in a KeyError or TypeError deep in the runner; it is refused instead, naming the file and the
first field that is wrong. Fields ferry does not read are allowed: a later version may add some.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ferry.config import UserError
from ferry.config.errors import first_problem

StageStatus = Literal["running", "finished", "stopped", "failed", "refused"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow")


class ParentShape(_Shape):
    stage: str | None = None
    checkpoint: str
    digest: str
    step: int


class StartShape(_Shape):
    init_from: str | None
    carry: str
    steps: str
    lr: str | None = None


class DatasetShape(_Shape):
    name: str
    path: str
    weight: float | None = None
    manifest_sha256: str | None


class CodeShape(_Shape):
    ferry: str
    git_commit: str | None = None
    git_dirty: bool | None = None


class ResultShape(_Shape):
    checkpoint: str
    digest: str
    step: int
    loss: float | None = None
    eval_loss: dict[str, float] | None = None
    eval: dict[str, dict[str, float]] = {}
    data_realised: list[dict[str, Any]] = []  # what each source gave the stage (windows, tokens, epochs)


class StageShape(_Shape):
    name: str
    status: StageStatus
    start: StartShape
    parent: ParentShape | None
    config: dict[str, Any]
    data: list[DatasetShape]
    seed: int
    code: CodeShape
    result: ResultShape | None = None


class PipelineShape(_Shape):
    name: str
    file: str
    sha256: str


class LineageShape(_Shape):
    format: str
    version: int
    pipeline: PipelineShape
    stages: list[StageShape]


def check_lineage_shape(data: object, path: Path) -> dict[str, Any]:
    """`data` as read from `path`, once it has the shape ferry writes; a `UserError` naming the first wrong field."""
    try:
        LineageShape.model_validate(data)
    except ValidationError as exc:
        raise UserError(
            f"{path} is not a lineage as ferry writes it: {first_problem(exc)} ({exc.error_count()} error(s)); "
            "restore it, or run the pipeline in a new --dir"
        ) from None
    if any(stage["status"] == "finished" and stage.get("result") is None for stage in data["stages"]):
        raise UserError(f"{path} is not a lineage as ferry writes it: a finished stage has no result")
    return data

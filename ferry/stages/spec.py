"""A pipeline file: the stages of a model's training, each a run config and how it starts from its parent.

    name: tiny
    stages:
      - name: pretrain
        config: ../tiny.yaml           # a run config (relative to this file)
        overrides: {train.steps: 200}
      - name: midtrain                 # no `config`: the previous stage's config with these overrides
        init_from: previous            # previous | a checkpoint path | hf:DIR (a transformers directory)
        carry: weights+optimizer       # weights | weights+optimizer
        steps: reset                   # reset: a new step counter and schedule; continue: the parent's
        lr: parent                     # start from the learning rate the parent ended with
        overrides: {optim.schedule: linear, optim.min_lr_ratio: 0.0, train.steps: 100}

`ferry pipeline run FILE --dir DIR` runs the stages in order, each in `DIR/<name>/`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ferry.config import (
    ConfigError,
    Section,
    UserError,
    apply_override_mapping,
    apply_overrides,
    check_unique_names,
)
from ferry.config.loader import read_yaml, validate
from ferry.train.config import RunConfig

PREVIOUS = "previous"
HF_PREFIX = "hf:"


class StageSpec(Section):
    """One stage: its run config (a file, or the previous stage's) with overrides, and where it starts."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    config: str | None = Field(None, description="a run config file, relative to the pipeline file")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted keys and their values")
    init_from: str | None = Field(None, description="previous, a checkpoint (or directory of them), or hf:DIR")
    carry: Literal["weights", "weights+optimizer"] = "weights"
    steps: Literal["reset", "continue"] = Field(
        "reset", description="continue: the parent's step counter, schedule and data position (needs weights+optimizer)"
    )
    lr: Literal["parent"] | None = Field(
        None, description="parent: optim.lr is the learning rate the parent ended with"
    )
    nproc: int | None = Field(None, ge=1, description="local ranks for this stage (default: the pipeline's)")

    @model_validator(mode="after")
    def _start_is_consistent(self) -> StageSpec:
        if self.steps == "continue" and self.carry != "weights+optimizer":
            raise ValueError("steps: continue carries the whole train state; set carry: weights+optimizer")
        if self.init_from is None and (self.steps == "continue" or self.lr == "parent" or self.carry != "weights"):
            raise ValueError("carry, steps: continue and lr: parent describe a start from a parent; set init_from")
        if self.init_from is not None and self.init_from.startswith(HF_PREFIX) and self.carry != "weights":
            raise ValueError("a transformers directory holds weights only; use carry: weights with hf:")
        return self


class PipelineSpec(Section):
    name: str = Field(min_length=1)
    description: str = ""
    stages: list[StageSpec] = Field(min_length=1)
    path: str = Field("", description="the file it was read from (not written in the file)")

    @field_validator("stages")
    @classmethod
    def _stages_valid(cls, stages: list[StageSpec]) -> list[StageSpec]:
        check_unique_names(stages, "stage")
        if stages[0].config is None:
            raise ValueError(f"the first stage ({stages[0].name}) needs a config file")
        if stages[0].init_from == PREVIOUS:
            raise ValueError(f"the first stage ({stages[0].name}) has no previous stage to start from")
        return stages


def load_pipeline(path: str | Path) -> PipelineSpec:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"pipeline file {str(path)!r} is a directory; give the YAML file")
    if not path.is_file():
        raise ConfigError(f"pipeline file {str(path)!r} does not exist")
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"pipeline file {path}: expected a mapping with name and stages")
    return validate(PipelineSpec, {**raw, "path": str(path)})


# what the runner sets for every stage: a value given for one would be overwritten without a word
STAGE_KEYS = ("resume", "init_from", "init_optimizer", "run.dir", "run.name")


def stage_configs(spec: PipelineSpec, overrides: list[str] = ()) -> list[dict[str, Any]]:
    """Every stage's run config as plain data: its file (or the previous stage's config), its overrides,
    then `overrides` (the command line's, for every stage). Validated, so a bad key names its stage."""
    base_dir = Path(spec.path).parent
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key.startswith(STAGE_KEYS):
            raise UserError(
                f"{key}: the pipeline sets it for each stage (where the stage runs and what it starts from: a "
                "stage's init_from, carry and steps in the pipeline file); leave it out of the command line"
            )
    resolved: list[dict[str, Any]] = []
    previous: dict[str, Any] = {}
    for stage in spec.stages:
        origin = f"stage {stage.name} of {spec.path}"
        raw = read_yaml(base_dir / stage.config) if stage.config is not None else copy.deepcopy(previous)
        for key in stage.overrides:
            if key.startswith(STAGE_KEYS):
                raise UserError(f"{origin}: {key}: the pipeline sets it for each stage; use the stage's init_from")
        raw = apply_override_mapping(raw, stage.overrides, origin)
        previous = raw
        raw = apply_overrides(raw, list(overrides))
        try:
            validate(RunConfig, raw)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
        resolved.append(raw)
    return resolved

"""The shape of a history line `ferry report` reads, checked before it reads any field.

The history is evidence: a line edited by hand, or written by another version, must not be counted as
proof (a `passed` that is the string "false" is truthy) or end the report in a TypeError that hides the
other lines. A line of the wrong shape is left out and named, like one that is not JSON at all. Types
are strict: nothing is converted, since a converted value is not what the rehearsal recorded. Fields the
report does not read are allowed.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

Number = StrictInt | StrictFloat


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Dated(_Shape):
    date: StrictStr

    @field_validator("date")
    @classmethod
    def _iso_date(cls, value: str) -> str:
        datetime.datetime.fromisoformat(value)
        return value


class SideShape(_Shape):
    name: StrictStr
    digest: StrictStr | None = None


class ConfigShape(_Shape):
    name: StrictStr


class ComparisonShape(_Shape):
    passed: StrictBool


class WorstShape(_Shape):
    max_abs_diff: Number | None = None
    max_rel_diff: Number | None = None
    max_bound_fraction: Number | None = None


class LeadTimeShape(_Shape):
    verify_s: Number | None = None
    restore_s: Number | None = None
    first_step_s: Number | None = None
    bundle_check_s: Number | None = None
    judged_s: Number | None = None


class ConditionsShape(_Shape):
    """What a throughput was measured under (ferry/portability/rehearsal/conditions.py). Absent from lines written
    before ferry measured it: those read as conditions unknown."""

    under_load: StrictBool | None = None
    others_busy_cores: Number | None = None
    load_1m_mean: Number | None = None
    load_1m_max: Number | None = None
    logical_cores: StrictInt | None = None
    cpu_model: StrictStr | None = None
    ranks: StrictInt | None = None
    torch_threads: StrictInt | None = None


class ThroughputShape(_Shape):
    target_over_source: Number | None = None
    source_conditions: ConditionsShape | None = None
    target_conditions: ConditionsShape | None = None


class ToleranceShape(_Shape):
    rtol: Number | None = None


class RehearsalShape(_Dated):
    path: StrictStr
    source: SideShape
    target: SideShape
    config: ConfigShape
    steps: StrictInt
    switch_at: StrictInt
    profile: StrictStr
    verdict: Literal["PASS", "FAIL"]
    passed: StrictBool
    conclusive: StrictBool = True
    comparisons: dict[str, ComparisonShape]
    lead_time: LeadTimeShape
    throughput: ThroughputShape
    worst: WorstShape = WorstShape()
    tolerance: ToleranceShape = ToleranceShape()

    @model_validator(mode="after")
    def _verdict_agrees(self) -> RehearsalShape:
        if (self.verdict == "PASS") != self.passed:
            raise ValueError(f"verdict {self.verdict} contradicts passed {self.passed}")
        return self


class BenchOpShape(_Shape):
    op: StrictStr
    fastest_vendor: StrictStr | None = None
    portable_loss: Number | None = None


class KernelBenchShape(_Dated):
    device: StrictStr
    dtype: StrictStr = ""
    budget: Number
    ops: list[BenchOpShape]


def well_formed(record: dict[str, Any], shape: type[_Shape]) -> bool:
    """Whether `record` has the shape the report reads."""
    try:
        shape.model_validate(record)
    except ValidationError:
        return False
    return True

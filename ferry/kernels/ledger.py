"""The debt ledger: every vendor implementation is registered debt with an owner and an expiry.

A vendor kernel buys speed on one platform and costs a second code path that must
be kept in agreement with the portable one and rewritten when the platform goes.
The ledger (`ledger.yaml`, beside this file) records who owns that debt, why it was
taken on, what it measured, when it was approved and when it must be reviewed
again. `auto` selection only takes an implementation whose entry is approved and
not expired; an entry without an approval date registers an implementation for
measurement and explicit use only.

A low-precision implementation (FP8 expert GEMMs) competes twice: with its op's
portable emulation, which its `measured_gain` and approval are about, and with the
same run in bf16, which is what a user asking for the format wants to beat. Its
`step_vs_bf16` measurements record the second, per hardware profile; where one is
below 1x the implementation is there for its numerics only, and the precision layer
says so at the start of every run that asks for the format there.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import Field, field_validator

from ferry.config.loader import validate
from ferry.config.section import Section
from ferry.kernels.registry import Implementation, Platform
from ferry.platform.hardware import profile_names

LEDGER_PATH = Path(__file__).with_name("ledger.yaml")


class StepMeasurement(Section):
    """A whole training step in the implementation's format against the same run in bf16, on one hardware profile."""

    profile: str = Field(description="the hardware profile (ferry/platform/profiles/) it was measured on")
    ratio: float = Field(gt=0, description="tokens/s in the implementation's format over tokens/s of `baseline`")
    baseline: str = Field(min_length=1, description="the bf16 step it is against, as a phrase: `the bf16 eager step`")
    shape: str = Field(min_length=1, description="the model shape measured, e.g. OLMoE-1B-7B")
    figures: str = Field(min_length=1, description="the tokens/s behind the ratio and the step's size")
    date: str = Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$", description="YYYY-MM or YYYY-MM-DD")
    source: str = Field(min_length=1, description="the command that measures it again")

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, name: str) -> str:
        if name not in profile_names():
            raise ValueError(f"unknown hardware profile {name!r}; profiles: {', '.join(profile_names())}")
        return name

    @property
    def slower(self) -> bool:
        return self.ratio < 1.0

    def describe(self) -> str:
        """`0.19x the bf16 eager step on h200 at the OLMoE-1B-7B shape (source, date)`."""
        where = f"on {self.profile} at the {self.shape} shape ({self.source}, {self.date})"
        return f"{self.ratio:.2f}x {self.baseline} {where}"


class LedgerEntry(Section):
    """One vendor implementation on one platform, as debt."""

    op: str
    implementation: str
    platform: Platform
    owner: str = Field(min_length=1)
    reason: str = Field(min_length=1, description="why the portable path is not enough here")
    measured_gain: str = Field(min_length=1, description="speed-up over portable, with where and how it was measured")
    measured: bool = Field(True, description="false while no measurement exists (measured_gain says what is needed)")
    approved: datetime.date | None = Field(description="approval date; none = registered but not for `auto`")
    expires: datetime.date = Field(description="review by this date; past it `auto` stops taking the implementation")
    step_vs_bf16: list[StepMeasurement] = Field(
        default_factory=list,
        description="low-precision implementations: whole training steps against bf16, per hardware profile",
    )

    @property
    def key(self) -> str:
        return f"{self.op} {self.implementation}@{self.platform}"

    def status(self, today: datetime.date) -> str:
        """`approved`, `expired` or `not approved`."""
        if today > self.expires:
            return "expired"
        return "approved" if self.approved is not None else "not approved"

    def debt_status(self, today: datetime.date, warning_days: int = 30) -> str:
        """For a debt report: `expired`, `expiring` (approved, due within `warning_days`), `approved`,
        `unmeasured` (registered, never measured) or `not approved` (measured, not worth it yet)."""
        status = self.status(today)
        if status == "approved" and (self.expires - today).days <= warning_days:
            return "expiring"
        if status == "not approved" and not self.measured:
            return "unmeasured"
        return status

    def step_on(self, profile: str) -> StepMeasurement | None:
        """The whole-step measurement against bf16 on hardware profile `profile`, if one was taken."""
        return next((step for step in self.step_vs_bf16 if step.profile == profile), None)

    def speed_summary(self) -> str | None:
        """Every whole-step measurement in a phrase, `whole step 0.19x bf16 on h200 (numerics only)`; None without
        one."""
        if not self.step_vs_bf16:
            return None
        return "whole step " + ", ".join(
            f"{step.ratio:.2f}x bf16 on {step.profile}" + (" (numerics only)" if step.slower else "")
            for step in self.step_vs_bf16
        )


class LedgerFile(Section):
    entries: list[LedgerEntry]


@dataclass(frozen=True)
class Ledger:
    entries: tuple[LedgerEntry, ...]

    def entry(self, impl: Implementation) -> LedgerEntry | None:
        for entry in self.entries:
            if (entry.op, entry.implementation, entry.platform) == (impl.op, impl.name, impl.platform):
                return entry
        return None

    def status(self, impl: Implementation, today: datetime.date) -> str:
        """The entry's status, or `missing` for a vendor implementation without one."""
        entry = self.entry(impl)
        return "missing" if entry is None else entry.status(today)

    def allows_auto(self, impl: Implementation, today: datetime.date) -> bool:
        return self.status(impl, today) == "approved"


def load_ledger(path: Path = LEDGER_PATH) -> Ledger:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    return Ledger(tuple(validate(LedgerFile, raw).entries))

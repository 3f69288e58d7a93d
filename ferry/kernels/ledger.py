"""The debt ledger: every vendor implementation is registered debt with an owner and an expiry.

A vendor kernel buys speed on one platform and costs a second code path that must
be kept in agreement with the portable one and rewritten when the platform goes.
The ledger (`ledger.yaml`, beside this file) records who owns that debt, why it was
taken on, what it measured, when it was approved and when it must be reviewed
again. `auto` selection only takes an implementation whose entry is approved and
not expired; an entry without an approval date registers an implementation for
measurement and explicit use only.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
import yaml
from pydantic import Field

from ferry.config.loader import validate
from ferry.config.section import Section
from ferry.kernels.registry import Implementation, Platform

LEDGER_PATH = Path(__file__).with_name("ledger.yaml")


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

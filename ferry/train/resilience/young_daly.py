"""The checkpoint interval that balances the cost of saving against the work a failure loses.

Saving every `tau` seconds costs `C / tau` of the run; a failure (every `M` seconds on average)
loses on average half an interval plus the restart. Young (1974) minimises the sum to first
order: `tau = sqrt(2 C M)`. Daly (2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps") corrects it for `C` not small against `M`:
`tau = sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C` for `C < 2M`, else `tau = M`.
`C` is what training waits for a save (not a background write), `M` the job's mean time
between failures: one device's divided by the number of devices.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return young_interval_s(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


@dataclass
class AutoInterval:
    """`checkpoint.interval: auto`: the first save at `first_step`, then every Daly interval, in steps,
    recomputed after every save from its measured blocking cost and the median step time so far."""

    job_mtbf_s: float
    first_step: int
    step_times_s: list[float] = field(default_factory=list)
    last_cost_s: float | None = None
    interval_s: float | None = None
    interval_steps: int | None = None

    def observe_step(self, step_s: float) -> None:
        self.step_times_s.append(step_s)

    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    def observe_save(self, cost_s: float, median_step_s: float | None) -> None:
        """A save just blocked training for `cost_s`: the next interval follows from it and the median step.

        In a multi-rank job both figures are first agreed on (the largest over the ranks), so every
        rank computes the same interval and they all save together.
        """
        self.last_cost_s = cost_s
        self.interval_s = daly_interval_s(max(cost_s, 1e-6), self.job_mtbf_s)
        self.interval_steps = max(1, round(self.interval_s / median_step_s)) if median_step_s else None

    def due(self, step: int, last_saved: int | None) -> bool:
        """Before a save of this process measured the cost: `first_step` steps after the run's start or its
        resumption; then every interval."""
        since = step - (last_saved or 0)
        if self.interval_steps is None:
            return since >= self.first_step
        return since >= self.interval_steps

"""The fuzzer's report: every combination's outcome as a JSON line, and a summary of them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ferry.portability.fuzz.runner import Outcome

VERDICTS = ("equal", "refused", "diverged", "crashed")


def append(path: Path, outcome: Outcome) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(outcome.as_record()) + "\n")


def summary(outcomes: list[Outcome], seconds: float, seed: int) -> str:
    """Counts by verdict over distinct combinations, every refusal's message once, and each failure's commands."""
    distinct = {outcome.combination.digest(): outcome for outcome in outcomes}
    counts = Counter(outcome.verdict for outcome in distinct.values())
    ran = counts["equal"] + counts["diverged"] + counts["crashed"]
    lines = [
        f"seed {seed}: {len(distinct)} distinct combinations in {seconds / 60:.1f} min: "
        + ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS)
        + f"; {counts['refused'] / max(len(distinct), 1):.0%} refused, {ran} ran",
    ]
    refusals = Counter(outcome.detail for outcome in distinct.values() if outcome.verdict == "refused")
    if refusals:
        lines.append("refusals:")
        lines += [f"  {count} x {message}" for message, count in refusals.most_common()]
    for outcome in distinct.values():
        if outcome.verdict in ("diverged", "crashed"):
            lines.append(f"{outcome.verdict}: {outcome.combination.describe()} ({outcome.combination.digest()})")
            lines.append(f"  {outcome.detail}")
            lines += [f"  $ {command}" for command in outcome.commands]
    return "\n".join(lines)

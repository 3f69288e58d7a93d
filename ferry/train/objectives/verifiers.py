"""Verifiers: functions that score a completion's text against a prompt's ground-truth answer.

A reward is 1.0 for an accepted answer and 0.0 otherwise. `exact` compares the text with
the answer after trimming and collapsing whitespace; `numeric` reads the last number in the
completion (signs, decimals and thousands separators allowed) and compares it with the
answer's value. More can be registered by name with `register_verifier`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

Verifier = Callable[[str, str], float]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(completion: str, answer: str) -> float:
    return float(" ".join(completion.split()) == " ".join(answer.split()))


def numeric_match(completion: str, answer: str) -> float:
    found = last_number(completion)
    expected = last_number(answer)
    if found is None or expected is None:
        return 0.0
    return float(math.isclose(found, expected, rel_tol=1e-9, abs_tol=1e-9))


def last_number(text: str) -> float | None:
    """The value of the last number written in `text`, or None when it holds none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


VERIFIERS: dict[str, Verifier] = {"exact": exact_match, "numeric": numeric_match}


def register_verifier(name: str, verifier: Verifier) -> None:
    """Make `verifier` available to `grpo.verifier: NAME` (before the config is loaded)."""
    VERIFIERS[name] = verifier

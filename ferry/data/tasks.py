"""The embedded task with a verifiable answer: the largest digit of a short list, which a tiny MoE learns on
a CPU in minutes.

One problem set, three views of it, so the SFT warm-start, the DPO pairs and the RL prompts
all speak about the same problems:

- `chat`: a user asks `max(3,7,2,9,4)=` and the assistant answers `9` (the SFT warm-start);
- `preferences`: the right answer is chosen over a near miss (the second-largest digit, or the
  largest one's neighbour when every digit is the same);
- `prompts`: the question with its answer, for a verifier to check sampled completions.

Problems are lists of `DIGITS` digits whose largest digit is uniform over 0-9 (drawn by a
fixed-seed generator); a hash of the list puts a fifth of all lists in the held-out split, which
no view of `largest` holds, so a held-out solve rate measures the skill rather than recall. Each
split yields its first `PROBLEMS` distinct lists. In the demo tokenizer each digit, comma and
bracket of `max(3,7,2,9,4)=` is one token, as is the answer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from itertools import islice
from typing import Literal

import numpy as np

from ferry.config.errors import UserError
from ferry.data.corpus import Document

EMBEDDED_TASKS = ("largest", "largest-held-out")
TaskView = Literal["chat", "preferences", "prompts"]
DIGITS = 5
PROBLEMS = {"largest": 4000, "largest-held-out": 400}
_HELD_OUT_IN_100 = 20
_CANDIDATES = 40_000  # lists drawn to fill the splits
_TASK_SEED = 20261202


def task_documents(name: str, view: TaskView) -> Iterator[Document]:
    """The problems of the named task split as documents of one view (each text is the record's JSON)."""
    if name not in EMBEDDED_TASKS:
        raise UserError(f"unknown embedded task {name!r}; available: {', '.join(EMBEDDED_TASKS)}")
    for digits in islice(_problems(held_out=name.endswith("-held-out")), PROBLEMS[name]):
        written = ",".join(str(digit) for digit in digits)
        question = [{"role": "user", "content": f"max({written})="}]
        answer = str(max(digits))
        if view == "chat":
            record: object = question + [{"role": "assistant", "content": answer}]
        elif view == "preferences":
            record = {"prompt": question, "chosen": answer, "rejected": str(_near_miss(digits))}
        else:
            record = {"prompt": question, "answer": answer}
        yield Document(f"embedded:{name}/{written}", json.dumps(record))


def _problems(held_out: bool) -> Iterator[tuple[int, ...]]:
    """Distinct digit lists of the split from a fixed-seed generator (PCG64: the same lists on every platform).
    The largest digit is drawn first, uniformly, so no answer is more common than another: a model cannot
    score by always naming a high digit."""
    generator = np.random.default_rng(_TASK_SEED)
    seen: set[tuple[int, ...]] = set()
    for _ in range(_CANDIDATES):
        largest = int(generator.integers(10))
        digits = generator.integers(0, largest + 1, size=DIGITS)
        digits[generator.integers(DIGITS)] = largest
        problem = tuple(int(digit) for digit in digits)
        if problem in seen or _is_held_out(problem) != held_out:
            continue
        seen.add(problem)
        yield problem


def _is_held_out(digits: tuple[int, ...]) -> bool:
    digest = hashlib.sha256(",".join(map(str, digits)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < _HELD_OUT_IN_100


def _near_miss(digits: tuple[int, ...]) -> int:
    """What a model that almost has the skill answers: the runner-up digit."""
    largest = max(digits)
    smaller = [digit for digit in digits if digit < largest]
    return max(smaller) if smaller else (largest - 1 if largest > 0 else 1)

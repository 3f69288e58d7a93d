"""The points of a run at which hooks act, and the hooks called as one.

Points that open (`before_training`, `before_step`) run the hooks in order; points that close (`after_backward`,
`after_step`, `after_training`, `on_error`, `at_close`) run them in reverse, so each hook wraps the ones after it,
as nested context managers do: the profiler's step starts first and finishes last, the resilience hook's heartbeat
comes before the evaluation, the checkpoint and the records of that step. `at_close` runs however the run ends
(`end` is None when it failed or was stopped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RunEnd:
    """How a run that did not fail ended: the step it reached, where it was to stop, its last record, and
    whether it trained any step in this attempt."""

    step: int
    stop_at: int
    last: dict
    trained: bool


class Watch(Protocol):
    """What the hang watchdog offers the hooks whose work is long (a save, an evaluation): the phase it reports
    a hang in, and the restart of its clock while the work progresses."""

    def phase(self, name: str) -> None: ...

    def touch(self) -> None: ...


class Hook:
    """A part of a run acting around its steps; each point does nothing unless a hook overrides it."""

    def before_training(self) -> None:
        return None

    def before_step(self, step: int) -> None:
        return None

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        return None

    def after_step(self, step: int, record: dict) -> None:
        return None

    def after_training(self, step: int) -> None:
        return None

    def on_error(self, exc: BaseException, last: dict) -> None:
        return None

    def at_close(self, end: RunEnd | None) -> None:
        return None


class Hooks(Hook):
    """The run's hooks called as one."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks

    def before_training(self) -> None:
        for hook in self.hooks:
            hook.before_training()

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        for hook in reversed(self.hooks):
            hook.after_backward(step, model)

    def after_step(self, step: int, record: dict) -> None:
        for hook in reversed(self.hooks):
            hook.after_step(step, record)

    def after_training(self, step: int) -> None:
        for hook in reversed(self.hooks):
            hook.after_training(step)

    def on_error(self, exc: BaseException, last: dict) -> None:
        for hook in reversed(self.hooks):
            hook.on_error(exc, last)

    def at_close(self, end: RunEnd | None) -> None:
        for hook in reversed(self.hooks):
            hook.at_close(end)

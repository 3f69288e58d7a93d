"""The console view of a run: a rich progress bar with ETA on a terminal, plain lines elsewhere."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ferry.metrics.progress import line_every_s


class ConsoleProgress:
    """Shows step, loss and throughput; on a non-terminal prints one line every `every` steps, and one at least
    every `every_s` seconds: slow steps (an RL run's rollouts, a loaded machine) must not leave a log silent for
    minutes."""

    def __init__(
        self,
        total_steps: int,
        every: int,
        first_step: int = 0,
        console: Console | None = None,
        every_s: float | None = None,
    ):
        self.console = console or Console(highlight=False)
        self.every = every
        self.every_s = line_every_s() if every_s is None else every_s
        self.total_steps = total_steps
        self._last_line = time.perf_counter()
        self._progress = None
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=first_step, summary="")
            self._progress.start()

    def update(self, record: dict) -> None:
        summary = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s"
        if record.get("trained_share", 1.0) < 1.0:  # a loss mask (SFT): how much of the step is trained, how well
            summary += f"  trained {100 * record['trained_share']:.0f}%  acc {100 * record['token_accuracy']:.1f}%"
        if "mtp.loss" in record:  # multi-token prediction: each module's loss, depth by depth
            summary += "  mtp " + "/".join(f"{loss:.3f}" for loss in record["mtp.loss"].values())
        if "rewards/accuracy" in record:  # DPO: how often the chosen answer wins, by how much
            summary += f"  reward acc {100 * record['rewards/accuracy']:.0f}%  margin {record['rewards/margin']:.3f}"
        if "reward" in record:  # GRPO: what the rollouts earned
            summary += f"  reward {record['reward']:.2f}  solved {100 * record['solve_rate']:.0f}%"
        if record.get("mfu") is not None:
            summary += f"  mfu {100 * record['mfu']:.1f}%"
        if "pp.bubble" in record:  # pipeline parallelism: the share of the schedule spent waiting
            summary += f"  bubble {100 * record['pp.bubble']:.0f}%"
        if record.get("compile_s"):  # the step's time and throughput include it
            summary += f"  (compiling {record['compile_s']:.1f} s of it)"
        step = record["step"]
        if self._progress is not None:
            self._progress.update(self._task, completed=step, summary=summary)
            return
        now = time.perf_counter()
        if step % self.every == 0 or step == self.total_steps or step == 1 or now - self._last_line >= self.every_s:
            self._last_line = now
            self.console.print(f"step {step:>6}/{self.total_steps}  {summary}", soft_wrap=True)

    def message(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

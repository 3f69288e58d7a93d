"""Running a drawn combination as a user would (`ferry train`, `--nproc` ranks, in a process of its own), and
judging it against its one-process oracle.

Each combination is first validated in this process as `ferry train` validates it (the run config, then the
layout over its ranks): a refusal names its setting and costs no process; a check that needs the ranks (the batch
over the world) refuses with exit 2 and a message, and counts as a refusal too. Otherwise it trains `STEPS` steps,
saving a checkpoint at `RESUME_AT`; its step losses must equal the oracle's within `TOLERANCE` (fp32: sums in
another order over the ranks, experts regrouped). Then the checkpoint is resumed in another drawn layout of the
same computation for the remaining steps, which must equal the oracle's too. A process that exits otherwise than
0 is a crash, with its last error lines; one that runs past `TIMEOUT_S` (a hang) is killed and a crash too. The
oracle's runs are cached by the computation's digest.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ferry.portability.fuzz.space import LAYOUT, Combination

STEPS = 6
RESUME_AT = 3
TOLERANCE = 1e-5  # relative, per step: the suite's layout tolerance where reductions or experts are regrouped
TIMEOUT_S = 300
REFUSED = 2  # `ferry train`'s exit code for a setting it refuses, with a message naming it

BASE_RUN = {  # the suite's tiny model and batch (tests/conftest.py), checkpoints kept for the resume leg
    "run": {"name": "fuzz", "seed": 0, "device": "cpu"},
    "model": {
        "vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
        "dense_layers": 1, "dense_ffn_dim": 64, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32},
    },
    "data": {"seq_len": 32},
    "train": {"steps": STEPS, "global_batch": 32, "micro_batch": 4, "log_every": 1},  # 32: 4 ranks of 8
    "optim": {"lr": 3e-3, "warmup_steps": 2},
    "checkpoint": {"interval": RESUME_AT, "keep": 4},
}


@dataclass
class Outcome:
    """What became of one combination: `equal`, `refused`, `diverged` or `crashed`, with the why and the commands
    that reproduce it."""

    combination: Combination
    verdict: str
    detail: str = ""
    commands: list[str] = field(default_factory=list)
    resumed_in: Combination | None = None
    worst: float = 0.0

    def as_record(self) -> dict:
        return {
            "digest": self.combination.digest(), "combination": self.combination.describe(), "verdict": self.verdict,
            "detail": self.detail, "worst_relative": self.worst, "commands": self.commands,
            **({"resumed_in": self.resumed_in.describe()} if self.resumed_in is not None else {}),
        }


class Fuzzer:
    """Runs combinations under `work` (its base config, its dataset, one directory a run), python `python`."""

    def __init__(self, work: Path, dataset: Path, python: str = sys.executable, env: dict | None = None):
        self.work = work
        self.dataset = dataset
        self.python = python
        self.env = env
        work.mkdir(parents=True, exist_ok=True)
        self.config = work / "base.yaml"
        base = json.loads(json.dumps(BASE_RUN))
        base["data"]["sources"] = [{"name": "stdlib", "path": str(dataset)}]
        self.config.write_text(yaml.safe_dump(base, sort_keys=False))
        self._oracles: dict[str, list[float] | Outcome] = {}

    def refusal(self, combination: Combination) -> str | None:
        """Why `ferry train` would refuse the combination before any rank starts (None: it would not)."""
        from ferry.config import ConfigError, UserError
        from ferry.parallel.layout import lay_out_job
        from ferry.train import load_run_config

        try:
            config = load_run_config(self.config, combination.overrides())
            lay_out_job(config.parallel, config.model, combination.world, combination.world > 1)
        except (ConfigError, UserError) as exc:
            return str(exc)
        return None

    def judge(self, combination: Combination, resume_layout: Combination) -> Outcome:
        """Refused, or trained and compared with the oracle, then resumed in `resume_layout`'s layout."""
        refused = self.refusal(combination)
        if refused is not None:
            return Outcome(combination, "refused", refused)
        oracle = self._oracle(combination.computation())
        if isinstance(oracle, Outcome):
            return Outcome(combination, "crashed", f"its one-process oracle failed: {oracle.detail}", oracle.commands)
        run_dir = self.work / "runs" / combination.digest()
        command = self._command(combination, run_dir)
        losses = self._losses(command, run_dir)
        if isinstance(losses, str):
            refused = losses.startswith(f"exit {REFUSED}: ")  # checks that need the ranks' world: still a refusal
            verdict, detail = ("refused", losses.removeprefix(f"exit {REFUSED}: ")) if refused else ("crashed", losses)
            return Outcome(combination, verdict, detail, [shlex.join(command)])
        worst, parted = _compared(losses, oracle)
        if parted:
            return Outcome(combination, "diverged", parted, [shlex.join(command)], worst=worst)
        resumed = self._resumed_layout(combination, resume_layout)
        if self.refusal(resumed) is not None:  # a layout this computation cannot take: the resume stays as it was
            resumed = combination
        checkpoint = run_dir / "checkpoints" / f"step-{RESUME_AT:08d}"
        resume_command, continued = self._resume(resumed, combination, checkpoint)
        if isinstance(continued, str) and continued.startswith(f"exit {REFUSED}: ") and resumed != combination:
            resumed = combination  # refused by a check that needs the ranks: resumed in its own layout instead
            resume_command, continued = self._resume(resumed, combination, checkpoint)
        commands = [shlex.join(command), shlex.join(resume_command)]
        if isinstance(continued, str):
            return Outcome(combination, "crashed", f"resumed: {continued}", commands, resumed)
        resumed_worst, parted = _compared(continued, oracle[RESUME_AT:], first=RESUME_AT + 1)
        if parted:
            return Outcome(combination, "diverged", f"resumed in another layout, {parted}", commands, resumed,
                           resumed_worst)
        return Outcome(combination, "equal", "", commands, resumed, max(worst, resumed_worst))

    def _resume(
        self, resumed: Combination, combination: Combination, checkpoint: Path
    ) -> tuple[list[str], list[float] | str]:
        """`combination`'s checkpoint resumed in `resumed`'s layout: the command and its losses (or why not)."""
        resume_dir = self.work / "runs" / f"{combination.digest()}-resumed-{resumed.digest()}"
        command = self._command(resumed, resume_dir, f"resume={checkpoint}")
        return command, self._losses(command, resume_dir)

    def _oracle(self, computation: Combination) -> list[float] | Outcome:
        key = computation.digest()
        if key not in self._oracles:
            run_dir = self.work / "oracles" / key
            command = self._command(computation, run_dir)
            losses = self._losses(command, run_dir)
            self._oracles[key] = Outcome(computation, "crashed", losses, [shlex.join(command)]) if isinstance(
                losses, str) else losses
        return self._oracles[key]

    def _command(self, combination: Combination, run_dir: Path, *extra: str) -> list[str]:
        ranks = ["--nproc", str(combination.world)] if combination.world > 1 else []
        return [self.python, "-m", "ferry", "train", str(self.config), *ranks, *combination.overrides(),
                f"run.dir={run_dir}", "run.overwrite=true", *extra]

    def _losses(self, command: list[str], run_dir: Path) -> list[float] | str:
        """The run's step losses from its records, or why it failed (its last error lines)."""
        try:
            finished = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=self.env)
        except subprocess.TimeoutExpired:
            return f"ran past {TIMEOUT_S} s (killed)"
        if finished.returncode != 0:
            lines = [line for line in finished.stderr.strip().splitlines() if line.strip()] or ["no output"]
            if finished.returncode == REFUSED:
                return f"exit {REFUSED}: " + next((line for line in lines if "ferry: error:" in line), lines[-1])
            causes = [line for line in lines if "Error" in line or "error:" in line]
            return f"exit {finished.returncode}: " + " | ".join(dict.fromkeys([*causes[-2:], lines[-1]]))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [record["loss"] for record in records]

    @staticmethod
    def _resumed_layout(combination: Combination, other: Combination) -> Combination:
        """`combination`'s computation in `other`'s layout."""
        mine, theirs = dict(combination.values), dict(other.values)
        return Combination(tuple((axis, theirs[axis] if axis in LAYOUT else mine[axis]) for axis in mine))


def _compared(losses: list[float], oracle: list[float], first: int = 1) -> tuple[float, str]:
    """The largest relative difference of two loss series, and where they first part by more than the tolerance
    ("" where they do not), steps counted from `first`; series of other lengths part at once."""
    if len(losses) != len(oracle):
        return float("inf"), f"{len(losses)} steps against the oracle's {len(oracle)}"
    differences = [abs(ours - theirs) / abs(theirs) for ours, theirs in zip(losses, oracle)]
    worst = max(differences)
    parting = next((index for index, difference in enumerate(differences) if difference > TOLERANCE), None)
    if parting is None:
        return worst, ""
    return worst, (f"step {first + parting}: relative difference {differences[parting]:.2e} "
                   f"(the largest {worst:.2e}, at step {first + differences.index(worst)})")

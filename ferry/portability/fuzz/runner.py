"""Running a drawn combination as a user would (`ferry train`, `--nproc` ranks, in a process of its own), and
judging it against its one-process oracle.

Each combination is first validated in this process as `ferry train` validates it (the run config, then the
layout over its ranks): a refusal names its setting and costs no process; a check that needs the ranks (the batch
over the world) refuses with exit 2 and a message, and counts as a refusal too. Otherwise it trains `STEPS` steps,
saving a checkpoint at `RESUME_AT`, and is judged against the oracle by `ferry compare`'s judgement under the
combination's tolerance profile (`Combination.profile`: per step within `layout`'s 1e-5 for fp32, sums in another
order over the ranks and experts regrouped; `layout-bf16`'s bound for bf16; GRPO's reward within `sampled`'s band of
the spread between the oracle and two runs of it with other seeds). Then the checkpoint is resumed in another
drawn layout of the same computation for the remaining steps, judged alike. A process that exits otherwise than
0 is a crash, with its last error lines; one that runs past `TIMEOUT_S` (a hang) is killed and a crash too. The
oracle's runs, and the SFT parents DPO and GRPO start from (one a model shape), are cached by digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ferry.portability.fuzz.data import VOCAB_SIZE, FuzzData
from ferry.portability.fuzz.space import LAYOUT, Combination

STEPS = 6
RESUME_AT = 3
TIMEOUT_S = 300
REFUSED = 2  # `ferry train`'s exit code for a setting it refuses, with a message naming it
SEED_RUNS = (1, 2)  # the oracle's other seeds, for a profile judged against the spread between seeds
# the parent of DPO and GRPO: SFT on the task's chat view until some answers come out right, so rollouts score
PARENT = (
    "data.sources=[{name: chat, path: CHAT}]",
    "data.seq_len=64",
    "train.steps=30",
    "train.global_batch=8",
    "optim.lr=1e-2",
    "checkpoint.interval=30",
)

# The suite's tiny model and batch (tests/conftest.py), 8 experts (split over up to 8 ranks), checkpoints kept.
BASE_RUN = {
    "run": {"name": "fuzz", "seed": 0, "device": "cpu"},
    "model": {
        "vocab_size": VOCAB_SIZE,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 64,
        "dense_layers": 1,
        "dense_ffn_dim": 64,
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 32},
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
            "digest": self.combination.digest(),
            "combination": self.combination.describe(),
            "verdict": self.verdict,
            "detail": self.detail,
            "worst_relative": self.worst,
            "commands": self.commands,
            **({"resumed_in": self.resumed_in.describe()} if self.resumed_in is not None else {}),
        }


class Fuzzer:
    """Runs combinations under `work` (its base config, one directory a run) on `data`, python `python`."""

    def __init__(self, work: Path, data: FuzzData, python: str = sys.executable, env: dict | None = None):
        self.work = work
        self.data = data
        self.python = python
        self.env = env
        work.mkdir(parents=True, exist_ok=True)
        self.config = work / "base.yaml"
        self.config.write_text(yaml.safe_dump(BASE_RUN, sort_keys=False))
        self._oracles: dict[str, Path | Outcome] = {}
        self._parents: dict[str, Path | Outcome] = {}

    def refusal(self, combination: Combination) -> str | None:
        """Why `ferry train` would refuse the combination before any rank starts (None: it would not)."""
        from ferry.config import ConfigError, UserError
        from ferry.parallel.layout import lay_out_job
        from ferry.train import load_run_config

        try:
            config = load_run_config(self.config, self._overrides(combination))
            lay_out_job(config.parallel, config.model, combination.world, combination.world > 1)
        except (ConfigError, UserError) as exc:
            return str(exc)
        return None

    def judge(self, combination: Combination, resume_layout: Combination) -> Outcome:
        """Refused, or trained and compared with the oracle, then resumed in `resume_layout`'s layout."""
        refused = self.refusal(combination)
        if refused is not None:
            return Outcome(combination, "refused", refused)
        parent = self._parent(combination)
        if isinstance(parent, Outcome):
            return Outcome(combination, "crashed", f"its SFT parent failed: {parent.detail}", parent.commands)
        oracle = self._oracle(combination.computation())
        if isinstance(oracle, Outcome):
            return Outcome(combination, "crashed", f"its one-process oracle failed: {oracle.detail}", oracle.commands)
        run_dir = self.work / "runs" / combination.digest()
        command = self._command(combination, run_dir)
        failed = self._failure(command)
        if failed is not None:
            refused = failed.startswith(f"exit {REFUSED}: ")  # checks that need the ranks' world: still a refusal
            verdict, detail = ("refused", failed.removeprefix(f"exit {REFUSED}: ")) if refused else ("crashed", failed)
            return Outcome(combination, verdict, detail, [shlex.join(command)])
        worst, parted = self._judged(combination, oracle, run_dir)
        if parted:
            return Outcome(combination, "diverged", parted, [shlex.join(command)], worst=worst)
        resumed = self._resumed_layout(combination, resume_layout)
        if self.refusal(resumed) is not None:  # a layout this computation cannot take: the resume stays as it was
            resumed = combination
        checkpoint = run_dir / "checkpoints" / f"step-{RESUME_AT:08d}"
        resume_command, resume_dir, failed = self._resume(resumed, combination, checkpoint)
        if failed is not None and failed.startswith(f"exit {REFUSED}: ") and resumed != combination:
            resumed = combination  # refused by a check that needs the ranks: resumed in its own layout instead
            resume_command, resume_dir, failed = self._resume(resumed, combination, checkpoint)
        commands = [shlex.join(command), shlex.join(resume_command)]
        if failed is not None:
            return Outcome(combination, "crashed", f"resumed: {failed}", commands, resumed)
        resumed_worst, parted = self._judged(combination, oracle, resume_dir)
        if parted:
            return Outcome(
                combination, "diverged", f"resumed in another layout, {parted}", commands, resumed, resumed_worst
            )
        return Outcome(combination, "equal", "", commands, resumed, max(worst, resumed_worst))

    def _judged(self, combination: Combination, oracle: Path, run_dir: Path) -> tuple[float, str]:
        """The largest relative difference from the oracle over the steps both recorded, and where the run first
        leaves its profile's bound ("" where it does not); the verdict's JSON and plot are left in the run."""
        from ferry.portability.comparison.compare import NoSpread, compare_runs

        profile = combination.profile()
        seed_runs = [self._seed_run(oracle, seed) for seed in SEED_RUNS] if profile == "sampled" else []
        try:
            verdict = compare_runs(oracle, run_dir, profile, STEPS, output_dir=run_dir / "judged", seed_runs=seed_runs)
        except NoSpread:
            # the oracle's seeds drew the same rewards: no band to judge in, and the run must draw them too
            profile = "bitwise"
            verdict = compare_runs(oracle, run_dir, profile, STEPS, "reward", output_dir=run_dir / "judged")
        worst = verdict.max_rel_diff if verdict.max_rel_diff is not None else float("inf")
        if verdict.passed:
            return worst, ""
        return worst, (
            f"step {verdict.first_failing_step}: outside the {profile} bound, relative difference "
            f"{worst:.2e} at most (step {verdict.worst_step}, {verdict.metric})"
        )

    def _resume(
        self, resumed: Combination, combination: Combination, checkpoint: Path
    ) -> tuple[list[str], Path, str | None]:
        """`combination`'s checkpoint resumed in `resumed`'s layout: the command, its run and why it failed."""
        resume_dir = self.work / "runs" / f"{combination.digest()}-resumed-{resumed.digest()}"
        command = self._command(resumed, resume_dir, f"resume={checkpoint}")
        return command, resume_dir, self._failure(command)

    def _oracle(self, computation: Combination) -> Path | Outcome:
        """The computation's run on one process (and, for a profile judged against seeds, its seed runs)."""
        key = computation.digest()
        if key not in self._oracles:
            run_dir = self.work / "oracles" / key
            runs = [(run_dir, ())]
            if computation.profile() == "sampled":
                runs += [(self._seed_run(run_dir, seed), (f"run.seed={seed}",)) for seed in SEED_RUNS]
            self._oracles[key] = run_dir
            for directory, extra in runs:
                command = self._command(computation, directory, *extra)
                failed = self._failure(command)
                if failed is not None:
                    self._oracles[key] = Outcome(computation, "crashed", failed, [shlex.join(command)])
                    break
        return self._oracles[key]

    @staticmethod
    def _seed_run(oracle: Path, seed: int) -> Path:
        return oracle.parent / f"{oracle.name}-seed-{seed}"

    def _parent(self, combination: Combination) -> Path | Outcome | None:
        """The SFT checkpoint of the combination's model that its objective starts from (None: it starts from
        scratch), trained on one process once a model shape."""
        if not any("PARENT" in override for override in combination.overrides()):
            return None
        run_dir = self._parent_dir(combination)
        key = run_dir.name
        if key not in self._parents:
            command = [
                self.python,
                "-m",
                "ferry",
                "train",
                str(self.config),
                *_model_shape(combination),
                *(self.data.substitute(override) for override in PARENT),
                f"run.dir={run_dir}",
                "run.overwrite=true",
            ]
            failed = self._failure(command)
            self._parents[key] = (
                run_dir if failed is None else Outcome(combination, "crashed", failed, [shlex.join(command)])
            )
        return self._parents[key]

    def _parent_dir(self, combination: Combination) -> Path:
        """Where the parent of the combination's model shape trains (named by the shape's digest)."""
        return self.work / "parents" / hashlib.sha256(json.dumps(_model_shape(combination)).encode()).hexdigest()[:12]

    def _overrides(self, combination: Combination) -> list[str]:
        """The combination's overrides with its datasets' and parent's paths in place of their placeholders."""
        parent = self._parent_dir(combination) / "checkpoints"
        return [self.data.substitute(override).replace("PARENT", str(parent)) for override in combination.overrides()]

    def _command(self, combination: Combination, run_dir: Path, *extra: str) -> list[str]:
        ranks = ["--nproc", str(combination.world)] if combination.world > 1 else []
        return [
            self.python,
            "-m",
            "ferry",
            "train",
            str(self.config),
            *ranks,
            *self._overrides(combination),
            f"run.dir={run_dir}",
            "run.overwrite=true",
            *extra,
        ]

    def _failure(self, command: list[str]) -> str | None:
        """Why the run failed (its last error lines), or None where it trained."""
        try:
            finished = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=self.env)
        except subprocess.TimeoutExpired:
            return f"ran past {TIMEOUT_S} s (killed)"
        if finished.returncode == 0:
            return None
        lines = [line for line in finished.stderr.strip().splitlines() if line.strip()] or ["no output"]
        if finished.returncode == REFUSED:
            named = (line for line in lines if re.match(r"ferry: (rank \d+: )?error:", line))  # a rank's: each says it
            return f"exit {REFUSED}: " + next(named, lines[-1])
        causes = [line for line in lines if "Error" in line or "error:" in line]
        return f"exit {finished.returncode}: " + " | ".join(dict.fromkeys([*causes[-2:], lines[-1]]))

    @staticmethod
    def _resumed_layout(combination: Combination, other: Combination) -> Combination:
        """`combination`'s computation in `other`'s layout."""
        mine, theirs = dict(combination.values), dict(other.values)
        return Combination(tuple((axis, theirs[axis] if axis in LAYOUT else mine[axis]) for axis in mine))


def _model_shape(combination: Combination) -> list[str]:
    """The overrides that shape the combination's model: what a checkpoint it starts from must have."""
    return [override for override in combination.overrides() if override.startswith("model.")]

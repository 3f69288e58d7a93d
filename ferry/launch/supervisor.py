"""`ferry train CONFIG --max-restarts K`: run the job, and after a failure restart every rank from the
newest checkpoint that verifies, until the restart budget is spent.

A restart that trains no step the job had not already trained (the same crash at the same place)
counts against a second, small budget (`fault.max_no_progress_restarts`), so a deterministic bug
stops the job with a clear message instead of looping K times. Every failure is recorded in the
run directory (`restarts.jsonl`: when, what the failing ranks said or how they ended, how far the
job had got); the trainer pairs it with the resumption that follows and reports both, with the
job's goodput, in `run.json`. When the supervisor gives up, no attempt follows to do that: the
supervisor settles `run.json` itself (every restart, goodput, status failed, why it gave up).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ferry.checkpoint import list_checkpoints
from ferry.launch.local import run_ranks
from ferry.train.resilience.restarts import (
    append_event,
    collect_causes,
    describe_causes,
    last_metrics_step,
    settle_run_record,
)


def supervise(
    nproc: int, argv: list[str], run_dir: Path, checkpoints: Path, max_restarts: int, max_no_progress: int
) -> int:
    """Run `ferry *argv` on `nproc` ranks under supervision; 0 when the job finished, 2 on bad input, 1 otherwise.

    A restart resumes the run's newest valid checkpoint (in `checkpoints`); before the run has saved
    one, a job started from `resume=PATH` starts from PATH again, and any other job from step 0.
    """
    best_step = last_metrics_step(run_dir) if _resumes(argv) else 0
    restarts = no_progress = 0
    attempt_argv = list(argv)
    collect_causes(run_dir)  # what an earlier, unsupervised failure left is not this job's
    while True:
        outcome = run_ranks(nproc, attempt_argv)
        if outcome.ok:
            return 0
        if outcome.bad_input:
            return 2
        detected = time.time()
        causes = collect_causes(run_dir)
        reached = last_metrics_step(run_dir)
        event = {
            "event": "failure",
            "by": "ferry supervisor",
            # the ranks' own reports are to the millisecond; the launcher's failure time only to the second
            "at_unix": min(cause["at_unix"] for cause in causes) if causes else outcome.failed_at_unix or detected,
            "detected_unix": detected,
            "failed_at_step": reached,
            "causes": causes,
            "exit_codes": {str(rank): code for rank, code in outcome.exit_codes.items()},
        }
        append_event(run_dir, event)
        cause = describe_causes(event)
        no_progress = no_progress + 1 if reached <= best_step and restarts > 0 else 0
        best_step = max(best_step, reached)
        reason = None
        if no_progress > max_no_progress:
            reason = (
                f"{no_progress} attempt(s) in a row trained no step beyond step {best_step} "
                f"(fault.max_no_progress_restarts is {max_no_progress}); the failure repeats: {cause}"
            )
        elif restarts >= max_restarts:
            reason = f"the restart budget (--max-restarts {max_restarts}) is spent; last failure: {cause}"
        if reason is not None:
            _say(f"ferry: giving up: {reason}")
            _settle(run_dir, reason, detected)
            return 1
        restarts += 1
        _say(
            f"ferry: restart {restarts} of {max_restarts} after a failure at step {reached + 1} ({cause}); "
            "resuming every rank from the newest checkpoint that verifies"
        )
        attempt_argv = [*argv, "resume=latest"] if list_checkpoints(checkpoints) or not _resumes(argv) else list(argv)


def _settle(run_dir: Path, reason: str, detected: float) -> None:
    """`run.json` with the failure that ends the job; a record that cannot be written is no reason to hide
    the job's own exit status."""
    try:
        settle_run_record(run_dir, reason, now=detected)
    except OSError as exc:
        _say(f"ferry: warning: could not complete {run_dir / 'run.json'}: {exc}")


def _resumes(argv: list[str]) -> bool:
    return any(item.startswith("resume=") and item != "resume=null" for item in argv)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)

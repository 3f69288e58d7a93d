"""What composes, answered in one place: every layout kind, every optimizer kind and the run's objective are asked
about the rest of the config, and everything that cannot run together is refused with its reason and fix, before
any rank starts.

Two moments, by what is known: `config_refusals` as the config validates (a run config that does not compose never
loads), `job_refusals` once the job's size is known and laid out (`RunConfig.check_world_size`: `ferry train
--nproc`, a launcher, a fuzzer's draw, a planner's candidate), which asks the active kinds what they cannot do over
it. Every refusal is returned, not only the first."""

from __future__ import annotations

from typing import Any

from ferry.config.refusals import Refusal
from ferry.parallel.layout import JobLayout
from ferry.parallel.optimizers import OPTIMIZER_KINDS
from ferry.train.layouts.run_layout import LAYOUT_KINDS, RunLayout
from ferry.train.objectives.kinds import objective_kind


def config_refusals(config: Any) -> list[Refusal]:
    """Every refusal of `config` (`ferry.train.config.RunConfig`, its sections each valid) that its size does not
    decide: each layout kind's and optimizer kind's (whether or not the run uses it: a setting of its own on a run
    that does not is refused too), the objective's, and the run's own rules between its sections."""
    refusals = [refusal for kind in LAYOUT_KINDS for refusal in kind.refusals(config)]
    refusals += [refusal for kind in OPTIMIZER_KINDS.values() for refusal in kind.refusals(config)]
    refusals += objective_kind(config).refusals(config)
    return refusals + _run_refusals(config)


def job_refusals(config: Any, layout: JobLayout) -> list[str]:
    """What the active layout kinds cannot do over `layout`, and the batches that do not split over its data
    ranks."""
    return RunLayout.of(config).job_refusals(config, layout) + _batch_refusals(config, layout)


def _batch_refusals(config: Any, layout: JobLayout) -> list[str]:
    train = config.train
    data_ranks = layout.data_ranks  # the ranks a step's rows are split over: one per pipeline and cp group
    micro_batch = 1 if train.micro_batch == "auto" else train.micro_batch  # auto takes a divisor that fits
    per_pass = micro_batch * data_ranks
    batches = {"train.global_batch": train.global_batch}
    if config.eval.sources and config.eval.batch_size is not None:
        batches["eval.batch_size"] = config.eval.batch_size
    for key, batch in batches.items():
        if batch % per_pass:
            return [
                f"{key} ({batch}) must be a multiple of train.micro_batch x world size "
                f"({train.micro_batch} x {data_ranks} = {per_pass}); "
                f"{_batch_fixes(key, batch, batches, micro_batch, data_ranks)}"
            ]
    return []


def _batch_fixes(key: str, batch: int, batches: dict[str, int], micro_batch: int, world_size: int) -> str:
    """The overrides that fit `batch` over `world_size` ranks. A smaller micro-batch comes first when one splits
    every batch the run has: it keeps each step's sequences, so the run's data order; the next multiple of
    `key` always fits, at the cost of more sequences a step."""
    larger = -(-batch // (micro_batch * world_size)) * micro_batch * world_size
    smaller_micro = [
        micro
        for micro in range(micro_batch - 1, 0, -1)
        if all(each % (micro * world_size) == 0 for each in batches.values())
    ]
    if smaller_micro:
        return (
            f"set train.micro_batch={smaller_micro[0]} (the same {batch} sequences in smaller passes) or {key}={larger}"
        )
    return f"set {key}={larger} (no train.micro_batch splits {batch} over {world_size} ranks)"


def _run_refusals(config: Any) -> list[Refusal]:
    """The run's own rules between its sections: batches that split into micro-batches, windows the model can
    take, faults that fire within the run."""
    train, refused = config.train, []
    micro_batch = train.micro_batch
    if micro_batch != "auto" and train.global_batch % micro_batch:
        refused.append(Refusal("train.micro_batch", f"micro_batch must divide global_batch ({train.global_batch})"))
    batch_size = config.eval.batch_size
    if micro_batch != "auto" and batch_size is not None and batch_size % micro_batch:
        refused.append(
            Refusal("eval", f"eval.batch_size {batch_size} is not a multiple of train.micro_batch ({micro_batch})")
        )
    if config.data.seq_len > config.model.max_seq_len:
        refused.append(
            Refusal("data", f"seq_len {config.data.seq_len} exceeds model.max_seq_len ({config.model.max_seq_len})")
        )
    interval = config.checkpoint.interval
    fixed = isinstance(interval, int)
    for index, spec in enumerate(config.fault.inject):
        if spec.step > train.steps:
            refused.append(
                Refusal("fault", f"inject.{index}.step {spec.step} is past the run's last step ({train.steps})")
            )
            continue
        saves = fixed and ((interval and spec.step % interval == 0) or spec.step == train.steps)
        if spec.kind in ("corrupt_checkpoint", "kill_during_save") and fixed and not saves:
            refused.append(
                Refusal(
                    "fault",
                    f"inject.{index}: a {spec.kind} fault at step {spec.step} never fires: the run saves at multiples "
                    f"of checkpoint.interval ({interval}) and at its last step",
                )
            )
    return refused

"""What a pipeline-parallel run must satisfy before any rank starts: the pipeline fits the job, the schedule gets
the micro-batches it needs, and the run asks only for what the pipeline runs. Each refusal names the setting to
change."""

from __future__ import annotations

from typing import Any, Protocol

from ferry.config import UserError
from ferry.kernels.config import KernelsConfig
from ferry.model.config import ModelConfig
from ferry.parallel.config import ParallelConfig
from ferry.parallel.layout import JobLayout


class PipelinedRun(Protocol):
    """What the checks read of a run config (`RunConfig`, which calls them: named here, not imported)."""

    parallel: ParallelConfig
    model: ModelConfig
    kernels: KernelsConfig
    train: Any
    eval: Any


def check_pipeline(config: PipelinedRun, layout: JobLayout) -> None:
    """Refuse a pipeline the schedule or the rest of the run cannot take (the job and the model took it: the
    layout was laid out)."""
    parallel, train = config.parallel, config.train
    pp = parallel.pp
    refused = (
        (
            parallel.ep_overlap == "auto",
            "parallel.ep_overlap=auto",
            "its trial steps run the whole model",
            "parallel.ep_overlap to none or chunked",
        ),
        (
            config.model.tie_embeddings,
            "model.tie_embeddings",
            "the tied head lives on another stage than its embedding",
            "model.tie_embeddings=false",
        ),
        (
            train.micro_batch == "auto",
            "train.micro_batch=auto",
            "the memory model does not choose a pipeline's micro-batch",
            "train.micro_batch to a number",
        ),
        (
            bool(config.model.skip_kind.pipeline_refusal),
            f"model.skip={config.model.skip}",
            config.model.skip_kind.pipeline_refusal,
            "model.skip=standard",
        ),
    )
    for asked, setting, reason, fix in refused:
        if asked:
            raise UserError(
                f"parallel.pp: {setting} is not supported with pipeline parallelism ({reason}); set {fix}, or "
                "parallel.pp=1"
            )
    vendor_pins = [op for op, implementation in config.kernels.ops.items() if implementation != "portable"]
    portable = config.kernels.policy == "portable" and not vendor_pins
    if parallel.pp_schedule == "zero_bubble" and (not portable or train.loss_chunk):
        raise UserError(
            "parallel.pp_schedule zero_bubble runs each backward in two passes over one graph (input, then weight "
            "gradients), which the experts' vendor kernels and the chunked head loss do not survive (they hand their "
            "buffers to one backward); set kernels.policy=portable (no vendor kernels.ops) and train.loss_chunk=0, or "
            "another schedule"
        )
    per_pass = train.micro_batch * layout.replicas
    if train.global_batch % per_pass:
        return  # the batch check names the fix
    micro_batches = train.global_batch // per_pass
    _check_micro_batches(parallel.pp_schedule, pp, parallel.pp_virtual_stages, micro_batches, train.micro_batch)


def _check_micro_batches(schedule: str, pp: int, virtual: int, micro_batches: int, micro_batch: int) -> None:
    """The counts torch's schedules accept: 1F1B at least one micro-batch per pipeline rank; interleaved 1F1B and
    zero bubble a whole number of rounds of pp micro-batches (GPipe and looped BFS take any count)."""
    if schedule == "1f1b" and micro_batches < pp:
        raise UserError(
            f"parallel.pp_schedule 1f1b needs at least parallel.pp ({pp}) micro-batches a step, this run has "
            f"{micro_batches} (train.global_batch / (train.micro_batch {micro_batch} x data-parallel ranks)); lower "
            "train.micro_batch or raise train.global_batch"
        )
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds or micro_batches < pp:
            raise UserError(
                f"parallel.pp_schedule {schedule} runs a step's micro-batches in rounds of about parallel.pp ({pp}): "
                f"at least {pp} that split into equal rounds (a multiple of {pp} always does); this run has "
                f"{micro_batches} (train.global_batch / (train.micro_batch {micro_batch} x data-parallel ranks)); "
                "change train.micro_batch or train.global_batch"
            )

"""`parallel.pp`: pipeline parallelism. Each rank of a pipeline holds consecutive blocks (its stages,
`ferry/parallel/pipeline_split.py`), the embedding with the first and the head with the last; a step's micro-batches
go through one of torch's schedules (`ferry/train/pipeline_context.py`), activations passing from stage to stage.
It composes with expert parallelism, ZeRO-1 and context parallelism inside each stage."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from ferry.config.refusals import Refusal
from ferry.parallel.pipeline_schedule import ExchangedShapes, Pipeline, build_pipeline
from ferry.parallel.pipeline_split import block_parameters, embedding_parameters
from ferry.train.layouts.base import LayoutKind, PlacedRun, RankShare, Traffic
from ferry.train.layouts.sizes import activation_bytes
from ferry.train.pipeline_context import PipelineContext

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout
    from ferry.train.step_context import ContextParts, PassShape, TrainingContext


class PipelineParallel(LayoutKind):
    name: ClassVar[str] = "pipeline"
    keeps_part_of_model: ClassVar[bool] = True  # a rank holds its stages' blocks of a model drawn whole

    def active(self, config: Any) -> bool:
        return config.parallel.pp > 1

    def refusals(self, config: Any) -> list[Refusal]:
        """The MTP modules read the model's last hidden state and its embedding of tokens further on: the
        embedding beside the head, which a pipeline puts on its first and last stages."""
        pp = config.parallel.pp
        if pp > 1 and config.model.mtp.depth:
            return [
                Refusal(
                    "parallel",
                    f"pp {pp}: model.mtp's modules need the embedding on the last stage, which holds the head only; "
                    "set model.mtp.depth=0 or pp=1 (ep, zero and fsdp train MTP)",
                )
            ]
        return []

    def job_refusals(self, config: Any, layout: JobLayout) -> list[str]:
        """A pipeline the schedule or the rest of the run cannot take (the job and the model took it: the layout
        was laid out), each naming the setting to change."""
        parallel, train, model = config.parallel, config.train, config.model
        refused = (
            (
                parallel.ep_overlap == "auto",
                "parallel.ep_overlap=auto",
                "its trial steps run the whole model",
                "parallel.ep_overlap to none or chunked",
            ),
            (
                model.tie_embeddings,
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
                bool(model.skip_kind.pipeline_refusal),
                f"model.skip={model.skip}",
                model.skip_kind.pipeline_refusal,
                "model.skip=standard",
            ),
        )
        for asked, setting, reason, fix in refused:
            if asked:
                return [
                    f"parallel.pp: {setting} is not supported with pipeline parallelism ({reason}); set {fix}, or "
                    "parallel.pp=1"
                ]
        vendor_pins = [op for op, implementation in config.kernels.ops.items() if implementation != "portable"]
        portable = config.kernels.policy == "portable" and not vendor_pins
        if parallel.pp_schedule == "zero_bubble" and (not portable or train.loss_chunk):
            return [
                "parallel.pp_schedule zero_bubble runs each backward in two passes over one graph (input, then weight "
                "gradients), which the experts' vendor kernels and the chunked head loss do not survive (they hand "
                "their buffers to one backward); set kernels.policy=portable (no vendor kernels.ops) and "
                "train.loss_chunk=0, or another schedule"
            ]
        per_pass = train.micro_batch * layout.replicas
        if train.global_batch % per_pass:
            return []  # the batch check names the fix
        micro_batches = train.global_batch // per_pass
        return _micro_batch_refusals(parallel.pp_schedule, parallel.pp, micro_batches, train.micro_batch)

    def shares(self, config: Any, layout: JobLayout, micro_batch: int, shares: list[RankShare]) -> list[RankShare]:
        """Every pipeline rank's share: its stages' parameters (the embedding on the first stage, the head on the
        last) and the micro-batches whose activations it keeps at once. Kept micro-batches follow the schedules'
        warm-up: GPipe and looped BFS run every forward of a stage before its backwards (all m), 1F1B's stage r runs
        pp - r forwards ahead, interleaved 1F1B about pp per rank (an estimate: its warm-up depends on the rank and
        the virtual stages); zero bubble, whose weight halves wait for later slots, is counted at all m (an upper
        bound)."""
        parallel, model = config.parallel, config.model
        split = layout.split
        sizes = block_parameters(model)
        moe = model.moe
        expert_block = moe.num_experts * 3 * model.dim * moe.expert_ffn_dim
        embedding = embedding_parameters(model)
        micro_batches = max(config.train.global_batch // (micro_batch * layout.replicas), 1)
        ranked = []
        for rank in range(parallel.pp):
            stages = split.stages_of(rank)
            blocks = sorted(split.blocks_of(rank))
            first, last = 0 in stages, split.num_stages - 1 in stages
            total = sum(sizes[block] for block in blocks) + embedding * (first + last) + (model.dim if last else 0)
            experts = expert_block * sum(1 for block in blocks if block >= model.dense_layers)
            if parallel.pp_schedule == "1f1b":
                in_flight = min(micro_batches, parallel.pp - rank)
            elif parallel.pp_schedule == "interleaved_1f1b":
                in_flight = min(micro_batches, parallel.pp)
            else:
                in_flight = micro_batches
            ranked.append(RankShare(total, experts, len(blocks), last, in_flight))
        return ranked

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Each micro-batch's residual stream passes every stage boundary forwards, and its gradient backwards
        (torch's point-to-point sends, in the parameter dtype), on a rank with a stage either side of it."""
        micro_batches = config.train.global_batch // (micro_batch * layout.data_ranks)
        tokens = micro_batch * config.data.seq_len // layout.cp
        stream = tokens * config.model.dim * activation_bytes(config)
        crossings = 2 * (layout.split.num_stages - 1) // layout.pp  # boundaries a rank sends across, both ways
        return [Traffic("pp_send", micro_batches * max(crossings, 1), stream, "pp", layout.pp)]

    def step_context(self, run: PlacedRun, shape: PassShape, context: ContextParts) -> TrainingContext:
        """The pipeline's schedule over its stages (built here), exchanging micro-batches of the objective's
        `shape`: with context parallelism, whole chunks of every row, so each stage's share of the positions is
        the same."""
        config, plan, precision = run.config, run.plan, run.precision
        model = config.model
        cp = plan.layout.cp
        if cp > 1:
            shape = replace(shape, seq_len=-(-shape.seq_len // (2 * cp)) * 2 * cp)
        shapes = ExchangedShapes(
            rows=shape.rows,
            seq_len=shape.seq_len,
            dim=model.dim,
            vocab_size=model.vocab_size,
            activation_dtype=precision.torch_param_dtype,
            logits_dtype=precision.torch_compute_dtype if precision.autocast else precision.torch_param_dtype,
            loss_chunk=shape.loss_chunk,
            cp=cp,
        )
        micro_batches = config.train.global_batch // (plan.data_world_size * config.train.micro_batch)

        def pipeline(loss) -> Pipeline:
            return build_pipeline(
                run.model,
                plan.split,
                plan.pp.rank,
                plan.pp.group,
                run.device,
                config.parallel.pp_schedule,
                micro_batches,
                shapes,
                loss,
            )

        return PipelineContext(
            context,
            pipeline=pipeline,
            plan=plan,
            moe=model.moe,
            moe_layers=model.n_layers - model.dense_layers,
            shape=shape,
            stream_dtype=precision.torch_param_dtype,
        )

    def banner(self, layout: JobLayout) -> str:
        return f"pp {layout.pp}"

    def announcement(self, config: Any, layout: JobLayout) -> list[str]:
        stages = layout.split.describe()
        micro_batches = config.train.global_batch // (config.train.micro_batch * layout.replicas)
        return [
            f"ferry: pipeline: {layout.pp} ranks a pipeline, {layout.pp_schedule}, blocks per stage "
            f"{stages['blocks_per_stage']}, {micro_batches} micro-batches of {config.train.micro_batch} a step"
        ]


def _micro_batch_refusals(schedule: str, pp: int, micro_batches: int, micro_batch: int) -> list[str]:
    """The counts torch's schedules accept: 1F1B at least one micro-batch per pipeline rank; interleaved 1F1B and
    zero bubble a whole number of rounds of pp micro-batches (GPipe and looped BFS take any count)."""
    if schedule == "1f1b" and micro_batches < pp:
        return [
            f"parallel.pp_schedule 1f1b needs at least parallel.pp ({pp}) micro-batches a step, this run has "
            f"{micro_batches} (train.global_batch / (train.micro_batch {micro_batch} x data-parallel ranks)); lower "
            "train.micro_batch or raise train.global_batch"
        ]
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds or micro_batches < pp:
            return [
                f"parallel.pp_schedule {schedule} runs a step's micro-batches in rounds of about parallel.pp ({pp}): "
                f"at least {pp} that split into equal rounds (a multiple of {pp} always does); this run has "
                f"{micro_batches} (train.global_batch / (train.micro_batch {micro_batch} x data-parallel ranks)); "
                "change train.micro_batch or train.global_batch"
            ]
    return []

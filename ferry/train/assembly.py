"""Building a run, apart from running it: a few phases, each returning a small immutable record that the next
takes as arguments, so the order things are built in (and what each needs) reads from the signatures.

    open_job(config)                      -> Job          device, ranks, their collectives, the job's layout
    decide_start(job)                     -> Start        fresh, resumed, from a parent, or restarted by the agent
    choose_numerics(job)                  -> Numerics     hardware profile, precision, kernels, loss scaler
    open_data(job, kind)                  -> RunData      loader, held-out evaluation, tokenizer digest
    build_model(job, numerics, start)     -> ModelParts   model, parallel plan, optimizer, compilation
    build_instruments(job, numerics, ...) -> Instruments  size, FLOPs, metrics, environment
    build_objective(job, numerics, ...)   -> Objective    what the steps optimise, from its variant

`assemble` runs them in that order. What changes while the run trains (the data position, the tokens seen)
is the train state (`ferry.train.state`), not part of these records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ferry.checkpoint import list_checkpoints
from ferry.comm import DistContext, init_distributed, launcher_ranks
from ferry.comm.reductions import RankReductions
from ferry.config import UserError
from ferry.data import MixedLoader
from ferry.data.records import RecordLoader
from ferry.data.tokenizer import encoding_digest, load_tokenizer
from ferry.inference import HeldOutEvaluation
from ferry.kernels import KernelSelection, select_kernels
from ferry.metrics import StepMetrics
from ferry.model import ModelSize, Transformer, count_model
from ferry.model.compilation import Compile, compile_blocks
from ferry.model.digest import weights_digest
from ferry.model.recompute import activation_checkpointing_record
from ferry.parallel import build_plan
from ferry.parallel.layout import JobLayout
from ferry.parallel.optimizers import OptimizerRecipe, optimizer_recipe
from ferry.parallel.plan import ParallelPlan
from ferry.platform import environment_fingerprint, resolve_device
from ferry.platform.allocator import apply_host_allocator
from ferry.platform.hardware import HardwareProfile, MfuPeak, measured_cpu_profile, resolve_profile
from ferry.precision import LossScaler, PrecisionPolicy, resolve_precision
from ferry.precision.kernels import low_precision_op, with_low_precision_experts
from ferry.precision.step_weights import StepWeights
from ferry.train.checkpointing import restore_model, shared_verification
from ferry.train.config import RunConfig
from ferry.train.layouts import RunLayout
from ferry.train.memory import choose_micro_batch
from ferry.train.objectives.base import Objective
from ferry.train.objectives.kinds import ObjectiveInputs, ObjectiveKind, objective_kind
from ferry.train.objectives.reference import ReferenceSource
from ferry.train.optimizer import decayed_parameter_names
from ferry.train.resilience.core import torchrun_restart_counts


@dataclass(frozen=True)
class Job:
    """Where the run executes: its config, this process's device and place among the ranks."""

    config: RunConfig
    device: torch.device
    context: DistContext
    layout: JobLayout  # laid out and checked once, by `open_job`
    kinds: RunLayout  # the layout kinds the config composes (`ferry/train/layouts/`)
    started_unix: float
    micro_batch: dict  # how train.micro_batch was decided (`auto`: by the memory model)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def is_main(self) -> bool:
        return self.context.rank == 0


@dataclass(frozen=True)
class Numerics:
    """How the run computes: the hardware profile, the precision policy, the kernels chosen, the loss scaler."""

    profile: HardwareProfile
    host_allocator: str
    precision: PrecisionPolicy
    kernels: KernelSelection
    scaler: LossScaler

    def autocast(self, device: torch.device) -> torch.autocast:
        precision = self.precision
        return torch.autocast(device.type, dtype=precision.torch_compute_dtype, enabled=precision.autocast)


@dataclass(frozen=True)
class RunData:
    """What the run reads: its objective's variant and loader, the held-out token evaluation, and the digest of
    the tokenizer its text was encoded with (None for synthetic ids; recorded in every checkpoint)."""

    kind: ObjectiveKind
    loader: MixedLoader | RecordLoader
    evaluation: HeldOutEvaluation
    tokenizer_digest: str | None


@dataclass(frozen=True)
class ModelParts:
    """The model laid out over the ranks, its optimizer (and the recipe every rank built it from), and the
    reductions over the ranks its plan times.
    `draw_deferred`: a run asked to resume left its weights undrawn (drawn only if it finds nothing to resume);
    `initial_weights`: the digest of the weights it drew (main rank; None when it drew none yet)."""

    model: Transformer
    plan: ParallelPlan
    optimizer: torch.optim.Optimizer
    recipe: OptimizerRecipe
    compiled: dict
    recompute: dict
    step_weights: StepWeights | None
    reductions: RankReductions
    draw_deferred: bool
    initial_weights: str | None


@dataclass(frozen=True)
class Instruments:
    """What measures the run: the model's size and FLOPs, the step metrics, the environment fingerprint."""

    size: ModelSize
    tokens_per_step: int
    metrics: StepMetrics
    environment: dict


@dataclass(frozen=True)
class RunParts:
    job: Job
    start: Start
    numerics: Numerics
    data: RunData
    model: ModelParts
    instruments: Instruments
    objective: Objective


def assemble(config: RunConfig, started_unix: float | None = None) -> RunParts:
    job = open_job(config, started_unix or time.time())
    start = decide_start(job)
    numerics = choose_numerics(job)
    data = open_data(job, objective_kind(config))
    model = build_model(job, numerics, start)
    instruments = build_instruments(job, numerics, data, model)
    objective = build_objective(job, numerics, data, model)
    return RunParts(job, start, numerics, data, model, instruments, objective)


def open_job(config: RunConfig, started_unix: float) -> Job:
    """The device and the process group; a job size the batch or the layout cannot split is refused here,
    before anything is built."""
    device = resolve_device(config.run.device, launcher_ranks()[2])
    context = init_distributed(config.comm, device)
    layout = config.check_world_size(context.world_size, context.is_distributed)
    if config.train.micro_batch == "auto":
        micro_batch, choice = choose_micro_batch(config, layout, device.type)
        config = config.model_copy(update={"train": config.train.model_copy(update={"micro_batch": micro_batch})})
    else:
        choice = {"requested": config.train.micro_batch, "chosen": config.train.micro_batch}
    return Job(config, device, context, layout, RunLayout.of(config), started_unix, choice)


@dataclass(frozen=True)
class Start:
    """Where the run starts, decided once on every rank: what it resumes (`resume`: `latest`, a checkpoint, or None
    for a fresh start or a start from `init_from`'s weights, which the config names), and the restart count of
    every node's torchrun agent (empty outside torchrun), agreed over the ranks in one collective. A job the agent
    restarted resumes its own newest checkpoint, or starts again at step 0 when it saved none and was not asked
    to resume."""

    resume: str | None
    restart_counts: tuple[int, ...]

    @property
    def restarted_by_agent(self) -> bool:
        return any(count > 0 for count in self.restart_counts)


def decide_start(job: Job) -> Start:
    config = job.config
    counts = tuple(torchrun_restart_counts())
    resume = config.resume
    restarted = any(count > 0 for count in counts)
    if restarted and (list_checkpoints(config.checkpoint.path(config.run.path)) or resume is None):
        resume = "latest"  # restarted by torchrun's agent: the run's own newest checkpoint, or step 0
    return Start(resume, counts)


def choose_numerics(job: Job) -> Numerics:
    """The hardware profile (a CPU's peak measured once per machine and cached), its host allocator preset, the
    precision resolved against it, and the kernels selected for the compute dtype (low-precision expert GEMMs
    routed through their recipe's op)."""
    config = job.config
    profile = resolve_profile(config.hardware, job.device)
    if profile.measure_peak and job.device.type == "cpu":
        profile = measured_cpu_profile()
    allocator = config.run.host_allocator
    host_allocator = apply_host_allocator(profile.host_allocator if allocator == "profile" else allocator)
    precision = resolve_precision(config.precision, profile)
    replayed = config.train.activation_checkpointing != "none"
    kernels = select_kernels(config.kernels, job.device, precision.torch_compute_dtype, replayed=replayed)
    if precision.recipe is not None:
        kernels = with_low_precision_experts(kernels, precision.recipe)
        low = kernels.choices[low_precision_op(precision.recipe)].implementation
        precision.record_experts_kernel(low.key, native=not low.portable)
    return Numerics(profile, host_allocator, precision, kernels, precision.build_scaler(config.precision))


def open_data(job: Job, kind: ObjectiveKind) -> RunData:
    """The objective's loader (every file checked against its manifest), the held-out token evaluation, and the
    tokenizer's digest; a vocabulary too small for the data's tokens is refused."""
    config = job.config
    train = config.train
    loader = kind.loader(config)
    tokenizer_vocab = loader.tokenizer["vocab_size"]
    if config.model.vocab_size < tokenizer_vocab:
        fix = (
            f"the init_from model has {config.model.vocab_size} rows, and a model that will learn added tokens (the "
            "chat tokens of SFT) needs them from pre-training on: pre-train with a model.vocab_size that covers them"
            if config.init_from is not None
            else f"set model.vocab_size={tokenizer_vocab} (or more)"
        )
        raise UserError(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab}) of {loader.datasets[0].label}; {fix}"
        )
    evaluation = HeldOutEvaluation(
        kind.token_evaluation(config),
        config.data.seq_len,
        config.eval.batch_size or train.global_batch,
        train.micro_batch,
        document_eos=loader.tokenizer["eos_id"] if config.data.document_masking else None,
        loss_chunk=train.loss_chunk,
    )
    first = loader.datasets[0]
    digest = encoding_digest(load_tokenizer(first.path / first.tokenizer["file"])) if first.tokenizer["file"] else None
    if evaluation.sources:
        evaluation.check_tokenizer(digest, config.model.vocab_size, first.label)
    return RunData(kind, loader, evaluation, digest)


def build_model(job: Job, numerics: Numerics, start: Start) -> ModelParts:
    """The model from the run's seed, moved, compiled and laid out over the ranks, and its optimizer.

    A run started from a checkpoint's weights (`init_from`, or its own checkpoint when it resumes) loads every
    one of them, strictly: drawing them first would only cost time (minutes for billions). A run asked to resume
    draws on the host only if it finds nothing to resume from (`ferry.train.restore.draw_deferred_weights`).
    """
    config = job.config
    torch.manual_seed(config.run.seed)
    drawn = config.init_from is None
    on_host = config.run.init_device == "host"
    # a rank that keeps part of a whole model's draw (a pipeline's stages) draws at once: a later draw sees only
    # that part
    draw_deferred = drawn and on_host and not job.kinds.keeps_part_of_model and start.resume is not None
    drawn_now = drawn and on_host and not draw_deferred
    recompute_mode = config.train.activation_checkpointing
    model = Transformer(
        config.model,
        numerics.kernels,
        initialise=drawn_now,
        recompute=recompute_mode,
        track_max_logits=config.tracks_attention_logits,
    )
    initial_weights = weights_digest(model) if drawn_now and job.is_main else None
    model = model.to(job.device, dtype=numerics.precision.torch_param_dtype)
    if drawn and not on_host:
        model.reset_parameters()
        initial_weights = weights_digest(model) if job.is_main else None
    recipe = optimizer_recipe(config.optim, model, decayed_parameter_names(model))
    recompute = activation_checkpointing_record(recompute_mode, len(model.layers))
    compiled = compile_blocks(model, resolve_compile(config.train.compile, job.device), job.layout.ep_degree > 1)
    compiled["requested"] = config.train.compile
    plan = build_plan(
        config.parallel, job.context, model, job.device, numerics.precision.torch_reduce_dtype, layout=job.layout
    )
    step_weights = _step_weights(job, model, numerics.precision)
    optimizer = plan.build_optimizer(recipe, config.optim.zero)
    reductions = RankReductions(job.context, job.device, plan.sum_over_ranks)
    return ModelParts(
        model,
        plan,
        optimizer,
        recipe,
        compiled,
        recompute,
        step_weights,
        reductions,
        draw_deferred,
        initial_weights,
    )


def resolve_compile(mode: Compile, device: torch.device) -> Compile:
    """`auto`: blocks on a GPU, where the element-wise work between the GEMMs is a large share of the step and
    fusing it pays (25% MFU compiled against 16% eager at the OLMoE-1B-7B shape on an H200); none on a CPU, where
    compiling measured no faster (docs/performance.md) and needs a C++ compiler."""
    if mode != "auto":
        return mode
    return "blocks" if device.type == "cuda" else "none"


def _step_weights(job: Job, model: Transformer, precision: PrecisionPolicy) -> StepWeights | None:
    """The weights cast once a step (`precision.weight_casts: step`) where autocast would cast them at every use:
    a compute dtype below the parameters'. Not under a layout that gathers and casts each block's weights itself
    (FSDP)."""
    if job.config.precision.weight_casts != "step" or not precision.autocast or job.kinds.casts_weights_itself:
        return None
    return StepWeights(model, precision.torch_compute_dtype)


def build_instruments(job: Job, numerics: Numerics, data: RunData, model: ModelParts) -> Instruments:
    """Size and FLOPs at the objective's sequence length, and the step metrics against the peak (with its source);
    the plan's collectives time into the same timer."""
    config = job.config
    size = count_model(config.model, data.kind.sequence_length(config, data.loader))
    peak = MfuPeak.of_profile(numerics.profile, numerics.precision.mfu_dtype)
    metrics = StepMetrics(job.device, job.world_size, size.flops_per_token, peak)
    model.plan.attach_timer(metrics.timer)
    tokens_per_step = config.train.global_batch * config.data.seq_len
    return Instruments(size, tokens_per_step, metrics, environment_fingerprint(job.device))


def build_objective(job: Job, numerics: Numerics, data: RunData, model: ModelParts) -> Objective:
    """The objective of the run's variant, with the way to its reference (the stage's parent, laid out as the
    policy is) and what identifies its cached reference log-probs."""
    config = job.config

    def frozen_model() -> Transformer:
        frozen = Transformer(config.model, numerics.kernels, initialise=False)
        frozen = frozen.to(job.device, dtype=numerics.precision.torch_param_dtype)
        model.plan.lay_out_frozen(frozen)
        return frozen

    references = ReferenceSource(
        config.init_from,
        config.train.objective,
        config.checkpoint.verify,
        shared_verification(job.context),
        frozen_model,
        lambda checkpoint, frozen: restore_model(checkpoint, frozen, model.plan),
    )
    identity = {"model": config.model.model_dump(mode="json"), "precision": numerics.precision.as_dict()}
    return data.kind.build(ObjectiveInputs(config, data.loader, references, identity))

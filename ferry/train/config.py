"""The run config: every component's section composed in one schema.

It lives in `train` because the trainer is the lowest layer that sees every
component; each section's class lives beside the code it configures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from ferry.checkpoint.config import CheckpointConfig
from ferry.comm.config import CommConfig
from ferry.config import Section, UserError, load_config
from ferry.data.config import DataConfig
from ferry.inference.config import EvalConfig
from ferry.kernels.config import KernelsConfig
from ferry.metrics.config import MetricsConfig, ProfileConfig
from ferry.model.compilation import Compile
from ferry.model.config import ModelConfig
from ferry.model.recompute import Recompute
from ferry.parallel.config import ParallelConfig
from ferry.parallel.layout import JobLayout, lay_out_job
from ferry.precision.config import PrecisionConfig
from ferry.train.objectives.config import DPOConfig, GRPOConfig, Objective
from ferry.train.pipeline_checks import check_pipeline
from ferry.train.resilience.config import FaultConfig


class RunSection(Section):
    """Identity and place of a run."""

    name: str = Field("run", min_length=1, description="defaults to the config file's stem")
    dir: str | None = Field(None, description="where everything of the run goes; default runs/<name>")
    seed: int = Field(0, ge=0)
    device: Literal["auto", "cpu", "cuda", "xpu", "mps"] = "auto"
    overwrite: bool = Field(False, description="replace the records of an earlier run in the same dir")
    model_preset: str | None = Field(
        None,
        description="the model preset (`ferry train --model NAME`) the model section was taken from, before the "
        "model.* overrides that followed it; a record for run.json and the console, read by nothing else",
    )
    init_device: Literal["host", "run"] = Field(
        "host",
        description="where the initial weights are drawn. host: by the CPU's generator, so a seed gives the same "
        "weights on any hardware (serial: ~30 ns a parameter, minutes for billions); run: on the run's device, "
        "after the move, in the parameters' dtype (seconds on an accelerator; the weights then depend on the "
        "device, so a rehearsal refuses it)",
    )
    host_allocator: Literal["profile", "default", "keep_freed"] = Field(
        "profile",
        description="profile: the hardware profile's preset (cpu: keep_freed, freed memory reused instead of "
        "mapped afresh each step); default: the C library's own behaviour",
    )

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


class MuonSection(Section):
    """Muon's settings (`optim.name: muon`; ferry/parallel/muon.py): the momentum in PyTorch's form (an
    exponential moving average of the gradients, `lerp`), with Nesterov's look-ahead; Newton-Schulz's quintic
    iteration, its steps and dtype; the update's scale per matrix."""

    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    nesterov: bool = True
    ns_steps: int = Field(5, ge=1, le=20, description="Newton-Schulz iterations")
    ns_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="the dtype Newton-Schulz runs in: bf16 (the usual; its result moves ~0.5% with a "
        "last-bit change of its input) or fp32 (layouts then agree within the suite's tolerance)",
    )
    qk_clip: float | None = Field(
        None,
        gt=0.0,
        description="QK-clip (Kimi K2's MuonClip): after each update, the query and key weights of a "
        "head whose largest attention logit in the step passed this threshold are scaled so that it would not "
        "have (GQA: a group's shared keys by the root of its smallest factor, each query by the rest; MLA: the "
        "head's own query and key parts, not the shared rotary key); off when unset; refused with model.qk_norm",
    )
    update_scale: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description="match_rms_adamw: 0.2 x sqrt(max(A, B)) per [A, B] matrix, the update's RMS "
        "AdamW's, so optim.lr and optim.weight_decay carry over (Moonlight); original: sqrt(max(1, A / B))",
    )


class OptimConfig(Section):
    """AdamW, or Muon for the hidden weight matrices with AdamW for the rest (`name: muon`), with a linear
    warm-up, then the schedule: cosine or linear decay to `min_lr_ratio * lr` at the
    last step, warm-up-stable-decay (`wsd`: constant, then a linear decay over the last `decay_fraction`
    of the steps), or `constant`. `min_lr_ratio: 0` decays to zero."""

    name: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw; muon: the matrices of attention, dense FFN and experts (each expert's on its "
        "own) by Muon, the embedding, head, norms and routers by AdamW; one lr and weight decay for both",
    )
    muon: MuonSection = MuonSection()
    lr: float = Field(3e-3, gt=0.0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="max global grad norm; 0 disables clipping")
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="wsd: the share of the steps spent decaying")
    zero: bool = Field(
        False,
        description="ZeRO-1: shard the optimizer state (AdamW's moments, Muon's momentum) over the ranks replicating each parameter",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: list[float]) -> list[float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError("each beta must lie in [0, 1)")
        return betas


class TrainConfig(Section):
    """How long and with what batch; the global batch is fixed whatever the world size."""

    objective: Objective = Field("lm", description="lm (next token; SFT with a loss mask), dpo or grpo")
    compile: Compile = Field(
        "auto",
        description="none (eager), blocks: each transformer block compiled on its own with torch.compile "
        "(inductor; on a CPU it needs a C++ compiler), or auto: blocks on CUDA and ROCm GPUs, none on a CPU "
        "(where it measured no faster); the choice and the compile time are in run.json",
    )
    activation_checkpointing: Recompute = Field(
        "none",
        description="none; full: each block recomputed in the backward from its input; selective: GEMM and "
        "attention outputs kept, norms, activations and element-wise work recomputed. Both keep the routing "
        "choice and the expert-parallel exchange (ferry/model/recompute.py); bit for bit the plain run's numerics",
    )
    loss_chunk: int = Field(
        0,
        ge=0,
        description="lm: tokens per chunk of the output projection and cross-entropy computed together, so the "
        "full logits are never held, in training steps and held-out evaluations (ferry/model/head_loss.py); 0: "
        "logits first, then the loss",
    )
    steps: int = Field(100, ge=1)
    global_batch: int = Field(
        16, ge=1, description="sequences per optimizer step, over all ranks (dpo: pairs; grpo: prompts)"
    )
    micro_batch: int | Literal["auto"] = Field(
        8,
        description="sequences per forward pass on one rank; auto: the largest that divides the rank's share of "
        "the global batch and that the memory model says fits the device with headroom (recorded in run.json)",
    )
    log_every: int = Field(10, ge=1, description="console line interval (metrics.jsonl gets every step)")
    stop_at: int | None = Field(
        None,
        ge=1,
        description="stop after this step with a checkpoint, as a preempted run would; the schedule still spans "
        "`steps`; resume=latest with stop_at unset (or later) continues the run",
    )

    @field_validator("loss_chunk")
    @classmethod
    def _chunks_the_lm_loss(cls, loss_chunk: int, info: ValidationInfo) -> int:
        objective = info.data.get("objective")
        if loss_chunk and objective != "lm":
            raise ValueError(f"chunks the next-token loss (objective lm); {objective} scores its sequences' log-probs")
        return loss_chunk

    @field_validator("micro_batch")
    @classmethod
    def _micro_divides_global(cls, micro_batch: int | str, info: ValidationInfo) -> int | str:
        if micro_batch == "auto":
            objective = info.data.get("objective")
            if objective not in (None, "lm"):
                raise ValueError(
                    f"auto is decided by the memory model of next-token training; objective {objective} needs a number"
                )
            return micro_batch
        if micro_batch < 1:
            raise ValueError("must be at least 1, or auto")
        global_batch = info.data.get("global_batch")
        if global_batch is not None and global_batch % micro_batch:
            raise ValueError(f"micro_batch must divide global_batch ({global_batch})")
        return micro_batch


class RunConfig(Section):
    """Everything a training run needs; `ferry train CONFIG key=value ...` resolves to one of these."""

    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    kernels: KernelsConfig = KernelsConfig()
    hardware: str = Field("auto", min_length=1, description="a profile in ferry/platform/profiles, or auto")
    precision: PrecisionConfig = PrecisionConfig()
    comm: CommConfig = CommConfig()
    parallel: ParallelConfig = ParallelConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    fault: FaultConfig = FaultConfig()
    eval: EvalConfig = EvalConfig()
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    resume: str | None = Field(
        None,
        min_length=1,
        description="latest (the newest valid checkpoint in checkpoint.dir, if any) or the path of a checkpoint",
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="a checkpoint (or a directory of them: the newest valid) whose weights start this run at step "
        "0, e.g. one `ferry import` wrote; a run that resumes takes its own checkpoint instead",
    )
    init_optimizer: bool = Field(
        False,
        description="with init_from, start from that checkpoint's optimizer state too (AdamW's moments and step counts, or Muon's momentum besides them)",
    )

    @property
    def tracks_attention_logits(self) -> bool:
        """Whether the attention keeps each head's largest training logit: asked for as a figure, or QK-clip acts
        on it."""
        return self.metrics.attn_max_logit or self.optim.muon.qk_clip is not None

    def check_world_size(self, world_size: int, distributed: bool | None = None) -> JobLayout:
        """The job's layout over `world_size` ranks (`ferry.parallel.layout`), laid out and checked here once:
        a job size the layout, the pipeline or the batch cannot be split over is refused before any rank starts.
        Each refusal names the overrides that would fit, since picking one is what the user does next."""
        train = self.train
        layout = lay_out_job(self.parallel, self.model, world_size, distributed)
        if layout.split is not None:
            check_pipeline(self, layout)
        world_size = layout.data_ranks  # the ranks a step's rows are split over: one per pipeline and cp group
        micro_batch = 1 if train.micro_batch == "auto" else train.micro_batch  # auto takes a divisor that fits
        per_pass = micro_batch * world_size
        batches = {"train.global_batch": train.global_batch}
        if self.eval.sources and self.eval.batch_size is not None:
            batches["eval.batch_size"] = self.eval.batch_size
        for key, batch in batches.items():
            if batch % per_pass:
                raise UserError(
                    f"{key} ({batch}) must be a multiple of train.micro_batch x world size "
                    f"({train.micro_batch} x {world_size} = {per_pass}); "
                    f"{_batch_fixes(key, batch, batches, micro_batch, world_size)}"
                )
        return layout

    @field_validator("parallel")
    @classmethod
    def _overlap_trial_trains_the_next_token(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        train = info.data.get("train")
        if parallel.ep_overlap == "auto" and train is not None and train.objective != "lm":
            raise ValueError(
                f"ep_overlap auto measures trial steps of next-token training, restoring the run after them; "
                f"objective {train.objective} samples or caches what a trial step would use up: set none or chunked"
            )
        return parallel

    @field_validator("train")
    @classmethod
    def _record_objectives_read_whole_sets(cls, train: TrainConfig, info: ValidationInfo) -> TrainConfig:
        """DPO and GRPO read whole records (pairs, prompts) in the order of their steps, not windows of a mix: a
        budget of tokens or epochs would mean nothing to them, and is refused rather than ignored."""
        data = info.data.get("data")
        if data is None or train.objective not in ("dpo", "grpo"):
            return train
        for index, source in enumerate(data.sources):
            for budget in ("tokens", "epochs"):
                if getattr(source, budget) is not None:
                    raise ValueError(
                        f"objective {train.objective} reads whole records, not windows: data.sources.{index}.{budget} "
                        f"({source.name}) is a budget of a token mix; leave it out (train.steps sets how many steps "
                        "of records the run takes)"
                    )
        return train

    @field_validator("parallel")
    @classmethod
    def _farskip_hands_over_unfinished(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        """FSDP gathers a block's weights again for its backward from hooks on the tensors the block returns; a
        FarSkip block returns a stream whose FFN output is still unfinished, which those hooks do not see (the
        backward then finds the weights released)."""
        model = info.data.get("model")
        if parallel.mode == "fsdp" and model is not None and model.skip == "farskip":
            raise ValueError(
                "mode fsdp: model.skip farskip hands each block's FFN output on unfinished, and FSDP gathers a "
                "block's weights for its backward only from the tensors the block returns; use mode=ep (with "
                "optim.zero=true to shard the optimizer) or model.skip=standard"
            )
        return parallel

    @field_validator("parallel")
    @classmethod
    def _mtp_where_it_is_computed(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        """The MTP modules read the model's last hidden state and its embedding of tokens further on: one
        process's whole rows, with the embedding beside the head."""
        model, train = info.data.get("model"), info.data.get("train")
        if model is None or not model.mtp.depth:
            return parallel
        if parallel.pp > 1:
            raise ValueError(
                f"pp {parallel.pp}: model.mtp's modules need the embedding on the last stage, which holds the head "
                "only; set model.mtp.depth=0 or pp=1 (ep, zero and fsdp train MTP)"
            )
        if parallel.cp > 1:
            raise ValueError(
                f"cp {parallel.cp}: model.mtp's modules read tokens further on in the row, which another "
                "context-parallel rank holds; set model.mtp.depth=0 or cp=1"
            )
        if train is not None and train.objective != "lm":
            raise ValueError(
                f"model.mtp trains with the next-token objective (lm); {train.objective} scores sequences with the "
                "main head alone: set model.mtp.depth=0 for this stage"
            )
        return parallel

    @field_validator("parallel")
    @classmethod
    def _split_sequences_see_whole_keys(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        """A context-parallel rank attends over gathered keys by its own positions' masks, which know no window
        and no sink."""
        model = info.data.get("model")
        if parallel.cp > 1 and model is not None:
            for field in ("sliding_window", "attention_sinks"):
                if getattr(model, field):
                    raise ValueError(
                        f"cp {parallel.cp}: model.{field} is not computed over a split sequence; set cp=1 for this "
                        "model (ep, pp, zero and fsdp train it)"
                    )
        return parallel

    @field_validator("parallel")
    @classmethod
    def _split_sequences_are_not_decoded(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        train = info.data.get("train")
        if parallel.cp > 1 and train is not None and train.objective == "grpo":
            raise ValueError(
                f"cp {parallel.cp}: objective grpo generates its rollouts a token at a time from a cache of whole "
                "sequences, which a context-parallel rank does not hold; set cp=1 for grpo (dpo and lm, SFT "
                "included, train under cp)"
            )
        return parallel

    @field_validator("optim")
    @classmethod
    def _qk_clip_where_it_acts(cls, optim: OptimConfig, info: ValidationInfo) -> OptimConfig:
        model = info.data.get("model")
        if optim.muon.qk_clip is None:
            return optim
        if optim.name != "muon":
            raise ValueError("muon.qk_clip rescales the query and key weights after Muon's update: set name=muon")
        if model is not None and model.attention_bias:
            raise ValueError(
                "muon.qk_clip scales the query and key weights to scale the logits, which model.attention_bias's "
                "biases would not follow: set model.attention_bias=false or leave muon.qk_clip unset"
            )
        if model is not None and model.qk_norm:
            raise ValueError(
                "muon.qk_clip scales the query and key projections, which model.qk_norm normalises back, and its "
                "gains are shared by the heads it would scale one by one: set model.qk_norm=false or leave "
                "muon.qk_clip unset"
            )
        return optim

    @field_validator("parallel")
    @classmethod
    def _qk_clip_on_whole_weights(cls, parallel: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        optim = info.data.get("optim")
        if parallel.mode == "fsdp" and optim is not None and optim.muon.qk_clip is not None:
            raise ValueError(
                "mode fsdp: optim.muon.qk_clip scales rows of the query and key weights by head, and FSDP holds a "
                "shard of them on every rank: set mode=ep, or leave optim.muon.qk_clip unset"
            )
        return parallel

    @field_validator("fault")
    @classmethod
    def _faults_within_the_run(cls, fault: FaultConfig, info: ValidationInfo) -> FaultConfig:
        train, checkpoint = info.data.get("train"), info.data.get("checkpoint")
        for index, spec in enumerate(fault.inject):
            if train is not None and spec.step > train.steps:
                raise ValueError(f"inject.{index}.step {spec.step} is past the run's last step ({train.steps})")
            interval = checkpoint.interval if checkpoint is not None else None
            fixed = isinstance(interval, int) and train is not None
            saves = fixed and ((interval and spec.step % interval == 0) or spec.step == train.steps)
            if spec.kind in ("corrupt_checkpoint", "kill_during_save") and fixed and not saves:
                raise ValueError(
                    f"inject.{index}: a {spec.kind} fault at step {spec.step} never fires: the run saves at multiples "
                    f"of checkpoint.interval ({interval}) and at its last step"
                )
        return fault

    @field_validator("data")
    @classmethod
    def _windows_fit_model(cls, data: DataConfig, info: ValidationInfo) -> DataConfig:
        model = info.data.get("model")
        if model is not None and data.seq_len > model.max_seq_len:
            raise ValueError(f"seq_len {data.seq_len} exceeds model.max_seq_len ({model.max_seq_len})")
        return data

    @field_validator("eval")
    @classmethod
    def _eval_batch_splits_into_micro_batches(cls, evaluation: EvalConfig, info: ValidationInfo) -> EvalConfig:
        train = info.data.get("train")
        micro_batch = train.micro_batch if train is not None else "auto"
        if micro_batch != "auto" and evaluation.batch_size is not None and evaluation.batch_size % micro_batch:
            raise ValueError(
                f"eval.batch_size {evaluation.batch_size} is not a multiple of train.micro_batch ({train.micro_batch})"
            )
        return evaluation


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


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Load a run config; `run.name` defaults to the file's stem, so `run.dir` defaults to runs/<stem>."""
    return load_config(RunConfig, path, overrides, base={"run": {"name": Path(path).stem}})

"""The run config: every component's section composed in one schema.

It lives in `train` because the trainer is the lowest layer that sees every
component; each section's class lives beside the code it configures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ferry.checkpoint.config import CheckpointConfig
from ferry.comm.config import CommConfig
from ferry.config import Section, UserError, load_config
from ferry.config.refusals import refusals_error
from ferry.data.config import DataConfig
from ferry.inference.config import EvalConfig
from ferry.kernels.config import KernelsConfig
from ferry.metrics.config import MetricsConfig, ProfileConfig
from ferry.model.compilation import Compile
from ferry.model.config import ModelConfig
from ferry.model.recompute import Recompute
from ferry.parallel.config import ParallelConfig
from ferry.parallel.layout import JobLayout, lay_out_job
from ferry.parallel.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_KINDS, MuonConfig
from ferry.precision.config import PrecisionConfig
from ferry.train.objectives.config import DPOConfig, GRPOConfig, Objective
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


class OptimConfig(Section):
    """AdamW, or Muon for the hidden weight matrices with AdamW for the rest (`name: muon`), with a linear
    warm-up, then the schedule: cosine or linear decay to `min_lr_ratio * lr` at the
    last step, warm-up-stable-decay (`wsd`: constant, then a linear decay over the last `decay_fraction`
    of the steps), or `constant`. `min_lr_ratio: 0` decays to zero."""

    name: str = Field(
        DEFAULT_OPTIMIZER,
        description="adamw; muon: the matrices of attention, dense FFN and experts (each expert's on its "
        "own) by Muon, the embedding, head, norms and routers by AdamW; one lr and weight decay for both",
    )
    muon: MuonConfig = MuonConfig()
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
        description="ZeRO-1: shard the optimizer state (AdamW's moments, Muon's momentum) over the ranks replicating "
        "each parameter",
    )

    @field_validator("name")
    @classmethod
    def _a_kind(cls, name: str) -> str:
        if name not in OPTIMIZER_KINDS:
            raise ValueError(f"{name!r} is no optimizer; choose one of {', '.join(OPTIMIZER_KINDS)}")
        return name

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

    @field_validator("micro_batch")
    @classmethod
    def _a_number_or_auto(cls, micro_batch: int | str) -> int | str:
        if micro_batch != "auto" and micro_batch < 1:
            raise ValueError("must be at least 1, or auto")
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
        description="with init_from, start from that checkpoint's optimizer state too (AdamW's moments and step "
        "counts, or Muon's momentum besides them)",
    )

    @property
    def tracks_attention_logits(self) -> bool:
        """Whether the attention keeps each head's largest training logit: asked for as a figure, or QK-clip acts
        on it."""
        return self.metrics.attn_max_logit or self.optim.muon.qk_clip is not None

    def check_world_size(self, world_size: int, distributed: bool | None = None) -> JobLayout:
        """The job's layout over `world_size` ranks (`ferry.parallel.layout`), laid out and checked once: a job size
        the layout, its kinds or the batch cannot be split over is refused before any rank starts, with every reason
        (`ferry/train/layouts/composition.py`), each naming the overrides that would fit."""
        from ferry.train.layouts import job_refusals

        layout = lay_out_job(self.parallel, self.model, world_size, distributed)
        refused = job_refusals(self, layout)
        if refused:
            raise UserError("\n".join(refused))
        return layout

    @model_validator(mode="after")
    def _composes(self) -> RunConfig:
        """Every combination of sections the run cannot take, each at its key, all at once: the layout,
        optimizer and objective kinds are asked about the rest of the config (`ferry/train/layouts/composition.py`),
        once every section is valid on its own, so no check depends on the order of the fields."""
        from ferry.train.layouts import config_refusals

        refused = config_refusals(self)
        if refused:
            raise refusals_error(type(self).__name__, refused)
        return self


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Load a run config; `run.name` defaults to the file's stem, so `run.dir` defaults to runs/<stem>."""
    return load_config(RunConfig, path, overrides, base={"run": {"name": Path(path).stem}})

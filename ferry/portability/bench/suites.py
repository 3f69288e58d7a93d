"""Benchmark suites as data: one named, versioned model, batch, layout and step count in a YAML file.

    name: moe-tiny            version: 1          seed: 20261201
    nproc: 1                  device: cpu         warmup_steps: 3     measured_steps: 12
    zipf_exponent: 1.1        config: {model: ..., data: {seq_len: ...}, train: {global_batch: ...}, parallel: ...}

A suite is the standard procedure two vendors are compared by: the same MoE, the same
batch, and (through its seed) the same token values and initial weights on every
machine. Its digest covers everything but the description, so a record of a changed
suite never passes for a record of the old one. Suites live in `benchmarks/suites/`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ferry.config import ConfigError, Section, UserError, apply_overrides
from ferry.config.loader import parse_override, validate
from ferry.config.named import read_named_yaml
from ferry.train.config import RunConfig
from ferry.train.memory import HEADROOM, MemoryEstimate, device_memory_bytes, gib, memory_estimate

SUITES_DIR = Path("benchmarks") / "suites"
# What makes a run a measurement of its suite, refused as overrides: where it runs and writes, how many steps,
# its data, checkpoints, resuming and faults; and what it starts from and optimises. `init_from` (with
# `init_optimizer`) would replace the seed's initial weights, whose digest the trainer then clears, so the input
# digest could not tell the runs apart; `train.objective` turns the same tokens into another computation.
_FIXED = (
    "run",
    "train.steps",
    "train.log_every",
    "train.stop_at",
    "train.objective",
    "data",
    "checkpoint",
    "resume",
    "fault",
    "init_from",
    "init_optimizer",
)


class BenchSuite(Section):
    """One benchmark: what runs, on how many local ranks, for how many steps."""

    name: str = Field(min_length=1)
    version: int = Field(ge=1, description="raise it whenever the definition changes on purpose")
    description: str = ""
    seed: int = Field(ge=0, description="token values and initial weights are drawn from it")
    nproc: int = Field(1, ge=1, description="local ranks (as torchrun --nproc-per-node)")
    device: Literal["cpu", "cuda", "auto"] = "auto"
    warmup_steps: int = Field(ge=0, description="steps run and left out of the figures")
    measured_steps: int = Field(ge=1)
    zipf_exponent: float = Field(1.1, gt=0.0, description="token frequencies fall as 1 / rank ** exponent, as in text")
    config: dict[str, Any] = Field(description="run config sections: model, data.seq_len, train batch, parallel, ...")

    @property
    def digest(self) -> str:
        fields = self.model_dump(mode="json", exclude={"description"})
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measured_steps

    def run_config(self, work: Path, device: str, overrides: list[str]) -> RunConfig:
        """The run config of one measurement: the suite's sections, synthetic data under `work`, no checkpoints.

        Overrides may change what a comparison varies (kernels, precision, layout, the model to try a
        variant); never what makes it a measurement of this suite: where it runs and writes, how many
        steps, its data, checkpoints or resuming, the weights it starts from (`init_from`,
        `init_optimizer`) or the objective it trains (`train.objective`).
        """
        for text in overrides:
            key = _fixed_key(text)
            if key is not None:
                raise UserError(
                    f"ferry bench: {key} is fixed by the suite (run, steps, objective, data, checkpoints, resume, "
                    "faults, the initial weights: init_from, init_optimizer); change the suite file instead"
                )
        fixed = [
            f"run.name={self.name}",
            f"run.dir={work / 'run'}",
            f"run.seed={self.seed}",
            f"run.device={device}",
            "run.overwrite=true",
            f"train.steps={self.total_steps}",
            "train.log_every=1",
            "checkpoint.enabled=false",
            "checkpoint.interval=0",
        ]
        raw = apply_overrides(self.config, fixed + list(overrides))
        raw.setdefault("data", {})["sources"] = [{"name": "synthetic", "path": str(work / "data")}]
        try:
            return validate(RunConfig, raw)
        except ConfigError as exc:
            raise ConfigError(f"suite {self.name}: {exc}") from None


def _fixed_key(text: str) -> str | None:
    """The key of override `text` when it sets a fixed key, inside one (`run.seed`) or over one by replacing
    its section (`train={objective: dpo}`); None when it may vary. Keys are compared as parsed, so quoting
    (`train."objective"`) does not slip past."""
    keys, _ = parse_override(text)
    for fixed in _FIXED:
        parts = fixed.split(".")
        if keys[: len(parts)] == parts or parts[: len(keys)] == keys:
            return ".".join(keys)
    return None


def load_suite(spec: str) -> BenchSuite:
    """A suite from a file path or the name of a file in `benchmarks/suites/`."""
    path, raw = read_named_yaml(spec, SUITES_DIR, "benchmark suite")
    try:
        return validate(BenchSuite, raw)
    except ConfigError as exc:
        raise ConfigError(f"suite file {str(path)!r}: {exc}") from None


def check_fits(suite: BenchSuite, config: RunConfig, world_size: int) -> MemoryEstimate:
    """Refuse, before anything runs, a suite that needs a device this machine lacks, fewer GPUs than it has
    ranks (each local rank takes a GPU of its own: with too few, ranks would land on GPUs that do not exist and
    crash after the launch), or more memory than one rank has here (keeping 5% free)."""
    import torch

    device = config.run.device if config.run.device != "auto" else _auto_device()
    estimate = memory_estimate(config, world_size, device)
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"suite {suite.name} runs on cuda, but no CUDA or ROCm device is visible here; it needs about "
            f"{gib(estimate.total_bytes)} GiB per rank ({estimate.describe()}); run it on a GPU machine, or with "
            "--device cpu where the host can hold it"
        )
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise UserError(
            f"suite {suite.name} runs {world_size} ranks on cuda, one GPU each, but {torch.cuda.device_count()} "
            f"GPU(s) are visible here; run it on a host with {world_size} GPUs, or with fewer ranks (--nproc, "
            "with parallel.ep dividing it)"
        )
    where, available = device_memory_bytes(device, world_size)
    per_rank = available / world_size if device == "cpu" else available
    if estimate.total_bytes > HEADROOM * per_rank:
        raise UserError(
            f"suite {suite.name} needs about {gib(estimate.total_bytes)} GiB per rank ({estimate.describe()}) and "
            f"{where} has {gib(per_rank)} GiB per rank on {device}, of which {HEADROOM:.0%} may be planned; run it "
            "where it fits (a GPU with enough memory: --device cuda) or shrink it with overrides"
        )
    return estimate


def workload_digest(config: RunConfig) -> str:
    """sha256 of what a step computes: the model, the sequence length, the global batch and the optimizer
    (not the layout, kernels, precision or micro-batching, which are what a comparison may vary)."""
    optim = config.optim.model_dump(mode="json", exclude={"zero"})
    fields = {
        "model": config.model.model_dump(mode="json"),
        "seq_len": config.data.seq_len,
        "global_batch": config.train.global_batch,
        "optim": optim,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

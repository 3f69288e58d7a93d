"""Resolve the precision config against a hardware profile into one concrete policy.

The profile supplies defaults, the run config overrides them, and every decision
(including how an unsupported low-precision format is handled) is written down so
the run log and `run.json` say exactly what numerics the run used.

Low-precision expert GEMMs are offered for speed only where the debt ledger holds a
whole-step measurement on the run's hardware profile at or above the bf16 run's
speed; everywhere else the decisions say the format runs for its numerics, with the
measurement that shows it slower when there is one, so asking for FP8 never slows a
run silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferry.config import UserError
from ferry.kernels import REGISTRY, Ledger, load_ledger
from ferry.platform.hardware import HardwareProfile, load_profile
from ferry.precision.config import PrecisionConfig
from ferry.precision.formats import float_format
from ferry.precision.kernels import low_precision_op
from ferry.precision.recipe import LowPrecisionRecipe
from ferry.precision.scaler import LossScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionPolicy:
    param_dtype: str
    compute_dtype: str
    reduce_dtype: str
    loss_scaling: str
    experts: str
    experts_mode: str
    recipe: LowPrecisionRecipe | None
    decisions: list[str] = field(default_factory=list)
    experts_kernel: str | None = None
    hardware: str | None = None

    def record_experts_kernel(self, key: str, native: bool, ledger: Ledger | None = None) -> None:
        """The expert GEMMs run native only where a vendor kernel computes the format; else they are emulated.
        A native kernel's speed against bf16 on this hardware is written down from the ledger (`ledger.yaml`)."""
        self.experts_kernel = key
        if self.experts_mode == "native" and not native:
            self.experts_mode = "emulated"
            self.decisions.append(
                f"experts={self.experts}: the hardware has the format, but no vendor kernel for it is selected "
                f"here; {key} emulates it, {_EMULATION_IS_SLOWER}"
            )
        elif native:
            self.decisions.append(self._speed_against_bf16(key, ledger if ledger is not None else load_ledger()))

    def _speed_against_bf16(self, key: str, ledger: Ledger) -> str:
        """Whether the native expert GEMMs are a speed option on this hardware, by the ledger's whole-step
        measurements; a measured win is stated as such, anything else as numerics only."""
        op = REGISTRY[low_precision_op(self.recipe)]
        entry = ledger.entry(next(impl for impl in op.vendor if impl.key == key))
        here = entry.step_on(self.hardware) if entry is not None else None
        gemms = f"experts={self.experts} on {self.hardware}: the {self.experts.upper()} expert GEMMs ({key})"
        numerics_only = f"{self.experts} is offered here for its numerics, not for speed"
        if here is not None and not here.slower:
            return f"{gemms} measured {here.describe()}"
        if here is not None:
            return f"warning: {gemms} measured {here.describe()}, so {numerics_only}"
        elsewhere = ", ".join(step.describe() for step in entry.step_vs_bf16) if entry is not None else ""
        return (
            f"{gemms} have no whole-step measurement against bf16 on {self.hardware}"
            + (f" (elsewhere: {elsewhere})" if elsewhere else "")
            + f", so until one shows them faster {numerics_only}"
        )

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype]

    @property
    def autocast(self) -> bool:
        return self.compute_dtype != self.param_dtype

    @property
    def mfu_dtype(self) -> str:
        """Which peak of the hardware profile the run's FLOPs are measured against."""
        return "mxfp8" if self.experts == "mxfp8" and self.experts_mode == "native" else self.compute_dtype

    def build_scaler(self, config: PrecisionConfig) -> LossScaler:
        return LossScaler(self.loss_scaling, config.loss_scaling)

    def as_dict(self) -> dict:
        return {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "reduce_dtype": self.reduce_dtype,
            "loss_scaling": self.loss_scaling,
            "experts": self.experts,
            "experts_mode": self.experts_mode,
            "experts_kernel": self.experts_kernel,
            "experts_formats": None
            if self.recipe is None
            else {"forward": str(self.recipe.forward_format.dtype), "grad": str(self.recipe.grad_format.dtype)},
            "decisions": list(self.decisions),
        }


def resolve_precision(config: PrecisionConfig, profile: HardwareProfile) -> PrecisionPolicy:
    """The policy of a run on `profile`'s hardware.

    With `precision.profile` set, the dtypes and the FP8 variant are another profile's
    (an NVIDIA-to-AMD move rehearsed on a CPU), while whether a format runs natively
    still depends on the hardware the run is on.
    """
    numerics = load_profile(config.profile) if config.profile is not None else profile
    defaults = numerics.precision_defaults
    decisions: list[str] = []
    if numerics is not profile:
        decisions.append(f"numerics of profile {numerics.name} on {profile.name} hardware (precision.profile)")

    def pick(name: str, value):
        chosen = value if value is not None else getattr(defaults, name)
        source = "config" if value is not None else f"profile {numerics.name}"
        decisions.append(f"{name}={chosen} ({source})")
        return chosen

    param_dtype = pick("param_dtype", config.param_dtype)
    compute_dtype = pick("compute_dtype", config.compute_dtype)
    reduce_dtype = pick("reduce_dtype", config.reduce_dtype)
    loss_scaling = pick("loss_scaling", config.loss_scaling.kind)
    if compute_dtype == "fp16" and loss_scaling == "none":
        decisions.append("warning: fp16 compute without loss scaling risks gradient underflow")

    experts_mode = "none"
    recipe = None
    if config.experts != "none":
        if profile.supports(config.experts):
            experts_mode = "native"
        elif config.on_unsupported == "error":
            raise UserError(
                f"precision.experts: {config.experts} is not supported natively by hardware profile "
                f"{profile.name!r}; set precision.on_unsupported=emulate to rehearse it in emulation"
            )
        else:
            experts_mode = "emulated"
        recipe = _recipe(config.experts, numerics, config.gradient_format)
        decisions.append(
            f"experts={config.experts} {experts_mode} on {profile.name} "
            f"(forward {recipe.forward_format.dtype}, gradients {recipe.grad_format.dtype})"
            + (f", {_EMULATION_IS_SLOWER}" if experts_mode == "emulated" else "")
        )
    return PrecisionPolicy(
        param_dtype,
        compute_dtype,
        reduce_dtype,
        loss_scaling,
        config.experts,
        experts_mode,
        recipe,
        decisions,
        hardware=profile.name,
    )


_EMULATION_IS_SLOWER = (
    "for its numerics only: the emulation rounds the operands around the same GEMMs and is slower than a run without it"
)


def _recipe(kind: str, profile: HardwareProfile, gradient_format: str = "auto") -> LowPrecisionRecipe:
    """The formats of each kind, in the variant the hardware uses (OCP or FNUZ).

    FP8 rounds every operand, gradients included, to E4M3: with one scale per row (per
    channel and expert group for the weight gradient) gradients keep their range
    without E5M2, and E4M3 on both sides is what torch's FP8 grouped GEMM accepts on
    NVIDIA and AMD. MXFP8 uses E4M3 elements forward and E5M2 for gradients, as the OCP
    MX format allows; `precision.gradient_format: e4m3` gives it E4M3 gradients, what
    torchao's MXFP8 grouped GEMM computes (a block scale per 32 values keeps their range).
    """
    e4m3 = next(name for name in profile.float8_formats if name.startswith("float8_e4m3"))
    if kind == "mxfp8":
        # OCP MX elements are OCP FP8 on every vendor
        gradients = "float8_e4m3fn" if gradient_format == "e4m3" else "float8_e5m2"
        return LowPrecisionRecipe(kind, float_format("float8_e4m3fn"), float_format(gradients))
    if gradient_format == "e5m2":
        e5m2 = next(name for name in profile.float8_formats if name.startswith("float8_e5m2"))
        return LowPrecisionRecipe(kind, float_format(e4m3), float_format(e5m2))
    return LowPrecisionRecipe(kind, float_format(e4m3), float_format(e4m3))

"""Hardware profiles: what an accelerator can do, as data, so moving hardware means changing a profile.

Profiles live in `ferry/platform/profiles/*.yaml` with the source of every figure
beside it. `hardware: auto` picks the profile whose `match` strings appear in the
detected device name; a CPU measures its own peak once and caches it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import Field

from ferry.config import Section, UserError
from ferry.config.loader import validate
from ferry.platform.allocator import HostAllocator

PROFILE_DIR = Path(__file__).parent / "profiles"
Dtype = Literal["fp32", "bf16", "fp16"]


class PrecisionDefaults(Section):
    param_dtype: Dtype
    compute_dtype: Dtype
    reduce_dtype: Dtype
    loss_scaling: Literal["none", "static", "dynamic"]


class HardwareProfile(Section):
    """One accelerator model: peaks per dtype (dense TFLOP/s), memory, formats, defaults, price."""

    name: str
    vendor: Literal["nvidia", "amd", "intel", "cpu"]
    match: list[str]
    measure_peak: bool = False
    peak_tflops: dict[Literal["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8"], float]
    memory_gib: float = Field(ge=0)
    memory_bandwidth_tbps: float = Field(gt=0)
    float8_formats: list[Literal["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]]
    native_mx: bool
    comm_backend: Literal["gloo", "nccl", "mpi", "xccl"]
    precision_defaults: PrecisionDefaults
    price_per_device_hour_usd: float = Field(ge=0)
    purchase_price_usd: float = Field(ge=0, description="buying one device (the accelerator alone), for `ferry cost`")
    power_kw: float = Field(gt=0, description="power one device draws at full load, its share of the node included")
    host_allocator: HostAllocator = Field(
        "default",
        description="keep_freed: the run's processes keep freed memory for reuse (ferry/platform/allocator.py)",
    )
    sources: list[str] = Field(min_length=1)
    measured: dict | None = Field(
        None, description="set by ferry, not in profile files: when and how a measured peak was measured"
    )

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; fp32 matmuls on tensor-core parts are counted at the fp32 rate."""
        if dtype not in self.peak_tflops:
            raise UserError(f"hardware profile {self.name!r} has no peak for {dtype}")
        return self.peak_tflops[dtype] * 1e12

    def supports(self, fmt: str) -> bool:
        """Whether the hardware runs `fp8` / `mxfp8` natively."""
        if fmt == "mxfp8":
            return self.native_mx
        if fmt == "fp8":
            return "fp8" in self.peak_tflops and self.vendor != "cpu"
        return True


def profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))


@cache
def load_profile(name: str) -> HardwareProfile:
    path = PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"hardware: unknown profile {name!r}; available: auto, {', '.join(profile_names())}")
    return validate(HardwareProfile, yaml.safe_load(path.read_text(encoding="utf-8")))


def resolve_profile(name: str, device: torch.device) -> HardwareProfile:
    """`auto` matches the device name against each profile's `match` list; CPU devices get `cpu`."""
    if name != "auto":
        return load_profile(name)
    if device.type == "cpu":
        return load_profile("cpu")
    module = getattr(torch, device.type)
    device_name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type
    for candidate in profile_names():
        profile = load_profile(candidate)
        if any(pattern.lower() in device_name.lower() for pattern in profile.match):
            return profile
    raise UserError(
        f"hardware: no profile matches device {device_name!r}; set hardware to one of {', '.join(profile_names())} "
        "or add a profile file to ferry/platform/profiles/"
    )


def measured_cpu_profile(cache_dir: Path | None = None) -> HardwareProfile:
    """The `cpu` profile with fp32, bf16 and fp16 peaks measured on this machine (cached per host and thread count),
    and the conditions of that measurement in `measured`."""
    entry = cpu_peak_entry(cache_dir)
    return with_measured_peak(load_profile("cpu"), entry, cache_dir)


def with_measured_peak(profile: HardwareProfile, entry: dict, cache_dir: Path | None = None) -> HardwareProfile:
    """`profile` with the peaks of a cache entry and where they come from."""
    conditions = {key: value for key, value in entry.items() if key != "peak_tflops"}
    measured = {**conditions, "cache": str(_peak_cache(cache_dir)), "key": _peak_key()}
    return profile.model_copy(
        update={"peak_tflops": {**profile.peak_tflops, **entry["peak_tflops"]}, "measured": measured}
    )


def cpu_peak_tflops(cache_dir: Path | None = None) -> dict[str, float]:
    """The peaks cached for this host, thread count and torch; measured and cached when there are none."""
    return cpu_peak_entry(cache_dir)["peak_tflops"]


def cpu_peak_entry(cache_dir: Path | None = None) -> dict:
    """The cache entry for this host, thread count and torch; measured and cached when there is none."""
    cached = cached_cpu_peak(cache_dir)
    return cached if cached is not None else measure_cpu_peak(cache_dir)


def peak_provenance(profile: HardwareProfile, dtype: str) -> dict:
    """Where the peak MFU is computed against comes from, for run.json and for the warning of an MFU above 100%:
    the profile file's figure, or a measurement with its time, load and threads."""
    provenance = {"dtype": dtype, "tflops": profile.peak_tflops.get(dtype), "profile": profile.name}
    if profile.measured is not None:
        return {**provenance, "kind": "measured", **profile.measured}
    return {**provenance, "kind": "profile", "file": str(PROFILE_DIR / f"{profile.name}.yaml")}


class MfuPeak:
    """The peak one device's FLOP/s are divided by for MFU, where it comes from, and, for a peak measured on this
    CPU, a way to measure it again when a run outpaces it (the measurement was taken cold or under load)."""

    def __init__(self, provenance: dict, remeasure: Callable[[], dict] | None = None):
        self.provenance = provenance
        self._remeasure = remeasure

    @classmethod
    def fixed(cls, flops: float, dtype: str = "fp32") -> MfuPeak:
        """A peak given as a number (tests, benchmarks): nothing to measure again."""
        return cls({"dtype": dtype, "tflops": flops / 1e12, "kind": "given"})

    @classmethod
    def of_profile(cls, profile: HardwareProfile, dtype: str, cache_dir: Path | None = None) -> MfuPeak:
        if profile.measured is None:
            return cls(peak_provenance(profile, dtype))

        def remeasure() -> dict:
            entry = measure_cpu_peak(cache_dir)
            return peak_provenance(with_measured_peak(profile, entry, cache_dir), dtype)

        return cls(peak_provenance(profile, dtype), remeasure)

    @property
    def flops(self) -> float:
        return self.provenance["tflops"] * 1e12

    @property
    def measurable(self) -> bool:
        return self._remeasure is not None

    def remeasure(self) -> None:
        """Measure again (the cache keeps the best figure ever measured, so the peak never drops)."""
        if self._remeasure is not None:
            self.provenance = self._remeasure()

    def describe(self) -> str:
        return describe_peak(self.provenance)


def describe_peak(provenance: dict) -> str:
    """One phrase naming a peak and its source, e.g. for a warning that it looks stale."""
    figure = f"{provenance['dtype']} peak {provenance['tflops'] * 1e3:.1f} GFLOP/s"
    if provenance["kind"] == "given":
        return f"the {figure} given"
    if provenance["kind"] == "measured":
        return (
            f"the {figure} measured {provenance.get('measured_at')} at load average {provenance.get('load_average')} "
            f"with {provenance.get('threads', '?')} thread(s), cached in {provenance['cache']}"
        )
    return f"the {figure} of hardware profile {provenance['profile']} ({provenance['file']})"


def cached_cpu_peak(cache_dir: Path | None = None) -> dict | None:
    """The cache entry for this machine (peaks, when and under what load they were measured), if any."""
    return _read_peak_cache(cache_dir).get(_peak_key())


def measure_cpu_peak(cache_dir: Path | None = None, seconds: float = 1.0, replace: bool = False) -> dict:
    """Measure fp32, bf16 and fp16 matmul peaks now with this process's threads, about `seconds` each, and cache
    them.

    A peak is a best case: a measurement taken while other work runs on the same cores
    understates it and so overstates every MFU computed from it. The cache therefore
    keeps, per dtype, the best figure ever measured for this host, thread count and
    torch (with the time and load average of that measurement) unless `replace` says
    to take this one alone, as after a hardware change that kept the host name.
    """
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    conditions = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    peaks = {name: _matmul_tflops(dtype, seconds) for name, dtype in dtypes.items()}
    entries = _read_peak_cache(cache_dir)
    previous = entries.get(_peak_key())
    if previous is not None and not replace:
        if previous["peak_tflops"].get("fp32", 0.0) >= peaks["fp32"]:
            conditions = {key: previous.get(key) for key in conditions}
        peaks = {name: max(value, previous["peak_tflops"].get(name, 0.0)) for name, value in peaks.items()}
    entry = {"peak_tflops": peaks, **conditions}
    entries[_peak_key()] = entry
    cache = _peak_cache(cache_dir)
    try:  # written whole under a private name, then renamed: a concurrent reader never sees half a file
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.with_name(f".{cache.name}.{os.getpid()}")
        staging.write_text(json.dumps(entries, indent=1))
        os.replace(staging, cache)
    except OSError:
        pass
    return entry


def _read_peak_cache(cache_dir: Path | None) -> dict[str, dict]:
    """Every cached entry by key (host, processor, thread count, torch): processes with other thread counts share it."""
    try:
        entries = json.loads(_peak_cache(cache_dir).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict) or "key" in entries:  # the single-entry layout of earlier versions
        return {}
    return {key: entry for key, entry in entries.items() if isinstance(entry, dict) and "peak_tflops" in entry}


def _peak_cache(cache_dir: Path | None) -> Path:
    return (cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ferry") / "cpu_peak.json"


def _peak_key() -> str:
    processor = platform.processor() or platform.machine()
    return f"{platform.node()}-{processor}-{torch.get_num_threads()}t-{torch.__version__}"


def _matmul_tflops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Best throughput of square matmuls of several sizes: the practical peak of this CPU for `dtype`.

    Both `torch.mm` and `F.linear` are timed and the faster counts: on a CPU without
    bf16 units they take different kernels (1.3 vs 16 GFLOP/s in bf16 on the
    development machine), and a peak below what the model reaches would put MFU above 1.
    """
    products = (torch.mm, torch.nn.functional.linear)  # a @ b and a @ b.T: the same FLOPs
    return max(_product_tflops(product, dtype, seconds / len(products)) for product in products)


_SIZES = (512, 1024, 2048)
_MIN_REPEATS = 3  # timed products per size after the warm-up: one product of a cold thread pool is no peak
_SLOW_PRODUCT_S = 0.05  # a size whose product takes longer ends the climb: a slow kernel is measured small


def _product_tflops(product, dtype: torch.dtype, seconds: float) -> float:
    """The best rate over sizes 512 to 2048, each the best of at least `_MIN_REPEATS` timed products (more while
    its share of `seconds` lasts) after a warm-up product.

    A single timing of a large product can land in a cold start (page faults, threads waking, a clock
    ramping up) and read at half the machine's rate: a peak measured so makes every MFU twice too high.
    """
    generator = torch.Generator().manual_seed(0)
    best = 0.0
    for size in _SIZES:
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        product(a, b)
        fastest, repeats = float("inf"), 0
        deadline = time.perf_counter() + seconds / len(_SIZES)
        while repeats < _MIN_REPEATS or time.perf_counter() < deadline:
            start = time.perf_counter()
            product(a, b)
            fastest = min(fastest, time.perf_counter() - start)
            repeats += 1
        best = max(best, 2 * size**3 / fastest / 1e12)
        if fastest > _SLOW_PRODUCT_S:
            break
    return best

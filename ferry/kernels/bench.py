"""The overhead budget, measured: every available implementation of every op, timed on fixed inputs.

Per op, the portable implementation and each vendor implementation available on
the device run forward + backward on the same tensor values (kernel time depends on
the values, not only the shapes); the figure that matters is the vendor/portable
time ratio. When the portable path loses more throughput than
`kernels.overhead_budget` against the best vendor implementation, that op may
take its vendor implementation through an approved ledger entry. The registry's
own cost, looking an op up and entering it through its bound function, is
measured too, against the time of the MoE layer it serves.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ferry.kernels.catalogue import REGISTRY
from ferry.kernels.config import KernelsConfig
from ferry.kernels.portable.low_precision import Recipe
from ferry.kernels.registry import PORTABLE, Implementation, Op, RecipeRefused, Registry
from ferry.kernels.selection import KernelSelection, bind, select_kernels

DISPATCH_LIMIT = 0.01


@dataclass(frozen=True)
class BenchShape:
    """Sizes of the bench inputs: by default one MoE layer of benchmarks/moe_layer.py."""

    tokens: int = 4096
    dim: int = 512
    ffn: int = 256
    experts: int = 64
    top_k: int = 8
    heads: int = 8
    kv_heads: int = 2
    seq_len: int = 512


@dataclass
class Timing:
    implementation: str
    seconds: float | None
    unavailable: str | None = None


@dataclass
class OpReport:
    op: str
    timings: list[Timing]

    @property
    def portable_seconds(self) -> float:
        return next(t.seconds for t in self.timings if t.implementation == PORTABLE)

    @property
    def fastest_vendor(self) -> Timing | None:
        measured = [t for t in self.timings if t.implementation != PORTABLE and t.seconds is not None]
        return min(measured, key=lambda t: t.seconds) if measured else None

    def portable_loss(self) -> float | None:
        """Throughput the portable path loses against the fastest vendor one (negative: portable is faster)."""
        vendor = self.fastest_vendor
        return None if vendor is None else 1.0 - vendor.seconds / self.portable_seconds

    def verdict(self, budget: float) -> str:
        loss = self.portable_loss()
        if loss is None:
            return "no vendor implementation available here"
        vendor = self.fastest_vendor.implementation
        if loss < 0:
            return f"portable is {-loss:.1%} faster than {vendor}: within the {budget:.0%} budget"
        if loss > budget:
            return (
                f"portable loses {loss:.1%} against {vendor}: over the {budget:.0%} budget, "
                "a ledger exception may apply"
            )
        return f"portable loses {loss:.1%} against {vendor}: within the {budget:.0%} budget"


@dataclass
class BenchReport:
    device: str
    shape: BenchShape
    budget: float
    ops: list[OpReport] = field(default_factory=list)
    layer_seconds: float = 0.0
    dispatches_per_layer: int = 0
    dispatch_seconds: float = 0.0

    @property
    def dispatch_fraction(self) -> float:
        return self.dispatches_per_layer * self.dispatch_seconds / self.layer_seconds

    def as_record(self) -> dict:
        """The figures as data, for the portability history that `ferry report` reads."""
        ops = []
        for report in self.ops:
            fastest = report.fastest_vendor
            ops.append(
                {
                    "op": report.op,
                    "timings": [asdict(timing) for timing in report.timings],
                    "portable_seconds": report.portable_seconds,
                    "fastest_vendor": None if fastest is None else fastest.implementation,
                    "portable_loss": report.portable_loss(),
                    "verdict": report.verdict(self.budget),
                }
            )
        return {
            "device": self.device,
            "shape": asdict(self.shape),
            "budget": self.budget,
            "ops": ops,
            "dispatch_fraction": self.dispatch_fraction,
        }

    def lines(self) -> list[str]:
        shape = self.shape
        out = [
            f"ferry kernels bench on {self.device}: forward + backward, medians over fixed inputs "
            f"({shape.tokens} tokens, dim {shape.dim}, expert width {shape.ffn}, {shape.experts} experts, "
            f"top-{shape.top_k}; attention: {shape.heads} query / {shape.kv_heads} key-value heads)"
        ]
        out.append(f"{'op':20s} {'implementation':28s} {'ms':>10s} {'vendor/portable':>16s}")
        for report in self.ops:
            for timing in report.timings:
                if timing.seconds is None:
                    row = f"{report.op:20s} {timing.implementation:28s} {'-':>10s}"
                    out.append(f"{row}  unavailable: {timing.unavailable}")
                    continue
                ratio = timing.seconds / report.portable_seconds
                out.append(f"{report.op:20s} {timing.implementation:28s} {timing.seconds * 1e3:10.2f} {ratio:16.3f}")
        out.append("budget:")
        out.extend(f"  {report.op}: {report.verdict(self.budget)}" for report in self.ops)
        verdict = "within" if self.dispatch_fraction < DISPATCH_LIMIT else "OVER"
        out.append(
            f"registry dispatch: {self.dispatches_per_layer} op call(s) per MoE layer forward x "
            f"{self.dispatch_seconds * 1e6:.2f} us = {self.dispatch_fraction:.5%} of the layer's "
            f"{self.layer_seconds * 1e3:.1f} ms forward + backward: {verdict} the {DISPATCH_LIMIT:.0%} limit"
        )
        return out


def run_bench(
    device: torch.device,
    budget: float,
    shape: BenchShape = BenchShape(),
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    recipes: dict[str, Recipe] | None = None,
) -> BenchReport:
    """Time every implementation of every op on `device` in `dtype`; unavailable ones are listed with the reason.

    `recipes` maps a low-precision op (`moe.fp8_grouped_mm`) to the recipe its calls
    carry; the precision layer supplies them, and an op without one is not timed.
    """
    portable = select_kernels(KernelsConfig(policy="portable"), device, dtype)
    auto = select_kernels(KernelsConfig(policy="auto"), device, dtype)
    cases = _cases(shape, device, dtype, portable, recipes or {})
    report = BenchReport(f"{device} ({dtype})", shape, budget)
    for op in REGISTRY:
        timings = []
        for impl in op.implementations:
            reason = impl.unavailable_reason(device, dtype) if op.name in cases else "no recipe given for its calls"
            if reason is not None:
                timings.append(Timing(impl.key, None, reason))
                continue
            fn = bind(impl, portable.functions)  # an op composed of others runs on their portable ones
            try:
                timings.append(Timing(impl.key, _time(cases[op.name], fn, repeats, device)))
            except RecipeRefused as refused:
                timings.append(Timing(impl.key, None, str(refused)))
        report.ops.append(OpReport(op.name, timings))
    layer_case = cases["moe.routed_experts"]
    report.layer_seconds = _time(layer_case, auto["moe.routed_experts"], repeats, device)
    report.dispatches_per_layer = _count_dispatches(layer_case, auto)
    report.dispatch_seconds = _dispatch_seconds()
    return report


@dataclass
class _Case:
    """Fixed inputs of one op, which of them get gradients, and the result's tensor to backpropagate."""

    args: tuple
    grad_args: tuple[int, ...]
    output: Callable = lambda result: result


def _cases(
    shape: BenchShape, device: torch.device, dtype: torch.dtype, portable: KernelSelection, recipes: dict[str, Recipe]
) -> dict[str, _Case]:
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=generator) * scale).to(device, dtype)

    tokens, dim, ffn, experts, top_k = shape.tokens, shape.dim, shape.ffn, shape.experts, shape.top_k
    scores_TE = torch.randn(tokens, experts, generator=generator).softmax(-1)
    weights_TK, expert_ids_TK = scores_TE.topk(top_k, dim=-1)
    weights_TK, expert_ids_TK = weights_TK.to(device, dtype), expert_ids_TK.to(device)
    counts_E = torch.bincount(expert_ids_TK.flatten(), minlength=experts)
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    x_TD = randn(tokens, dim)
    w_gate_EFD, w_up_EFD = randn(experts, ffn, dim, scale=0.02), randn(experts, ffn, dim, scale=0.02)
    w_down_EDF = randn(experts, dim, ffn, scale=0.02)
    x_ND, dispatch = portable["moe.permute"](x_TD, expert_ids_TK)
    x_ND = x_ND.detach()
    seq_len = min(shape.seq_len, tokens)
    batch, head_dim = tokens // seq_len, dim // shape.heads
    low_precision = {op: _Case((x_ND, w_gate_EFD, offsets_E, recipe), (0, 1)) for op, recipe in recipes.items()}
    return {
        **low_precision,
        "norm.rms": _Case((x_TD, randn(dim), 1e-5), (0, 1)),
        "linear": _Case((x_TD, randn(ffn, dim, scale=0.02)), (0, 1)),
        "attention": _Case(
            (
                randn(batch, shape.heads, seq_len, head_dim),
                randn(batch, shape.kv_heads, seq_len, head_dim),
                randn(batch, shape.kv_heads, seq_len, head_dim),
            ),
            (0, 1, 2),
        ),
        "attention.masked": _Case(
            (
                randn(batch, shape.heads, seq_len, head_dim),
                randn(batch, shape.kv_heads, seq_len, head_dim),
                randn(batch, shape.kv_heads, seq_len, head_dim),
                torch.ones(batch, seq_len, seq_len, dtype=torch.bool, device=device).tril(),
            ),
            (0, 1, 2),
        ),
        "moe.permute": _Case((x_TD, expert_ids_TK), (0,), output=lambda result: result[0]),
        "moe.grouped_mm": _Case((x_ND, w_gate_EFD, offsets_E), (0, 1)),
        "moe.expert_mlp": _Case((x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF), (0, 2, 3, 4)),
        "moe.combine": _Case((randn(tokens * top_k, dim), weights_TK, dispatch), (0, 1)),
        "moe.routed_experts": _Case(
            (x_TD, expert_ids_TK, weights_TK, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF), (0, 2, 4, 5, 6)
        ),
    }


def _time(case: _Case, fn: Callable, repeats: int, device: torch.device) -> float:
    """Median seconds of forward + backward, after one warm-up call that also fixes the output gradient.

    The inputs that take gradients are the same leaves in every call, their gradients
    dropped in between, as a training step drops its parameters' gradients.
    """
    grad = None
    seconds = []
    args = [arg.detach().requires_grad_() if index in case.grad_args else arg for index, arg in enumerate(case.args)]
    for attempt in range(repeats + 1):
        for index in case.grad_args:
            args[index].grad = None
        _synchronize(device)
        started = time.perf_counter()
        out = case.output(fn(*args))
        if grad is None:
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        out.backward(grad)
        _synchronize(device)
        if attempt:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work, so that a time covers the kernels and not only their launch."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _count_dispatches(case: _Case, selection: KernelSelection) -> int:
    """How many op implementations one MoE layer forward enters through the selection."""
    codes = {inspect.unwrap(impl.fn).__code__ for op in REGISTRY for impl in op.implementations}
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code in codes:
            calls += 1

    sys.setprofile(profile)
    try:
        selection["moe.routed_experts"](*case.args)
    finally:
        sys.setprofile(None)
    return calls


def _dispatch_seconds(calls: int = 50_000) -> float:
    """One look-up in a selection plus one call through the bound function of a composed op, no-op bodies."""

    def leaf() -> None:
        return None

    def composed(*, leaf) -> None:
        return leaf()

    registry = Registry(
        [
            Op("bench.leaf", "no-op", Implementation("bench.leaf", PORTABLE, leaf, "no-op")),
            Op(
                "bench.composed",
                "no-op calling bench.leaf",
                Implementation("bench.composed", PORTABLE, composed, "no-op", uses=("bench.leaf",)),
            ),
        ]
    )
    selection = select_kernels(KernelsConfig(policy="portable"), "cpu", registry=registry)
    started = time.perf_counter()
    for _ in range(calls):
        selection["bench.composed"]()
    through = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(calls):
        leaf()
    direct = time.perf_counter() - started
    return max(through - direct, 0.0) / calls

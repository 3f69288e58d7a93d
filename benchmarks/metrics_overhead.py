"""What the per-step metrics cost: timer regions, the record, and the MoE diagnostics, against step time.

The demo model (configs/tiny.yaml) trains on random tokens, one optimizer step over
two micro-batches. Two figures, in one run:

- direct: the cost of one empty timer region and of the per-step work (stop, record,
  MoE diagnostics), measured in isolation and multiplied by the regions a step
  opens, over the median step time. Stable even on a busy machine.
- A/B: median step time with all metrics on minus with them off, interleaved step by
  step (in alternating order) so both see the same machine load. Confirms the direct figure, but noise of a
  shared machine can exceed the cost being measured.

Each MoE layer's forward is wrapped in an `ep_wait` region holding a `comm` region, as
the expert-parallel dispatch will be, so the region count is that of an EP step.
Prints a summary and, last, one JSON line. Budget: 2% of step time.

    python benchmarks/metrics_overhead.py [--steps 30] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from ferry.metrics import StepMetrics, moe_diagnostics, router_entropy
from ferry.model import ModelConfig, Transformer, count_model
from ferry.model.moe import MoELayer

BUDGET = 0.02
REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per variant (after 3 warm-up steps)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"), help="run config whose model to use")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    run = yaml.safe_load(Path(args.config).read_text())
    config = ModelConfig.model_validate(run["model"])
    seq_len, global_batch, micro_batch = (
        run["data"]["seq_len"],
        run["train"]["global_batch"],
        run["train"]["micro_batch"],
    )
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens_BS = torch.randint(0, config.vocab_size, (global_batch, seq_len + 1), device=device)
    flops_per_token = count_model(config, seq_len).flops_per_token
    metrics = StepMetrics(device, world_size=1, flops_per_token=flops_per_token, peak_flops=1e12)
    regions = _instrument_moe_layers(model, metrics)

    def step(instrumented: bool) -> float:
        timer = metrics.timer
        region = timer.region if instrumented else _no_region
        regions.active = instrumented
        started = time.perf_counter()
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        counts_LE = torch.zeros(len(model.moe_layers()), config.moe.num_experts, device=device, dtype=torch.long)
        for rows in torch.split(tokens_BS, micro_batch):
            with region("forward"):
                output = model(rows[:, :-1])
                logits_TV = output.logits_BSV.reshape(-1, config.vocab_size).float()
                loss = F.cross_entropy(logits_TV, rows[:, 1:].reshape(-1))
            with region("backward"):
                loss.backward()
            for index, stats in enumerate(output.moe_stats):
                counts_LE[index] += stats.tokens_per_expert_E
        with region("optimizer"):
            optimizer.step()
        if instrumented:
            times = timer.stop()
            probs_LE = torch.full(counts_LE.shape, 1.0 / config.moe.num_experts, device=device)
            entropy_L = router_entropy(probs_LE).expand(counts_LE.shape[0])
            metrics.record(times, tokens=global_batch * seq_len) | moe_diagnostics(counts_LE, probs_LE, entropy_L)
        else:
            loss.item()
            if device.type != "cpu":
                torch.accelerator.synchronize(device)
        return time.perf_counter() - started

    for _ in range(3):
        step(True)
        step(False)
    plain, timed = [], []
    for index in range(args.steps):
        for instrumented in (False, True) if index % 2 else (True, False):
            (timed if instrumented else plain).append(step(instrumented))
    step_s = statistics.median(plain)
    ab_fraction = (statistics.median(timed) - step_s) / step_s

    regions.count = 0
    step(True)
    regions_per_step = regions.count + 3 * (global_batch // micro_batch) - 1
    region_s = _region_cost(metrics)
    fixed_s = _per_step_cost(metrics, counts_shape=(len(model.moe_layers()), config.moe.num_experts), device=device)
    direct_fraction = (regions_per_step * region_s + fixed_s) / step_s

    result = {
        "benchmark": "metrics_overhead",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model": Path(args.config).name,
        "step_s_median": round(step_s, 6),
        "regions_per_step": regions_per_step,
        "region_cost_us": round(region_s * 1e6, 3),
        "per_step_cost_us": round(fixed_s * 1e6, 1),
        "overhead_fraction": round(direct_fraction, 6),
        "ab_overhead_fraction": round(ab_fraction, 6),
        "budget_fraction": BUDGET,
        "within_budget": direct_fraction < BUDGET,
    }
    print(
        f"step {step_s * 1e3:.1f} ms (median of {args.steps}); {regions_per_step} regions at "
        f"{region_s * 1e6:.2f} us + {fixed_s * 1e6:.0f} us per step = {100 * direct_fraction:.3f}% of step time; "
        f"A/B difference {100 * ab_fraction:+.2f}% (noise of a shared machine included); budget {100 * BUDGET:.0f}%"
    )
    print(json.dumps(result))


class _MoERegions:
    """Opens `ep_wait` with a `comm` inside around every MoE layer's forward, while active."""

    def __init__(self):
        self.active = False
        self.count = 0
        self.stacks: dict[int, contextlib.ExitStack] = {}


def _instrument_moe_layers(model: torch.nn.Module, metrics: StepMetrics) -> _MoERegions:
    state = _MoERegions()

    def enter(module, _inputs):
        if state.active:
            stack = contextlib.ExitStack()
            stack.enter_context(metrics.timer.region("ep_wait"))
            stack.enter_context(metrics.timer.region("comm"))
            state.stacks[id(module)] = stack
            state.count += 2

    def leave(module, _inputs, _output):
        stack = state.stacks.pop(id(module), None)
        if stack is not None:
            stack.close()

    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(leave)
    return state


@contextlib.contextmanager
def _no_region(_name: str):
    yield


def _region_cost(metrics: StepMetrics, repeats: int = 20_000) -> float:
    """Seconds per empty region, read back included (the events of a device are read at stop)."""
    timer = metrics.timer
    timer.start()
    started = time.perf_counter()
    for _ in range(repeats):
        with timer.region("forward"):
            pass
    timer.stop()
    return (time.perf_counter() - started) / repeats


def _per_step_cost(metrics: StepMetrics, counts_shape: tuple[int, int], device: torch.device, repeats: int = 200):
    """Seconds of the fixed per-step work: stop (no regions), the record, the MoE diagnostics."""
    counts_LE = torch.randint(1, 100, counts_shape, device=device)
    probs_LE = torch.full(counts_shape, 1.0 / counts_shape[1], device=device)
    entropy_L = torch.ones(counts_shape[0], device=device)
    started = time.perf_counter()
    for _ in range(repeats):
        metrics.timer.start()
        metrics.record(metrics.timer.stop(), tokens=1) | moe_diagnostics(counts_LE, probs_LE, entropy_L)
    return (time.perf_counter() - started) / repeats


if __name__ == "__main__":
    main()

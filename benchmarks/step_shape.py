"""What activation checkpointing and casting weights once a step keep, move and cost: the CPU-measurable part.

Three measures on one model (default: the demo's, `configs/tiny.yaml`), each against its reference in the same run:

1. kept: bytes a forward keeps for its backward per token and block (`ferry/metrics/kept_memory.py`, fp32 so no
   weight copies are among them), for `train.activation_checkpointing` none / selective / full, against the
   memory model's estimate (`ferry/train/memory.py`) and against none;
2. traffic: bytes of parameter-proportional work in one step (weight casts, gradient casts and adds, counted op
   by op, `ferry/metrics/parameter_traffic.py`), bf16 compute on fp32 weights, for 1, 2, 4 and 8 micro-batches,
   weights cast per use (autocast) or once a step (`precision.weight_casts`), against one micro-batch;
3. time: forward and backward of a step on this CPU, each mode against none and each cast schedule against
   per use, medians of `--repeats` (2 cores: the recompute's cost, not a GPU's).

    python benchmarks/step_shape.py [--config configs/tiny.yaml] [--tokens 2048] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ferry.config.loader import load_config  # noqa: E402
from ferry.kernels import select_kernels  # noqa: E402
from ferry.kernels.config import KernelsConfig  # noqa: E402
from ferry.metrics.kept_memory import KeptMemory  # noqa: E402
from ferry.metrics.parameter_traffic import ParameterTraffic  # noqa: E402
from ferry.model import Transformer  # noqa: E402
from ferry.precision.step_weights import StepWeights  # noqa: E402
from ferry.train.config import RunConfig  # noqa: E402
from ferry.train.memory import kept_bytes_per_token_layer  # noqa: E402

MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)


def build(config: RunConfig, mode: str = "none") -> Transformer:
    """The config's model on the kernels a checkpointed run takes (the CPU's fused experts cannot be replayed), so
    every mode runs the same kernels."""
    kernels = select_kernels(KernelsConfig(), "cpu", torch.float32, replayed=True)
    torch.manual_seed(0)
    return Transformer(config.model, kernels, recompute=mode)


def kept(config: RunConfig, tokens: int) -> dict:
    fp32 = config.model_copy(update={"precision": config.precision.model_copy(update={"compute_dtype": "fp32"})})
    figures = {}
    for mode in MODES:
        model = build(config, mode)
        with KeptMemory() as memory:
            h_BSD = torch.randn(1, tokens, config.model.dim, requires_grad=True)
            for block in model.layers:
                h_BSD, _ = block(h_BSD)
        measured = (memory.kept_bytes() - h_BSD.numel() * 4) / (tokens * config.model.n_layers)
        estimated = kept_bytes_per_token_layer(fp32, mode, compute_bytes=4)
        figures[mode] = {
            "measured": round(measured),
            "estimated": estimated,
            "measured_vs_estimate": measured / estimated,
        }
    for mode in MODES:
        figures[mode]["vs_none"] = figures[mode]["measured"] / figures["none"]["measured"]
    return figures


def _step(model: Transformer, tokens_BS: torch.Tensor, micro_batches: int, step_weights: StepWeights | None) -> None:
    for micro_BS in tokens_BS.split(tokens_BS.shape[0] // micro_batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if step_weights is not None:
                step_weights.hold()
            loss = model(micro_BS).logits_BSV.float().logsumexp(-1).mean()
        loss.backward()
    if step_weights is not None:
        step_weights.release()
    for param in model.parameters():
        param.grad = None


def traffic(config: RunConfig, tokens_BS: torch.Tensor) -> dict:
    figures = {}
    model = build(config)
    for casts in ("micro_batch", "step"):
        for micro_batches in MICRO_BATCHES:
            step_weights = StepWeights(model, torch.bfloat16) if casts == "step" else None
            with ParameterTraffic(model) as counted:
                _step(model, tokens_BS, micro_batches, step_weights)
            figures[f"{casts}/{micro_batches}"] = dict(counted.bytes)
    for key, value in figures.items():
        one = figures[f"{key.split('/')[0]}/1"]
        value["casts_vs_one_micro_batch"] = value.get("weight_casts", 0) / one["weight_casts"]
    return figures


def timing(config: RunConfig, tokens_BS: torch.Tensor, repeats: int) -> dict:
    """Medians of `repeats` steps of each set-up, taken in turn (one step of each, then again) so that the
    machine's drift (2 shared cores) falls on all of them alike."""
    micro_batches = 2
    setups = {mode: (build(config, mode), "step") for mode in MODES}
    setups["casts_per_use"] = (build(config), "micro_batch")
    weights = {
        name: StepWeights(model, torch.bfloat16) if casts == "step" else None for name, (model, casts) in setups.items()
    }
    times: dict[str, list[float]] = {name: [] for name in setups}
    for round_ in range(repeats + 1):
        for name, (model, _) in setups.items():
            started = time.perf_counter()
            _step(model, tokens_BS, micro_batches, weights[name])
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        **{f"{name}_s": round(seconds, 4) for name, seconds in median.items()},
        **{f"{mode}_vs_none": median[mode] / median["none"] for mode in MODES[1:]},
        "casts_once_vs_per_use": median["none"] / median["casts_per_use"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument(
        "--tokens",
        type=int,
        default=5120,
        help="tokens of a step; the default gives micro-batches of 5,120 to 640 tokens, none shaped like a weight",
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = load_config(RunConfig, args.config, [])
    seq_len = config.data.seq_len
    tokens_BS = torch.randint(
        0, config.model.vocab_size, (args.tokens // seq_len, seq_len), generator=torch.Generator().manual_seed(0)
    )
    results = {
        "kept": kept(config, seq_len),
        "traffic": traffic(config, tokens_BS),
        "time": timing(config, tokens_BS, args.repeats),
    }
    if args.json:
        print(json.dumps(results))
        return
    print(f"kept for the backward, bytes per token and block ({Path(args.config).name}, fp32, {seq_len} tokens)")
    for mode, figure in results["kept"].items():
        print(
            f"  {mode:<9} {figure['measured']:>7,}  estimate {figure['estimated']:>7,}  "
            f"measured/estimate {figure['measured_vs_estimate']:.2f}  vs none {figure['vs_none']:.2f}"
        )
    print(f"parameter-proportional bytes of one step of {args.tokens:,} tokens (bf16 compute, fp32 weights)")
    for key, figure in results["traffic"].items():
        casts, micro = key.split("/")
        print(
            f"  casts {casts:<11} {micro} micro-batch(es): weight and gradient casts "
            f"{figure.get('weight_casts', 0):>11,} ({figure['casts_vs_one_micro_batch']:.1f}x one)  "
            f"gradient adds {figure.get('gradient_adds', 0):>11,}"
        )
    timed = results["time"]
    print(f"one step on this CPU, 2 micro-batches, bf16 (median of {args.repeats})")
    print(
        f"  none {timed['none_s']} s, selective {timed['selective_s']} s ({timed['selective_vs_none']:.2f}x), "
        f"full {timed['full_s']} s ({timed['full_vs_none']:.2f}x); "
        f"weights cast per use {timed['casts_per_use_s']} s, "
        f"once a step {timed['none_s']} s ({timed['casts_once_vs_per_use']:.2f}x)"
    )


if __name__ == "__main__":
    main()

"""Expert scaling at fixed active compute: does ferry's MoE layer keep its speed as experts grow?

Every configuration does the same FLOPs per token (top-4 of experts with hidden
width 256 at model dim 512); only the number of experts E changes, from 8 to 128,
so the total expert parameters grow 16x and each expert's share of the tokens
shrinks 16x. OLMo-core 3 reports under 5% throughput loss from 8 to 128 experts
at fixed active parameters on GPUs. Each figure is forward + backward tokens/s of
one MoE layer with the kernels `--policy` selects for the CPU, relative to E=8 at
the same token count; configurations run in turn, medians over `--repeats` rounds
after one warm-up round, identical input values for every E. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from ferry.kernels import KernelsConfig, select_kernels
from ferry.model import MoEConfig, MoELayer
from ferry.platform.allocator import apply_host_allocator

DIM, FFN, TOP_K = 512, 256, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--policy", choices=["auto", "portable"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--host-allocator",
        choices=["default", "keep_freed"],
        default="default",
        help="keep_freed: the CPU profile's preset (ferry/platform/allocator.py), applied before anything runs",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allocator = apply_host_allocator(args.host_allocator)

    kernels = select_kernels(KernelsConfig(policy=args.policy), "cpu")
    layers = {experts: _layer(experts, kernels) for experts in args.experts}
    generator = torch.Generator().manual_seed(1)
    inputs = {
        tokens: (torch.randn(1, tokens, DIM, generator=generator), torch.randn(1, tokens, DIM, generator=generator))
        for tokens in args.tokens
    }
    times = {(experts, tokens): [] for tokens in args.tokens for experts in args.experts}
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for round_index in range(args.repeats + 1):
        for experts, tokens in times:
            started = time.perf_counter()
            _step(layers[experts], *inputs[tokens])
            if round_index:  # round 0 warms every configuration up
                times[experts, tokens].append(time.perf_counter() - started)

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    rows = []
    for (experts, tokens), seconds in times.items():
        tok_s = tokens / statistics.median(seconds)
        base = tokens / statistics.median(times[args.experts[0], tokens])
        rows.append(
            {"experts": experts, "tokens": tokens, "tok_s": round(tok_s, 1), "ratio_vs_8": round(tok_s / base, 3)}
        )
    for row in rows:
        print(json.dumps(row))
    summary = {
        "experts": args.experts,
        "tokens": args.tokens,
        "tok_s": [row["tok_s"] for row in rows],
        "ratio_vs_8": [row["ratio_vs_8"] for row in rows],
        **{
            f"min_ratio_{tokens}": min(row["ratio_vs_8"] for row in rows if row["tokens"] == tokens)
            for tokens in args.tokens
        },
        "kernels": kernels.choices["moe.routed_experts"].implementation.key,
        "policy": args.policy,
        "threads": args.threads,
        "repeats": args.repeats,
        "host_allocator": allocator,
        "minor_faults_per_round": round(faults / (args.repeats + 1)),
    }
    print(json.dumps(summary))


def _layer(experts: int, kernels) -> MoELayer:
    layer = MoELayer(DIM, MoEConfig(num_experts=experts, top_k=TOP_K, expert_ffn_dim=FFN), kernels)
    generator = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return layer


def _step(layer: MoELayer, x_BSD: torch.Tensor, grad_BSD: torch.Tensor) -> None:
    """One forward and backward from a fresh input leaf; gradients are dropped as a training step would."""
    x_BSD = x_BSD.clone().requires_grad_()
    y_BSD, _ = layer(x_BSD)
    y_BSD.backward(grad_BSD)
    layer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()

"""MoE layer throughput, forward + backward: ferry against transformers' OLMoE block and the dense limit.

One process, one set of weights and inputs for every contender (kernel time depends
on the values, not only the shapes):

- ferry: `MoELayer` with the kernels `--policy` selects for the CPU (`auto`: the
  ledger-approved CPU implementation; `portable`: pure PyTorch everywhere);
- hf: `OlmoeSparseMoeBlock` of `transformers` with its fastest experts
  implementation, `grouped_mm` (`torch._grouped_mm` underneath), same weights;
- dense limit: plain matmuls with the FLOPs of the active experts, a SwiGLU of
  width top_k x expert width over all tokens, which no routed layer can beat.

The contenders run in turn (ferry, hf, dense, ferry, ...) so a drift in machine speed
hits all of them; each figure is the median over `--repeats` rounds after one warm-up round. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from ferry.kernels import KernelsConfig, select_kernels
from ferry.model import MoEConfig, MoELayer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256, help="expert hidden width")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--policy", choices=["auto", "portable"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kernels = select_kernels(KernelsConfig(policy=args.policy), "cpu")
    generator = torch.Generator().manual_seed(0)
    ours = MoELayer(args.dim, MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_ffn_dim=args.ffn), kernels)
    with torch.no_grad():
        for param in ours.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    theirs = _olmoe_block(ours, args)
    width = args.top_k * args.ffn
    dense_weights = [
        (torch.randn(shape, generator=generator) * 0.02).requires_grad_()
        for shape in ((args.dim, width), (args.dim, width), (width, args.dim))
    ]
    x_BSD = torch.randn(1, args.tokens, args.dim, generator=generator)
    grad_BSD = torch.randn(1, args.tokens, args.dim, generator=generator)

    y_ours = _step(lambda x: ours(x)[0], x_BSD, grad_BSD, ours)
    y_theirs = _step(theirs, x_BSD, grad_BSD, theirs)
    agreement = ((y_ours - y_theirs).norm() / y_theirs.norm()).item()

    def dense(x_BSD: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = dense_weights
        return (F.silu(x_BSD @ w_gate) * (x_BSD @ w_up)) @ w_down

    contenders = {
        "ferry": lambda: _step(lambda x: ours(x)[0], x_BSD, grad_BSD, ours),
        "hf": lambda: _step(theirs, x_BSD, grad_BSD, theirs),
        "dense": lambda: _step(dense, x_BSD, grad_BSD, None, dense_weights),
    }
    times = {name: [] for name in contenders}
    for round_index in range(args.repeats + 1):
        for name, run in contenders.items():
            started = time.perf_counter()
            run()
            if round_index:  # round 0 warms every contender up
                times[name].append(time.perf_counter() - started)
    tok_s = {name: args.tokens / statistics.median(seconds) for name, seconds in times.items()}
    result = {
        "ferry_tok_s": round(tok_s["ferry"], 1),
        "hf_tok_s": round(tok_s["hf"], 1),
        "dense_limit_tok_s": round(tok_s["dense"], 1),
        "speedup_vs_hf": round(tok_s["ferry"] / tok_s["hf"], 3),
        "efficiency_vs_dense": round(tok_s["ferry"] / tok_s["dense"], 3),
        "ferry_vs_hf_relative_error": agreement,
        "kernels": kernels.choices["moe.routed_experts"].implementation.key,
        "policy": args.policy,
        "tokens": args.tokens,
        "dim": args.dim,
        "ffn": args.ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "threads": args.threads,
        "repeats": args.repeats,
        "seconds": {name: [round(s, 4) for s in seconds] for name, seconds in times.items()},
    }
    print(json.dumps(result))


def _olmoe_block(ours: MoELayer, args: argparse.Namespace) -> OlmoeSparseMoeBlock:
    config = OlmoeConfig(
        hidden_size=args.dim, intermediate_size=args.ffn, num_experts=args.experts, num_experts_per_tok=args.top_k
    )
    # what from_pretrained(..., experts_implementation="grouped_mm") sets; the standalone block reads it
    config._experts_implementation = "grouped_mm"
    block = OlmoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight_ED)
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.w_gate_EFD, ours.experts.w_up_EFD], dim=1))
        block.experts.down_proj.copy_(ours.experts.w_down_EDF)
    return block


def _step(forward, x_BSD, grad_BSD, module, params=()) -> torch.Tensor:
    """One forward and backward from a fresh input leaf; gradients are dropped as a training step would."""
    x_BSD = x_BSD.clone().requires_grad_()
    y_BSD = forward(x_BSD)
    y_BSD.backward(grad_BSD)
    if module is not None:
        module.zero_grad(set_to_none=True)
    for param in params:
        param.grad = None
    return y_BSD.detach()


if __name__ == "__main__":
    main()

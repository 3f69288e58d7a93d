"""Regional compilation: each transformer block compiled on its own (`train.compile: blocks`).

Blocks rather than the whole model: every block runs the same code on the same shapes, so one
compiled graph serves them all (their parameters are graph inputs) and compile time is that of one
block; the embedding, the output head and the loss stay eager, where there is little to fuse. What
cannot be traced inside a block (a kernel implementation that reads its group sizes on the host, the
expert-parallel all-to-all) runs eagerly between compiled parts, a graph break, rather than being
compiled again for every set of group sizes. Decoding with a cache stays eager (`generate`).
"""

from __future__ import annotations

from typing import Literal

import torch

from ferry.kernels.dispatch import host_reads

Compile = Literal["auto", "none", "blocks"]


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (torch.compile's own accounting: tracing, the forward's
    and the backward's graphs), so a step's figures can tell compiling from computing."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    spent = dict(zip(names, (float(value) for value in values)))
    return spent.get("_compile.compile_inner", 0.0) + sum(
        seconds for name, seconds in spent.items() if "bw_compiler" in name
    )


def compile_blocks(model, mode: Compile, expert_parallel: bool = False) -> dict:
    """Compile `model`'s blocks in place as `mode` says; what run.json records about it, with what runs
    eagerly inside the blocks (`expert_parallel`: the experts run behind the all-to-all dispatcher)."""
    if mode == "none":
        return {"mode": "none"}
    for block in model.layers:
        block.compile()
    if expert_parallel:
        eager = ["the expert-parallel dispatcher (all-to-all and the local experts)"]
    elif model.moe_layers():
        eager = _host_reading_parts(model.kernels, "moe.routed_experts")
    else:
        eager = []
    return {
        "mode": mode,
        "regions": len(model.layers),
        "backend": "inductor",
        "torch": torch.__version__,
        "eager_ops": eager,
    }


def _host_reading_parts(kernels, op: str) -> list[str]:
    """`op`'s chosen implementation if it reads on the host, else those of the sub-ops it is composed of."""
    choice = kernels.choices[op]
    if host_reads(choice.fn):
        return [f"{op}={choice.implementation.key}"]
    return [part for sub in choice.implementation.uses for part in _host_reading_parts(kernels, sub)]

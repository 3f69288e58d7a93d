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

Compile = Literal["none", "blocks"]


def compile_blocks(model, mode: Compile) -> dict:
    """Compile `model`'s blocks in place as `mode` says; what run.json records about it."""
    if mode == "none":
        return {"mode": "none"}
    for block in model.layers:
        block.compile()
    eager = [
        f"{op}={choice.implementation.key}" for op, choice in model.kernels.choices.items() if host_reads(choice.fn)
    ]
    return {
        "mode": mode,
        "regions": len(model.layers),
        "backend": "inductor",
        "torch": torch.__version__,
        "eager_ops": eager,
    }

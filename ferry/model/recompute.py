"""Activation checkpointing (`train.activation_checkpointing`): blocks recomputed in the backward, to keep less.

Without it, every block keeps what its backward reads from the end of its forward to its backward: at the
OLMoE-1B-7B shape about 6 GiB per 4,096-token sequence, so one H200 holds one sequence a micro-batch and every
parameter is cast, and its gradient accumulated, once per sequence. With it:

- `full` keeps only each block's input; the backward runs the block again before differentiating it.
- `selective` keeps what is expensive to produce again (the outputs of the GEMMs, grouped GEMMs and the
  attention kernels) and recomputes the rest: norms, activations, rotary embeddings, casts and the other
  element-wise work, cheap in FLOPs and a large share of the bytes kept.

Both keep the router's top-k choice (a recompute routes identically, whatever the last bits of its scores),
the host reads (the group sizes and split sizes read on the host: no second device sync), and the expert-
parallel exchange: its collectives are not issued again, their output is the first run's
(`ferry.comm.collectives`). Both are `torch.utils.checkpoint`'s non-reentrant checkpoint with a selective
policy, so they compose with autocast, compiled blocks (the policy is applied by the compiler's partitioner),
expert parallelism and FSDP. The recompute runs the same ops on the same inputs, so on one machine a
checkpointed run equals the plain run bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ferry.comm.replay import replay
from ferry.kernels.recompute_policy import KEEP_POLICIES

Recompute = Literal["none", "full", "selective"]


def recomputed(fn: Callable, mode: Recompute, *args):
    """`fn(*args)`, its activations kept as `mode` says and the rest recomputed in the backward.

    Run eagerly, the second run of `fn` is marked a replay (for the collectives' statistics); a compiled block has
    no collectives inside its graph (they break it) and traces `fn` itself, without the counter's side effect.
    """
    contexts = partial(create_selective_checkpoint_contexts, KEEP_POLICIES[mode])
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)
    runs = 0

    def run(*inputs):
        nonlocal runs
        runs += 1
        with replay(runs > 1):
            return fn(*inputs)

    return checkpoint(run, *args, use_reentrant=False, context_fn=contexts)


def activation_checkpointing_record(mode: Recompute, blocks: int) -> dict:
    """What run.json records of `mode`, which the model's `blocks` were built with (`Transformer(recompute=)`)."""
    if mode == "none":
        return {"mode": "none"}
    kept = "block inputs, router top-k, host reads, expert-parallel exchanges"
    if mode == "selective":
        kept += ", GEMM and attention outputs"
    return {"mode": mode, "blocks": blocks, "kept": kept}

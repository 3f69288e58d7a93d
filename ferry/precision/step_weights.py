"""Compute-dtype copies of the weights, made once per optimizer step and held across its micro-batches.

With fp32 parameters and bf16 compute, autocast casts every weight at every use, and the backward turns each
bf16 weight gradient into an fp32 tensor before adding it to `.grad`: per micro-batch, a read of the fp32
weights, a write of their bf16 copy, a cast of the gradient and an fp32 add, all proportional to the parameter
count. At the OLMoE-1B-7B shape (6.9B parameters, one 4,096-token sequence a micro-batch, 8 a step) that
traffic, not the GEMMs, took most of the step. Here:

- at the first forward of a step, each weight that a GEMM reads (the modules name them in `COMPUTE_WEIGHTS`) is
  cast once, and the model sees the copy in place of the parameter until the optimizer step (`release`);
- each copy's gradient is added straight into the parameter's fp32 `.grad` by one fused kernel (`add_` of a
  bf16 tensor into an fp32 one converts as it reads), Megatron's `main_grad`; the first micro-batch writes it.

The values are those autocast computes (the same cast, the same fp32 sums in the same order), so a run is bit
for bit the run without it. Memory: the copies live from the first forward to the optimizer step, 2 bytes a
parameter; without them the same copies are made per micro-batch and kept by autograd for the backward, so
the peak (the end of a forward) holds them either way.

What remains per micro-batch is the fused accumulate, a read of the bf16 gradient and a read and write of the
fp32 one; removing it takes a weight-gradient GEMM that accumulates in fp32 into `.grad` (the CPU experts
kernel does, `ferry/kernels/vendor/cpu_fused_experts.py`) or fewer, larger micro-batches
(`train.micro_batch: auto` with activation checkpointing).
"""

from __future__ import annotations

import torch
from torch import nn


class StepWeights:
    """The compute-dtype copies of `model`'s GEMM weights for the current step (none outside a step)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        shared = _shared_parameters(model)
        self.slots = [
            (module, name, module._parameters[name])
            for module in model.modules()
            for name in getattr(module, "COMPUTE_WEIGHTS", ())
            if module._parameters.get(name) is not None and id(module._parameters[name]) not in shared
        ]
        self.held = False

    @property
    def parameters(self) -> int:
        return sum(param.numel() for _, _, param in self.slots)

    def hold(self) -> None:
        """Put the copies in place of the parameters (made now, at a step's first forward; kept until `release`)."""
        if self.held:
            return
        with torch.enable_grad():  # the first forward of a step may be a no-grad one (a rollout); the backward comes
            for module, name, param in self.slots:
                copy = param.detach().to(self.dtype)
                module._parameters[name] = _GradientIntoParameter.apply(param, copy) if param.requires_grad else copy
        self.held = True

    def release(self) -> None:
        """The parameters back in place, before anything reads or updates them (the optimizer step, a checkpoint)."""
        if not self.held:
            return
        for module, name, param in self.slots:
            module._parameters[name] = param
        self.held = False


class _GradientIntoParameter(torch.autograd.Function):
    """The copy, as seen by the forward; its gradient goes into the parameter's fp32 `.grad`, not through autograd.

    One node serves every micro-batch of the step: it saves no tensors, so each backward may pass through it.
    """

    @staticmethod
    def forward(ctx, param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.param = param
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        param = ctx.param
        if param.grad is None:
            param.grad = grad.to(param.dtype, memory_format=torch.contiguous_format)
        else:
            param.grad.add_(grad)
        return None, None


def _shared_parameters(model: nn.Module) -> set[int]:
    """Parameters reached under more than one name (a tied embedding and head): left to autocast, since one of
    their uses (the embedding lookup) reads them in their own dtype."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}

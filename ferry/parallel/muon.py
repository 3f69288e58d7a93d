"""Muon for mixture-of-experts models: the hidden weight matrices orthogonalised, AdamW for the rest.

Muon (Jordan et al. 2024; at scale, Moonlight and Kimi K2) keeps one momentum buffer per weight matrix and steps
along its orthogonalisation, computed by a few Newton-Schulz iterations. The matrices of attention, the dense
feed-forward blocks, the shared expert and the routed experts take Muon; the embedding, the head, the norms and
the routers take AdamW, as Moonlight does. The experts of a layer are one 3D parameter, a batch of matrices: each
expert's matrix is orthogonalised on its own, in one batched iteration.

The update, per matrix W of shape [A, B] (out, in) with gradient G, already unscaled and clipped:

    buffer <- buffer + (1 - momentum) * (G - buffer)          PyTorch's form: an exponential moving average
    M      <- G + momentum * (buffer - G) with Nesterov, else buffer
    O      <- NewtonSchulz(M)                                  quintic, `ns_steps` iterations, in `ns_dtype`
    W      <- W * (1 - lr * weight_decay) - lr * scale(A, B) * O

`scale` is `match_rms_adamw` (0.2 * sqrt(max(A, B)), Moonlight's: the update's RMS that of AdamW's, so AdamW's
learning rate and weight decay carry over) or `original` (sqrt(max(1, A / B)), Keller Jordan's). For a 2D matrix in
bf16 every operation is torch.optim.Muon's, so the two agree (tests/test_muon.py).

One optimizer object holds both: torch's AdamW steps the AdamW groups over the same group dicts and the same
state, so the learning-rate schedule sets every group alike and a checkpoint finds each parameter's state (AdamW's
`exp_avg`, `exp_avg_sq`, `step`; Muon's `momentum_buffer`) under its logical name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ferry.parallel.adamw import fused_where_available

# Keller Jordan's quintic coefficients (torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
UpdateScale = Literal["match_rms_adamw", "original"]
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class MuonSettings:
    """What Muon needs besides AdamW's settings: which parameters it updates (`matrices`, by name), its momentum,
    Newton-Schulz's steps and dtype (`bf16` or `fp32`), and the update's scale."""

    matrices: frozenset[str]
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_dtype: Literal["bf16", "fp32"]
    update_scale: UpdateScale


def muon_parameter_names(model: nn.Module) -> set[str]:
    """The hidden weight matrices Muon updates: every parameter of two or more dimensions but the token embedding,
    the head and the routers (which, like the norms, take AdamW)."""
    return {
        name
        for name, param in model.named_parameters()
        if param.ndim >= 2 and not name.startswith(("tok_embeddings.", "output.")) and ".router." not in name
    }


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the parameters `settings.matrices` names, AdamW (`adamw`: its settings) over the others of
    `params`; `decayed` names the parameters with weight decay."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        decayed: set[str],
        weight_decay: float,
        settings: MuonSettings,
        **adamw,
    ):
        matrices = [(n, p) for n, p in params if n in settings.matrices]
        others = [(n, p) for n, p in params if n not in settings.matrices]
        lr = adamw.get("lr", 1e-3)
        adamw_groups = [
            {"params": [p for n, p in others if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in others if n not in decayed], "weight_decay": 0.0},
        ]
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw, **fused_where_available([p for _, p in others]))
        muon = {
            "optimizer": "muon", "momentum": settings.momentum, "nesterov": settings.nesterov,
            "ns_steps": settings.ns_steps, "ns_dtype": settings.ns_dtype, "update_scale": settings.update_scale,
        }
        muon_groups = [
            {"params": [p for n, p in matrices if n in decayed], "weight_decay": weight_decay, **muon},
            {"params": [p for n, p in matrices if n not in decayed], "weight_decay": 0.0, **muon},
        ]
        for group in self._adamw.param_groups:
            group["optimizer"] = "adamw"
        groups = [group for group in [*self._adamw.param_groups, *muon_groups] if group["params"]]
        super().__init__(groups, {"lr": lr})
        self._adamw.state = self.state  # one state: each parameter's under its own keys

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW takes no closure")
        self._adamw.step()
        for group in self.param_groups:
            if group["optimizer"] != "muon":
                continue
            for param in group["params"]:
                if param.grad is not None:
                    self._muon_step(param, group)

    def _muon_step(self, param: nn.Parameter, group: dict) -> None:
        grad = param.grad
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        orthogonal = _orthogonal_in_place_of(param, update, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonal, alpha=-lr * update_scale(group["update_scale"], param.shape[-2:]))


def _orthogonal_in_place_of(param: nn.Parameter, update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`update` orthogonalised as a whole matrix, laid out as `param` is: an FSDP shard (a DTensor) gathers the
    whole update, orthogonalises it on every rank alike and keeps its own rows of the result."""
    if not isinstance(update, DTensor):
        return orthogonalise(update, steps, dtype)
    whole = orthogonalise(update.full_tensor(), steps, dtype)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))].contiguous()
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def update_scale(kind: UpdateScale, shape: torch.Size) -> float:
    """The factor on the learning rate of a matrix of `shape` [out, in]."""
    rows, columns = shape
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, columns))
    return math.sqrt(max(1.0, rows / columns))


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U V^T for `update` = U S V^T, of each matrix of a batch
    [..., A, B] on its own, in `dtype` (returned in it). Each matrix is scaled to Frobenius norm 1 first, so its
    spectral norm is at most 1; the wide orientation keeps the Gram matrix the smaller one."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.shape[-2] > update.shape[-1]
    if tall:
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's operations, one by one
        x = x.div(x.norm().clamp(min=NS_EPS))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x

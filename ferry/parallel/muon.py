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

from ferry.comm import Collectives
from ferry.model.parameter_kinds import is_bias
from ferry.parallel.adamw import fused_where_available
from ferry.parallel.muon_fsdp import orthogonalised_shards
from ferry.parallel.newton_schulz import NS_DTYPES, orthogonalise

UpdateScale = Literal["match_rms_adamw", "original"]


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
    the head, the routers and the experts' biases (which, like the norms, take AdamW)."""
    return {
        name
        for name, param in model.named_parameters()
        if param.ndim >= 2
        and not name.startswith(("tok_embeddings.", "output."))
        and ".router." not in name
        and not is_bias(name)
    }


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the parameters `settings.matrices` names, AdamW (`adamw`: its settings) over the others of
    `params`; `decayed` names the parameters with weight decay. FSDP-sharded matrices (DTensors) are orthogonalised
    by one owner among the ranks of `shard_owners` each (`ferry/parallel/muon_fsdp.py`)."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        decayed: set[str],
        weight_decay: float,
        settings: MuonSettings,
        shard_owners: Collectives | None = None,
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
            "optimizer": "muon",
            "momentum": settings.momentum,
            "nesterov": settings.nesterov,
            "ns_steps": settings.ns_steps,
            "ns_dtype": settings.ns_dtype,
            "update_scale": settings.update_scale,
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
        self._shard_owners = shard_owners

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW takes no closure")
        self._adamw.step()
        for group in self.param_groups:
            if group["optimizer"] != "muon":
                continue
            steps, dtype = group["ns_steps"], NS_DTYPES[group["ns_dtype"]]
            sharded = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = self._momentum_update(param, group)
                if isinstance(update, DTensor):
                    sharded.append((param, update))  # orthogonalised together, each by one owner
                else:
                    self._apply(param, orthogonalise(update, steps, dtype), group)
            if sharded:
                shards = orthogonalised_shards([update for _, update in sharded], steps, dtype, self._shard_owners)
                for (param, _), local in zip(sharded, shards, strict=True):
                    orthogonal = DTensor.from_local(
                        local,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                    self._apply(param, orthogonal, group)

    def _momentum_update(self, param: nn.Parameter, group: dict) -> torch.Tensor:
        """The momentum buffer stepped with the gradient, and the update it gives (Nesterov's or the buffer)."""
        grad = param.grad
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    @staticmethod
    def _apply(param: nn.Parameter, orthogonal: torch.Tensor, group: dict) -> None:
        """Decoupled weight decay, then the step along the orthogonalised update at the matrix's scale."""
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonal, alpha=-lr * update_scale(group["update_scale"], param.shape[-2:]))


def update_scale(kind: UpdateScale, shape: torch.Size) -> float:
    """The factor on the learning rate of a matrix of `shape` [out, in]."""
    rows, columns = shape
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, columns))
    return math.sqrt(max(1.0, rows / columns))

"""`optim.name: muon`: Muon for mixture-of-experts models, the hidden weight matrices orthogonalised, AdamW for the
rest; its settings (`optim.muon`) and QK-clip's refusals.

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
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.distributed.tensor import DTensor

from ferry.config.refusals import Refusal
from ferry.config.section import Section
from ferry.model.parameter_kinds import is_bias
from ferry.parallel.muon_fsdp import orthogonalised_shards
from ferry.parallel.newton_schulz import NS_DTYPES, orthogonalise
from ferry.parallel.optimizers.adamw import fused_where_available
from ferry.parallel.optimizers.base import OptimizerMemory, OptimizerRecipe, Params

if TYPE_CHECKING:
    from ferry.comm import Collectives

UpdateScale = Literal["match_rms_adamw", "original"]
MUON_GROUP, ADAMW_GROUP = "muon", "adamw"  # what each parameter group says it is stepped by


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
            "optimizer": MUON_GROUP,
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
            group["optimizer"] = ADAMW_GROUP
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
            if group["optimizer"] != MUON_GROUP:
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


class MuonConfig(Section):
    """Muon's settings (`optim.name: muon`): the momentum in PyTorch's form (an
    exponential moving average of the gradients, `lerp`), with Nesterov's look-ahead; Newton-Schulz's quintic
    iteration, its steps and dtype; the update's scale per matrix."""

    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    nesterov: bool = True
    ns_steps: int = Field(5, ge=1, le=20, description="Newton-Schulz iterations")
    ns_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="the dtype Newton-Schulz runs in: bf16 (the usual; its result moves ~0.5% with a "
        "last-bit change of its input) or fp32 (layouts then agree within the suite's tolerance)",
    )
    qk_clip: float | None = Field(
        None,
        gt=0.0,
        description="QK-clip (Kimi K2's MuonClip): after each update, the query and key weights of a "
        "head whose largest attention logit in the step passed this threshold are scaled so that it would not "
        "have (GQA: a group's shared keys by the root of its smallest factor, each query by the rest; MLA: the "
        "head's own query and key parts, not the shared rotary key); off when unset; refused with model.qk_norm",
    )
    update_scale: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description="match_rms_adamw: 0.2 x sqrt(max(A, B)) per [A, B] matrix, the update's RMS "
        "AdamW's, so optim.lr and optim.weight_decay carry over (Moonlight); original: sqrt(max(1, A / B))",
    )


class MuonKind:
    name: ClassVar[str] = "muon"
    state_kind: ClassVar[str] = "Muon"
    state_held: ClassVar[str] = "Muon momentum and AdamW moments"
    state_carried: ClassVar[str] = "Muon momentum of the matrices; AdamW moments and step counts of the rest"

    def settings(self, optim: Any, model: nn.Module) -> MuonSettings:
        """Which of the whole model's parameters Muon takes (before the layout slices or shards them), and how."""
        muon = optim.muon
        return MuonSettings(
            frozenset(muon_parameter_names(model)),
            muon.momentum,
            muon.nesterov,
            muon.ns_steps,
            muon.ns_dtype,
            muon.update_scale,
        )

    def build(self, recipe: OptimizerRecipe, params: Params, shard_owners: Collectives | None) -> torch.optim.Optimizer:
        return MuonWithAdamW(
            params, set(recipe.decayed), recipe.weight_decay, recipe.settings, shard_owners, **recipe.hyperparameters
        )

    def refusals(self, config: Any) -> list[Refusal]:
        """QK-clip acts after Muon's update, on the query and key weights whose scale sets the logits."""
        if config.optim.muon.qk_clip is None:
            return []
        if config.optim.name != self.name:
            return [
                Refusal("optim", "muon.qk_clip rescales the query and key weights after Muon's update: set name=muon")
            ]
        refused = []
        if config.model.attention_bias:
            refused.append(
                Refusal(
                    "optim",
                    "muon.qk_clip scales the query and key weights to scale the logits, which model.attention_bias's "
                    "biases would not follow: set model.attention_bias=false or leave muon.qk_clip unset",
                )
            )
        if config.model.qk_norm:
            refused.append(
                Refusal(
                    "optim",
                    "muon.qk_clip scales the query and key projections, which model.qk_norm normalises back, and its "
                    "gains are shared by the heads it would scale one by one: set model.qk_norm=false or leave "
                    "muon.qk_clip unset",
                )
            )
        return refused

    def memory(
        self,
        config: Any,
        params: int,
        expert_params: int,
        param_bytes: int,
        experts_split_over: int,
        weights_sharded_over: int,
    ) -> OptimizerMemory:
        """The embedding, head and routers take AdamW's two moments, the rest Muon's one buffer; the working set is
        Newton-Schulz's for the largest matrix (a layer's experts at once: the input, two iterates and the Gram
        products). Under FSDP a rank also holds the whole matrices it owns, gathered, and their orthogonalisation
        (`muon_fsdp.py`)."""
        model, moe = config.model, config.model.moe
        moe_layers = model.moe_layer_count
        adamw_params = model.vocab_size * model.dim * 2 + moe_layers * moe.num_experts * model.dim
        adamw_share = min(1.0, adamw_params / max(params, 1))
        ns_bytes = 2 if config.optim.muon.ns_dtype == "bf16" else 4
        matrices = [(1, model.n_heads * model.head_dim, model.dim)]  # [batch, rows, columns]
        if model.dense_layers and model.dense_ffn_dim:
            matrices.append((1, model.dense_ffn_dim, model.dim))
        if moe_layers:
            matrices.append((max(moe.num_experts // experts_split_over, 1), moe.expert_ffn_dim, model.dim))
        newton_schulz = ns_bytes * max(
            batch * (3 * rows * columns + 2 * min(rows, columns) ** 2) for batch, rows, columns in matrices
        )
        if weights_sharded_over > 1:
            owned_matrices = max(params - expert_params - adamw_params, 0) / weights_sharded_over
            newton_schulz += owned_matrices * (param_bytes + ns_bytes)
        return OptimizerMemory(adamw_share, newton_schulz)

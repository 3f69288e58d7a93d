"""The mixture-of-experts feed-forward layer: route, dispatch (dropless), run experts, combine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.activation import GatedActivation
from ferry.kernels.amp import in_autocast_dtype
from ferry.model.config import MoEConfig
from ferry.model.experts import Experts
from ferry.model.farskip import LateOutput
from ferry.model.feedforward import SwiGLU
from ferry.model.router import Router, Routing


@dataclass(frozen=True)
class RowMoves:
    """The layer's kernels that sort a token's (token, expert) assignments into rows and sum the rows back
    (`moe.permute`, `moe.combine`): a dispatcher moves rows with them."""

    permute: Callable
    combine: Callable


class ExpertDispatcher(Protocol):
    """Runs a layer's routed tokens through experts that may live elsewhere (set by the parallel layer): each
    token's output is the sum of its experts' outputs weighted by `weights_TK`, as on one device."""

    def __call__(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> torch.Tensor: ...

    def start(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> Callable[[], torch.Tensor]:
        """As a call, but the outputs may still be travelling back: the returned function waits for them."""


class RowDispatcher(ABC):
    """A dispatcher that moves one row per (token, expert) assignment: the rows sorted by the key `expert_order`
    gives each assignment's expert, run where their experts live (`rows`), and combined here."""

    @abstractmethod
    def rows(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """The experts' outputs of the sorted rows `x_ND`, in the same order."""

    def start_rows(
        self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module
    ) -> Callable[[], torch.Tensor]:
        """As `rows`, but the outputs may still be travelling back: the returned function waits for them."""
        y_ND = self.rows(x_ND, tokens_per_expert_E, experts)
        return lambda: y_ND

    def expert_order(self, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """The key the assignments are sorted by: the global expert."""
        return expert_ids_TK

    def __call__(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> torch.Tensor:
        x_ND, dispatch = moves.permute(x_TD, self.expert_order(routing.expert_ids_TK))
        y_ND = self.rows(x_ND, routing.tokens_per_expert_E, experts)
        return moves.combine(y_ND, weights_TK, dispatch)

    def start(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> Callable[[], torch.Tensor]:
        x_ND, dispatch = moves.permute(x_TD, self.expert_order(routing.expert_ids_TK))
        arrive_rows = self.start_rows(x_ND, routing.tokens_per_expert_E, experts)
        return lambda: moves.combine(arrive_rows(), weights_TK, dispatch)


@dataclass
class MoEStats:
    """What one MoE layer reports per forward: its losses and how many tokens each expert got, padding
    left out (the experts still ran it)."""

    tokens_per_expert_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    mean_prob_E: torch.Tensor
    entropy: torch.Tensor


class MoELayer(nn.Module):
    """Dropless top-k MoE with an optional shared expert.

    With every expert local, one op (`moe.routed_experts`) runs the routed path. With
    a dispatcher, the dispatcher runs the tokens on the ranks holding their experts: the
    flat exchange sorts the T*K (token, expert) assignments by expert (`moe.permute`),
    sends each to its expert's rank and sums each token's K outputs weighted by its
    routing weights (`moe.combine`); the hierarchical one sends a token once to each node.
    No token is ever dropped.
    """

    def __init__(self, dim: int, config: MoEConfig, kernels: KernelSelection | None = None):
        super().__init__()
        kernels = kernels or portable_kernels()
        self.top_k = config.top_k
        self.router = Router(dim, config, kernels)
        activation = GatedActivation(config.activation, config.swiglu_alpha, config.swiglu_limit)
        self.experts = Experts(
            config.num_experts, dim, config.expert_ffn_dim, kernels, config.expert_biases, activation
        )
        shared_ffn_dim = config.shared_expert_ffn_dim
        self.shared_expert = SwiGLU(dim, shared_ffn_dim, kernels) if shared_ffn_dim else None
        self.dispatcher: ExpertDispatcher | None = None
        self.moves = RowMoves(kernels["moe.permute"], kernels["moe.combine"])

    def run_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Local experts, or the parallel layer's dispatcher when experts live on several ranks."""
        if self.dispatcher is None:
            return self.experts.routed(x_TD, routing)
        x_TD, weights_TK = in_autocast_dtype(x_TD, routing.weights_TK)  # tokens travel in the compute dtype
        return self.dispatcher(x_TD, weights_TK, routing, self.experts, self.moves)

    def forward(self, x_BSD: torch.Tensor, padding_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """The layer's output, and its statistics over the positions that are not padding."""
        x_TD, routing, stats = self._route(x_BSD, padding_BS)
        out_TD = self.run_experts(x_TD, routing)
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        return out_TD.view(x_BSD.shape), stats

    def start(self, x_BSD: torch.Tensor, padding_BS: torch.Tensor | None = None) -> tuple[LateOutput, MoEStats]:
        """The layer's output left in flight (FarSkip wiring, `ferry/model/farskip.py`): behind a dispatcher the
        combine exchange is still travelling when this returns, and the shared expert computes meanwhile; the
        statistics are final. The same numbers as `forward`."""
        x_TD, routing, stats = self._route(x_BSD, padding_BS)
        if self.dispatcher is None:
            arrive_routed = LateOutput.ready(self.experts.routed(x_TD, routing)).arrive
        else:
            sent_TD, weights_TK = in_autocast_dtype(x_TD, routing.weights_TK)
            arrive_routed = self.dispatcher.start(sent_TD, weights_TK, routing, self.experts, self.moves)

        shared_TD = self.shared_expert(x_TD) if self.shared_expert is not None else None

        def arrive() -> torch.Tensor:
            out_TD = arrive_routed()
            if shared_TD is not None:
                out_TD = out_TD + shared_TD
            return out_TD.view(x_BSD.shape)

        return LateOutput(arrive), stats

    def _route(self, x_BSD: torch.Tensor, padding_BS: torch.Tensor | None) -> tuple[torch.Tensor, Routing, MoEStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, None if padding_BS is None else padding_BS.reshape(-1))
        stats = MoEStats(routing.load_E, routing.aux_loss, routing.z_loss, routing.mean_prob_E, routing.entropy)
        return x_TD, routing, stats

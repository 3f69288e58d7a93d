"""The two-stage expert exchange (`parallel.ep_topology: hierarchical`): a token crosses between nodes once per node.

When an EP group spans nodes, the flat exchange sends one row per (token, expert): a token whose k experts lie on
ranks of one other node crosses the slow network k times. Here the group's ranks are seen as `nodes` nodes of
`ranks` ranks each (the group is whole nodes, in rank order), and the node holds the experts of its ranks, in
order. A token travels in two stages, DeepSeek-V3's way:

1. between nodes, over the rail (this rank and the ranks at the same place on the other nodes): once to each node
   holding one of its experts, to the rank at this rank's place there (its gateway), with the ids and the weights
   of all its experts (a token's own node is among them: that row goes to this rank itself and crosses no link);
2. inside the node, over the node's ranks: the gateway sends one row per (token, expert) of its node to the rank
   holding the expert (the flat exchange over the node's experts, `AllToAllDispatcher` with stage `ep_node`),
   and sums the outputs that come back weighted by their routing weights.

The partial sums cross back once per node, over the rail, and this rank adds a token's partials. Every exchange
is differentiable (`Collectives.all_to_all`), so the backward moves the gradients back the same two stages.

The arithmetic is the flat exchange's but for the order of a token's sum (per node, then over nodes): equal
within float rounding. It runs in one piece each way (its outputs arrive as the call returns, under FarSkip too);
the step record counts its stages as `ep_counts`/`ep_routes`/`ep_dispatch`/`ep_combine` (between nodes) and
`ep_node_*` (inside them), and the bytes each link tier carries (`ferry/comm/collectives.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ferry.comm import Collectives
from ferry.model.moe import RowMoves
from ferry.model.router import Routing
from ferry.parallel.expert_parallel import AllToAllDispatcher


class HierarchicalDispatcher:
    """The two-stage exchange of one MoE layer: `rail` is this rank's group across the nodes (one rank a node, in
    node order), `node` the ranks of its node; the layer's `num_experts` are split over the nodes in order."""

    def __init__(self, rail: Collectives, node: Collectives, num_experts: int):
        self.rail = rail
        self.nodes = rail.size
        self.node_experts = num_experts // self.nodes
        self.node_index = rail.rank
        # a node of one rank holds its experts itself: nothing to forward
        self.within = AllToAllDispatcher(node, self.node_experts, stage="ep_node") if node.size > 1 else None

    @torch.compiler.disable
    def __call__(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> torch.Tensor:
        """Each token's outputs summed over its experts with `weights_TK`. Its host reads are the split sizes of the
        two stages (a compiled block runs it eagerly, as the flat exchange)."""
        rail, nodes, dim = self.rail, self.nodes, x_TD.shape[1]
        node_TK = torch.div(routing.expert_ids_TK, self.node_experts, rounding_mode="floor")
        destination_TJ = distinct_nodes(node_TK, nodes)
        # a row a (token, destination node), node-major; the slots past a token's nodes sort last and stay here
        rows_NC, route = moves.permute(torch.cat([x_TD, weights_TK], dim=1), destination_TJ)
        send_M = torch.bincount(destination_TJ.flatten(), minlength=nodes + 1)[:nodes]
        sent = int(send_M.sum())
        experts_SK = routing.expert_ids_TK.index_select(0, route.token_of_N[:sent]).to(torch.int32)
        with rail.region("ep_wait"):
            receive_M = rail.all_to_all_raw(send_M, None, None, op="ep_counts")
            send_splits, receive_splits = send_M.tolist(), receive_M.tolist()
            received_RC = rail.all_to_all(rows_NC[:sent], receive_splits, send_splits, op="ep_dispatch")
            experts_RK = rail.all_to_all_raw(experts_SK, receive_splits, send_splits, op="ep_routes")
        partial_RD = self._within_node(received_RC[:, :dim], received_RC[:, dim:], experts_RK, experts, moves)
        with rail.region("ep_wait"):
            returned_SD = rail.all_to_all(partial_RD, send_splits, receive_splits, op="ep_combine")
        unsent = returned_SD.new_zeros(destination_TJ.numel() - sent, dim)
        sums_TJ = (destination_TJ < nodes).to(returned_SD.dtype)
        return moves.combine(torch.cat([returned_SD, unsent]), sums_TJ, route)

    def start(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routing: Routing, experts: nn.Module, moves: RowMoves
    ) -> Callable[[], torch.Tensor]:
        """As a call: both stages run in one piece, so the outputs have arrived when it returns."""
        y_TD = self(x_TD, weights_TK, routing, experts, moves)
        return lambda: y_TD

    def _within_node(
        self,
        x_RD: torch.Tensor,
        weights_RK: torch.Tensor,
        experts_RK: torch.Tensor,
        experts: nn.Module,
        moves: RowMoves,
    ) -> torch.Tensor:
        """The gateway's stage: each received token's rows for this node's experts through the flat exchange
        inside the node, summed with their weights. The slots of other nodes sort last, send nothing and sum zeros
        (so their weights get no gradient here: the gateway of their node gives it)."""
        per_node = self.node_experts
        local_RK = experts_RK.to(torch.int64) - self.node_index * per_node
        here_RK = (local_RK >= 0) & (local_RK < per_node)
        local_RK = torch.where(here_RK, local_RK, per_node)
        rows_ND, inner = moves.permute(x_RD, local_RK)
        tokens_per_expert_E = torch.bincount(local_RK.flatten(), minlength=per_node + 1)[:per_node]
        held = int(tokens_per_expert_E.sum())
        if self.within is None:
            y_HD = experts(rows_ND[:held], tokens_per_expert_E)
        else:
            y_HD = self.within.rows(rows_ND[:held], tokens_per_expert_E, experts)
        y_ND = torch.cat([y_HD, y_HD.new_zeros(rows_ND.shape[0] - held, y_HD.shape[1])])
        return moves.combine(y_ND, weights_RK, inner)


def distinct_nodes(node_TK: torch.Tensor, nodes: int) -> torch.Tensor:
    """Each token's nodes, in order, once each, in J = min(K, nodes) slots: a token reaches J nodes at most, and
    the slots past its own nodes hold `nodes` (they sort last and send nothing). Fewer slots than K, the rows the
    first stage sorts and sums are a token's nodes, not its experts."""
    sorted_TK, _ = torch.sort(node_TK, dim=1)
    repeat_TK = torch.zeros_like(sorted_TK, dtype=torch.bool)
    repeat_TK[:, 1:] = sorted_TK[:, 1:] == sorted_TK[:, :-1]
    distinct_TK, _ = torch.sort(sorted_TK.masked_fill(repeat_TK, nodes), dim=1)
    return distinct_TK[:, : min(node_TK.shape[1], nodes)]

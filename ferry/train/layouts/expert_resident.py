"""`parallel.mode: ep` (the default): the OLMo-core 3 design. Each expert is resident on one of `parallel.ep` ranks
and tokens travel to it by all-to-all (`ferry/parallel/expert_parallel.py`); dense weights are replicated and their
gradients summed DDP-style over the ranks holding them, expert gradients over the ranks holding the same experts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from ferry.config.refusals import Refusal
from ferry.parallel.layout import choose_ep_topology
from ferry.train.layouts.base import LayoutKind, MemoryTerms, Traffic
from ferry.train.layouts.sizes import activation_bytes, param_counts, reduce_bytes

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout


def expected_nodes(num_experts: int, nodes: int, top_k: int, max_nodes: int | None) -> float:
    """The nodes a token's experts lie on, in expectation over balanced routing: its `top_k` experts drawn alike from
    those of the nodes it may reach (`max_nodes` of them with node-limited routing, all otherwise). A node is missed
    when all top_k fall on the others: R (1 - C(E_R - E_node, k) / C(E_R, k))."""
    reached = min(max_nodes or nodes, nodes)
    per_node = num_experts // nodes
    within = reached * per_node
    return reached * (1 - math.comb(within - per_node, top_k) / math.comb(within, top_k))


def hierarchical_exchange(config: Any, layout: JobLayout, calls: int, tokens: int) -> list[Traffic]:
    """The two-stage exchange's collectives (`ferry/parallel/hierarchical.py`) for `tokens` a call: over the rail,
    each token once to each node its experts lie on (`expected_nodes`), its row with its K routing weights and its K
    expert ids (int32), the node's partial sums back; inside the node, one row per (token, expert) of the node and
    its output back. Balanced routing is assumed; the step record has what crossed."""
    model, moe = config.model, config.model.moe
    values = activation_bytes(config)
    nodes, ranks = layout.ep_degree // layout.node_size, layout.node_size
    sent = tokens * expected_nodes(moe.num_experts, nodes, moe.top_k, moe.max_nodes)
    gathered = tokens * moe.top_k * model.dim * values  # a gateway's rows for its node, as many as a rank routes
    rail = [
        Traffic("ep_counts", calls, nodes * 8, "ep_rail", nodes),
        Traffic("ep_routes", calls, sent * moe.top_k * 4, "ep_rail", nodes),
        Traffic("ep_dispatch", calls, sent * (model.dim + moe.top_k) * values, "ep_rail", nodes),
        Traffic("ep_dispatch_backward", calls, sent * (model.dim + moe.top_k) * values, "ep_rail", nodes),
        Traffic("ep_combine", calls, sent * model.dim * values, "ep_rail", nodes),
        Traffic("ep_combine_backward", calls, sent * model.dim * values, "ep_rail", nodes),
    ]
    if ranks == 1:  # a node of one rank runs its experts itself
        return rail
    return [
        *rail,
        Traffic("ep_node_counts", calls, moe.num_experts // nodes * 8, "ep_node", ranks),
        *(
            Traffic(op, calls, gathered, "ep_node", ranks)
            for op in ("ep_node_dispatch", "ep_node_combine", "ep_node_dispatch_backward", "ep_node_combine_backward")
        ),
    ]


class ExpertResident(LayoutKind):
    name: ClassVar[str] = "expert-resident"
    mode: ClassVar[str] = "ep"  # the `parallel.mode` that places the weights so

    def active(self, config: Any) -> bool:
        return config.parallel.mode == self.mode

    def refusals(self, config: Any) -> list[Refusal]:
        parallel, objective = config.parallel, config.train.objective
        if parallel.ep_overlap == "auto" and objective != "lm":
            return [
                Refusal(
                    "parallel",
                    f"ep_overlap auto measures trial steps of next-token training, restoring the run after them; "
                    f"objective {objective} samples or caches what a trial step would use up: set none or chunked",
                )
            ]
        return []

    def job_refusals(self, config: Any, layout: JobLayout) -> list[str]:
        """Node-limited routing (`model.moe.max_nodes`) bounds the nodes a token reaches only when every node holds
        whole routing groups: the experts of an exchange that spans nodes are split over it in order, so a node holds
        its ranks' consecutive experts."""
        moe, ep = config.model.moe, layout.ep_degree
        if moe.max_nodes is None or layout.link_tier("ep") == "intra_node":
            return []
        on_node = moe.num_experts // ep * layout.node_size
        group = moe.num_experts // moe.n_group
        if on_node % group == 0:
            return []
        return [
            f"model.moe.max_nodes: a node holds {on_node} experts (parallel.ep {ep} over nodes of {layout.node_size} "
            f"ranks) and a routing group {group} (model.moe.n_group {moe.n_group}), so a group spans nodes and a "
            "token's experts may lie on more nodes than max_nodes; set model.moe.n_group to the nodes the experts lie "
            f"on ({layout.nodes} here) or a multiple of them"
        ]

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        """Dense parameters whole on every rank, each expert on one of `ep`; in the checkpointed modes a token also
        keeps the rows the exchange received each way, which a recompute reads instead of sending them again."""
        ep = config.parallel.ep
        share = terms.share
        dense = share.total_params - share.expert_params
        local = dense + share.expert_params / ep
        extra = terms.extra_kept_per_token_layer
        if ep > 1 and config.train.activation_checkpointing != "none":
            extra += 2 * config.model.moe.top_k * config.model.dim * terms.compute_bytes
        return terms.with_(local=local, moments=local, experts_split_over=ep, extra_kept_per_token_layer=extra)

    def banner(self, layout: JobLayout) -> str:
        return f"ep {layout.ep_degree}"

    def announcement(self, config: Any, layout: JobLayout) -> list[str]:
        """Over several nodes, how the expert exchange crosses them and why (`parallel.ep_topology: auto`)."""
        parallel = config.parallel
        if parallel.ep_topology != "auto" or layout.ep_degree == 1 or layout.nodes == 1:
            return []
        topology, reason = choose_ep_topology(parallel, config.model, layout)
        why = reason if topology == "hierarchical" else f"hierarchical needs {reason}"
        return [f"ferry: ep_topology auto: {topology} ({why})"]

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Each MoE layer's forward sends this rank's routed rows out and takes the experts' outputs back (and
        its backward the gradients of both), every micro-batch; after the backwards, the dense gradients are
        summed over the replicas and the expert gradients over the ranks holding the same experts, in buckets."""
        model, parallel = config.model, config.parallel
        counts = param_counts(config)
        reduced = reduce_bytes(config)
        bucket = parallel.bucket_mib * 2**20
        traffic = []
        ep = parallel.ep
        if ep > 1:
            micro_batches = config.train.global_batch // (micro_batch * layout.data_ranks)
            tokens = micro_batch * config.data.seq_len // layout.cp
            calls = micro_batches * model.moe_layer_count // layout.pp
            if layout.ep_topology == "hierarchical":
                traffic += hierarchical_exchange(config, layout, calls, tokens)
            else:
                rows = tokens * model.moe.top_k * model.dim * activation_bytes(config)
                traffic.append(Traffic("ep_counts", calls, model.moe.num_experts * 8, "ep", ep))  # int64 counts
                for op in ("ep_dispatch", "ep_combine", "ep_dispatch_backward", "ep_combine_backward"):
                    traffic.append(Traffic(op, calls, rows, "ep", ep))
        replicas = layout.replicas
        if replicas > 1:
            dense = (counts.total - counts.experts) / layout.pp * reduced
            traffic.append(Traffic("all_reduce", math.ceil(dense / bucket), min(dense, bucket), "replicas", replicas))
        holders = replicas // ep
        if holders > 1 and counts.experts:
            experts = counts.experts / ep / layout.pp * reduced
            traffic.append(Traffic("all_reduce", math.ceil(experts / bucket), min(experts, bucket), "dp", holders))
        return traffic

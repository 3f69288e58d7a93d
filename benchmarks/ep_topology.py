"""The expert exchange across nodes, flat against hierarchical: the bytes each link tier carries, against the figures
the routing gives and the layout kinds predict, on CPU ranks grouped into simulated nodes.

For each node shape (nodes x ranks a node, the EP group all of them), one MoE layer (dim 1024, 32 experts of width
512, top-8, 2,048 tokens a rank, fp32) runs forward and backward behind the flat exchange and behind the hierarchical
one, with the same weights and tokens. Per rank and step it reports the bytes each exchange sent between nodes and
inside them, what the routing says they must be (flat: a row for each of a token's experts on another node;
hierarchical: a row and its K weights for each other node a token reaches, and K int32 expert ids), the mean
crossings per token each way, what `expected_nodes` predicts for balanced routing, and the median time of a forward
and backward. On one host every tier is loopback: the times say what the extra stage costs in work, not what a
slower network would cost.

    python benchmarks/ep_topology.py [--nodes 2x2,4x1] [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DIM, EXPERTS, TOP_K, WIDTH, TOKENS, VALUE = 1024, 32, 8, 512, 2048, 4
EXCHANGE = ("ep_counts", "ep_routes", "ep_dispatch", "ep_combine", "ep_dispatch_backward", "ep_combine_backward")


def exchange_figures(node_size: int, steps: int) -> dict:
    """On one rank: each topology's bytes per tier of its exchange's last step, its median step time, and the
    figures counted from this rank's routing."""
    import torch

    from ferry.comm import Collectives, CommConfig, CommStats, build_exchange_groups, build_mesh, init_distributed
    from ferry.model import MoEConfig, MoELayer
    from ferry.parallel.expert_parallel import AllToAllDispatcher, shard_experts
    from ferry.parallel.hierarchical import HierarchicalDispatcher

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    context = init_distributed(CommConfig(backend="gloo"), cpu)
    world = context.world_size
    mesh = build_mesh(context, world, cpu)
    torch.manual_seed(0)
    layer = MoELayer(DIM, MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_ffn_dim=WIDTH))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    shard_experts(layer.experts, context.rank, world)
    stats = {"flat": CommStats(), "hierarchical": CommStats()}
    rail, node = (
        Collectives(group, stats["hierarchical"], cpu, node_size)
        for group in build_exchange_groups(context, world, node_size)
    )
    dispatchers = {
        "flat": AllToAllDispatcher(Collectives(mesh["ep"].get_group(), stats["flat"], cpu, node_size), EXPERTS),
        "hierarchical": HierarchicalDispatcher(rail, node, EXPERTS),
    }
    torch.manual_seed(1 + context.rank)
    x_TD = torch.randn(1, TOKENS, DIM, requires_grad=True)  # as a block's input is: its gradient travels back
    figures = {}
    for name, dispatcher in dispatchers.items():
        layer.dispatcher = dispatcher
        seconds = []
        for _ in range(steps):
            stats[name].take()
            torch.distributed.barrier()
            started = time.perf_counter()
            out, _ = layer(x_TD)
            out.square().sum().backward()
            seconds.append(time.perf_counter() - started)
        taken = stats[name].take()
        figures[name] = {
            "step_s": statistics.median(seconds),
            **{
                tier: sum(entry.tier_bytes.get(tier, 0) for entry in taken.values())
                for tier in ("inter_node", "intra_node")
            },
        }
    node_TK = torch.div(
        layer.router(x_TD[0], None).expert_ids_TK, EXPERTS // (world // node_size), rounding_mode="floor"
    )
    mine = context.rank // node_size
    remote_slots = int((node_TK != mine).sum())
    remote_nodes = sum(len(set(row) - {mine}) for row in node_TK.tolist())
    return {**figures, "remote_slots": remote_slots, "remote_nodes": remote_nodes}


def counted(remote_slots: int, remote_nodes: int, world: int, nodes: int) -> dict:
    """What the routing says the ranks together send between nodes a step (summed over ranks: each rank's rows out
    and the gradients of the rows it sent back). Flat: a row for each remote (token, expert), out and back in the
    forward and the backward (4 crossings of D values), and each rank's int64 counts to the ranks of other nodes.
    Hierarchical: for each remote (token, node), the row with its K weights out and its gradient back, the partial
    sum back and its gradient out, and K int32 ids; each rank's count to each other node."""
    ranks_a_node = world // nodes
    flat = remote_slots * 4 * DIM * VALUE + world * (EXPERTS // world) * 8 * (world - ranks_a_node)
    per_node = 2 * (DIM + TOP_K) * VALUE + 2 * DIM * VALUE + TOP_K * 4
    hierarchical = remote_nodes * per_node + world * 8 * (nodes - 1)
    return {"flat": flat, "hierarchical": hierarchical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2x2,4x1", help="node shapes: nodes x ranks a node, comma-separated")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))
    import ep_topology  # the spawned ranks import the function from this module, not from __main__

    from ferry.comm.spawn import run_on_ranks
    from ferry.train.layouts.expert_resident import expected_nodes

    results = {}
    for shape in args.nodes.split(","):
        nodes, node_size = (int(part) for part in shape.split("x"))
        ranks = run_on_ranks(ep_topology.exchange_figures, nodes * node_size, node_size, args.steps, timeout_s=1800)
        world = nodes * node_size
        routed = counted(sum(r["remote_slots"] for r in ranks), sum(r["remote_nodes"] for r in ranks), world, nodes)
        crossings = {
            "flat": statistics.mean(r["remote_slots"] for r in ranks) / TOKENS,
            "hierarchical": statistics.mean(r["remote_nodes"] for r in ranks) / TOKENS,
        }
        inter = {name: statistics.mean(r[name]["inter_node"] for r in ranks) for name in ("flat", "hierarchical")}
        measured = {name: sum(r[name]["inter_node"] for r in ranks) for name in inter}
        results[shape] = {
            "inter_node_bytes": inter,
            "intra_node_bytes": {name: statistics.mean(r[name]["intra_node"] for r in ranks) for name in inter},
            "step_s": {name: statistics.median(r[name]["step_s"] for r in ranks) for name in inter},
            "crossings_per_token": crossings,
            "predicted_crossings": {
                "flat": TOP_K * (nodes - 1) / nodes,
                # each node alike likely among those a token reaches: the other nodes' share of them
                "hierarchical": expected_nodes(EXPERTS, nodes, TOP_K, None) * (nodes - 1) / nodes,
            },
            "between_nodes_all_ranks": {"measured": measured, "counted_from_routing": routed},
        }
        if not args.json:
            figures = results[shape]
            print(
                f"{nodes} nodes x {node_size} ranks, top-{TOP_K} of {EXPERTS} experts, "
                f"{TOKENS} tokens a rank, dim {DIM}"
            )
            for name in inter:
                print(
                    f"  {name:<13} between nodes {inter[name] / 2**20:8.2f} MiB/rank/step "
                    f"({crossings[name]:.2f} crossings a token each way, {figures['predicted_crossings'][name]:.2f} "
                    f"predicted), inside nodes {figures['intra_node_bytes'][name] / 2**20:7.2f} MiB, "
                    f"fwd+bwd {1000 * figures['step_s'][name]:7.1f} ms"
                )
            agree = "equal" if measured == routed else f"DIFFER: measured {measured}, counted {routed}"
            print(
                f"  hierarchical / flat between nodes: {inter['hierarchical'] / inter['flat']:.3f}; "
                f"time {figures['step_s']['hierarchical'] / figures['step_s']['flat']:.2f}x; "
                f"bytes between nodes against those counted from the routing: {agree}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

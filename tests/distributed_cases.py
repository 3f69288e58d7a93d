"""Functions run on several spawned ranks by tests/test_parallel.py (module-level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferry.comm import Collectives, CommConfig, CommStats, build_mesh, init_distributed
from ferry.model.experts import Experts
from ferry.parallel.expert_parallel import AllToAllDispatcher, shard_experts
from ferry.parallel.optimizers import adamw_recipe
from ferry.parallel.zero import ReplicaGroup, ShardedOptimizer

CPU = torch.device("cpu")


def dispatcher_matches_local_experts(ep: int):
    context = init_distributed(CommConfig(backend="gloo"), CPU)
    mesh = build_mesh(context, ep, CPU)
    torch.manual_seed(0)
    experts = Experts(8, 16, 8)
    for param in experts.parameters():
        torch.nn.init.normal_(param)
    reference = Experts(8, 16, 8)
    reference.load_state_dict(experts.state_dict())
    torch.manual_seed(100 + context.rank)
    counts_E = torch.randint(0, 6, (8,))
    x_ND = torch.randn(int(counts_E.sum()), 16)
    expected = reference(x_ND.clone().requires_grad_(), counts_E)
    shard_experts(experts, mesh["ep"].get_local_rank(), ep)
    stats = CommStats()
    dispatcher = AllToAllDispatcher(Collectives(mesh["ep"].get_group(), stats, CPU), 8)
    x_mine = x_ND.clone().requires_grad_()
    y_ND = dispatcher.rows(x_mine, counts_E, experts)
    grad = torch.randn_like(y_ND)
    y_ND.backward(grad)
    x_ref = x_ND.clone().requires_grad_()
    reference(x_ref, counts_E).backward(grad)
    ops = set(stats.ops)
    return (
        ((y_ND - expected).norm() / expected.norm()).item(),
        ((x_mine.grad - x_ref.grad).norm() / x_ref.grad.norm()).item(),
        experts.w_gate_EFD.shape[0],
        ops,
    )


def zero_equals_adamw(steps: int):
    init_distributed(CommConfig(backend="gloo"), CPU)
    world = Collectives(None, CommStats(), CPU)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    decayed = {name for name, p in named if p.ndim == 2}
    sharded = ShardedOptimizer([ReplicaGroup(named, world)], adamw_recipe(decayed, 0.1, lr=1e-2))
    plain = torch.optim.AdamW(
        [
            {"params": [p for n, p in twin.named_parameters() if n in decayed], "weight_decay": 0.1},
            {"params": [p for n, p in twin.named_parameters() if n not in decayed], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(5, 8)
        for net in (model, twin):
            net(x).pow(2).mean().backward()
        sharded.step()
        plain.step()
        sharded.zero_grad()
        plain.zero_grad()
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    full_bytes = sum(2 * p.numel() * 4 + 4 for p in model.parameters())  # two moments and a step count
    return difference, sharded.state_bytes(), full_bytes


def bad_layout_raises(ep: int):
    from ferry.model import ModelConfig, Transformer
    from ferry.parallel import ParallelConfig, build_plan

    context = init_distributed(CommConfig(backend="gloo"), CPU)
    model = Transformer(
        ModelConfig.model_validate(
            {
                "vocab_size": 64,
                "dim": 16,
                "n_layers": 1,
                "n_heads": 2,
                "n_kv_heads": 2,
                "moe": {"num_experts": 3, "top_k": 1, "expert_ffn_dim": 8},
            }
        )
    )
    build_plan(ParallelConfig(ep=ep), context, model, CPU)


def rank_one_raises():
    init_distributed(CommConfig(backend="gloo", timeout_s=20), CPU)
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _tiny_moe_model():
    from ferry.model import ModelConfig, Transformer

    return Transformer(
        ModelConfig.model_validate(
            {
                "vocab_size": 64,
                "dim": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "max_seq_len": 16,
                "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16, "shared_expert_ffn_dim": 8},
            }
        )
    )


def model_ep_equals_single(mode: str, ep: int):
    """One forward+backward of the whole model under `mode`/`ep` against one process on the full batch."""
    import torch.nn.functional as F

    from ferry.parallel import ParallelConfig, build_plan

    context = init_distributed(CommConfig(backend="gloo"), CPU)
    torch.manual_seed(0)
    reference = _tiny_moe_model()
    torch.manual_seed(0)
    model = _tiny_moe_model()
    plan = build_plan(ParallelConfig(mode=mode, ep=ep), context, model, CPU)
    tokens = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(5))
    rows = tokens.shape[0] // context.world_size
    mine = tokens[context.rank * rows : (context.rank + 1) * rows]
    total = tokens[:, 1:].numel()

    def loss_of(net, batch):
        out = net(batch[:, :-1])
        return F.cross_entropy(
            out.logits_BSV.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        ) / total, out

    loss, output = loss_of(model, mine)
    loss.backward()
    plan.sync_gradients()
    ref_loss, ref_output = loss_of(reference, tokens)
    ref_loss.backward()
    logits_error = (
        (output.logits_BSV - ref_output.logits_BSV[context.rank * rows : (context.rank + 1) * rows]).abs().max()
    )
    worst = 0.0
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        expected = ref_params[name].grad
        if name in plan.expert_slices:
            piece = plan.expert_slices[name]
            expected = expected[piece.start : piece.stop]
        worst = max(worst, ((grad - expected).norm() / expected.norm().clamp_min(1e-12)).item())
    return logits_error.item(), worst


def resume_point_with_shared_verification(root: str):
    """The checkpoint two ranks agree to resume from when they split the hashing; and what they skipped."""
    from pathlib import Path

    from ferry.checkpoint import SharedVerification, find_resume_point

    context = init_distributed(CommConfig(backend="gloo"), CPU)

    def agree(payload):
        payloads = [None] * context.world_size
        dist.all_gather_object(payloads, payload)
        return payloads

    found = find_resume_point("latest", Path(root), share=SharedVerification(context.rank, context.world_size, agree))
    return found.checkpoint.step, [reason for _, reason in found.skipped]


def tensor_collectives_without_warnings(former_names: bool):
    """Reduce-scatter and all-gather through `Collectives`, with this torch's current names or, with `former_names`,
    the ones torch 2.11 alone has; the results and every warning the calls raised."""
    import warnings

    from ferry.comm import collectives

    if former_names:
        collectives._reduce_scatter = dist.reduce_scatter_tensor
        collectives._all_gather = dist.all_gather_into_tensor
    context = init_distributed(CommConfig(backend="gloo"), CPU)
    comms = Collectives(None, CommStats(), CPU)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scattered = comms.reduce_scatter(torch.empty(2), torch.arange(4.0) * (context.rank + 1))
        gathered = comms.all_gather(torch.empty(4), torch.full((2,), float(context.rank)))
        raw = comms.all_gather_raw(torch.full((1, 3), float(context.rank)), "gather_test")
    return scattered.tolist(), gathered.tolist(), raw.tolist(), [str(w.message) for w in caught]


def hierarchical_exchange_equals_flat(node_size: int, top_k: int):
    """One MoE layer over an EP group of the whole world, in nodes of `node_size` ranks: its outputs and gradients
    with the two-stage exchange and with the flat one (the same weights, tokens and output gradients), and what each
    sent to each link tier, with the figures counted from the routing: per token, its experts on other nodes (flat)
    and the other nodes it reaches (hierarchical)."""
    from ferry.comm import build_exchange_groups
    from ferry.model import MoEConfig, MoELayer
    from ferry.parallel.hierarchical import HierarchicalDispatcher

    context = init_distributed(CommConfig(backend="gloo"), CPU)
    world, dim, num_experts = context.world_size, 16, 8
    mesh = build_mesh(context, world, CPU)
    torch.manual_seed(0)
    layers = [MoELayer(dim, MoEConfig(num_experts=num_experts, top_k=top_k, expert_ffn_dim=8)) for _ in range(2)]
    for param in layers[0].parameters():
        torch.nn.init.normal_(param, std=0.2)
    layers[1].load_state_dict(layers[0].state_dict())
    stats = {"flat": CommStats(), "hierarchical": CommStats()}
    ep = Collectives(mesh["ep"].get_group(), stats["flat"], CPU, node_size)
    rail, node = (
        Collectives(g, stats["hierarchical"], CPU, node_size) for g in build_exchange_groups(context, world, node_size)
    )
    for layer in layers:
        shard_experts(layer.experts, context.rank, world)
    layers[0].dispatcher = AllToAllDispatcher(ep, num_experts)
    layers[1].dispatcher = HierarchicalDispatcher(rail, node, num_experts)
    torch.manual_seed(100 + context.rank)
    x_BSD = torch.randn(2, 9, dim)
    grad_BSD = torch.randn(2, 9, dim)
    results = {}
    for name, layer in zip(stats, layers):
        x = x_BSD.clone().requires_grad_()
        out_BSD, _ = layer(x)
        out_BSD.backward(grad_BSD)
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results[name] = (out_BSD.detach(), x.grad, grads)
    expert_ids_TK = layers[0].router(x_BSD.reshape(-1, dim), None).expert_ids_TK
    node_TK = torch.div(expert_ids_TK, num_experts // (world // node_size), rounding_mode="floor")
    mine = context.rank // node_size
    remote_slots = int((node_TK != mine).sum())
    remote_nodes = sum(len(set(row) - {mine}) for row in node_TK.tolist())
    flat, hierarchical = results["flat"], results["hierarchical"]

    def relative(a, b):
        return ((a - b).norm() / b.norm()).item()

    errors = {"out": relative(hierarchical[0], flat[0]), "input_grad": relative(hierarchical[1], flat[1])}
    errors.update({name: relative(hierarchical[2][name], grad) for name, grad in flat[2].items()})
    sent = {name: {op: dict(entry.tier_bytes) for op, entry in taken.ops.items()} for name, taken in stats.items()}
    return errors, sent, remote_slots, remote_nodes

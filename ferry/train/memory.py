"""The memory model: what one rank holds at the peak of a training step, from the config's counts alone.

It decides before anything is built: whether a suite fits the machine (`ferry bench`), and which micro-batch
`train.micro_batch: auto` takes. It is an estimate by counts of what the code keeps, checked against what a
forward really keeps on CPU (`ferry/metrics/kept_memory.py`, tests/test_activation_checkpointing.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ferry.config import UserError
from ferry.model import count_model
from ferry.parallel.layout import JobLayout, lay_out_job
from ferry.parallel.optimizers import OPTIMIZER_KINDS
from ferry.train.config import RunConfig
from ferry.train.layouts import MemoryTerms, RankShare, RunLayout

HEADROOM = 0.95  # the share of a device's memory an estimate may fill: allocator fragmentation, the CUDA context
_INDEX_BYTES = 8


@dataclass(frozen=True)
class MemoryEstimate:
    """What one device must hold at the peak of a training step, by the counts of the config (an estimate)."""

    state_bytes: int
    backward_bytes: int
    optimizer_bytes: int
    optimizer_state: str = "AdamW moments"  # what the state holds besides parameters and gradients
    snapshot_bytes: int = 0  # host memory: an asynchronous checkpoint's copy of the rank's train state

    @property
    def total_bytes(self) -> int:
        """The larger of the two peaks: the end of the forward (activations kept for the backward) and the
        optimizer step (AdamW's temporaries)."""
        return self.state_bytes + max(self.backward_bytes, self.optimizer_bytes)

    def describe(self) -> str:
        return (
            f"parameters, gradients and {self.optimizer_state} {gib(self.state_bytes)} GiB; activations and "
            f"compute-dtype weight copies kept for the backward {gib(self.backward_bytes)} GiB; the optimizer step's "
            f"temporaries {gib(self.optimizer_bytes)} GiB; estimated"
            + (
                f"; and in host memory an asynchronous checkpoint's snapshot {gib(self.snapshot_bytes)} GiB"
                if self.snapshot_bytes
                else ""
            )
        )


def memory_estimate(
    config: RunConfig, world_size: int, device: str, micro_batch: int | None = None, layout: JobLayout | None = None
) -> MemoryEstimate:
    """The memory of one rank at its peak, with `micro_batch` sequences a forward (default the config's; 1 for
    auto, the least it can take), over `world_size` ranks laid out as `layout` (a run's; laid out here when not
    given).

    The layout kinds the run composes shape what a rank holds (`LayoutKind.shares`, `LayoutKind.memory`): a
    pipeline's ranks their stages' parameters and the micro-batches their schedule keeps in flight (the rank
    holding the most is the estimate), experts split over `parallel.ep`, every weight over all ranks under FSDP,
    optimizer state over the ranks sharing each parameter under ZeRO-1, a context-parallel rank's 1/cp of the
    positions with what its attention gathers of the others'. State: parameters and gradients in the parameter
    dtype and the optimizer kind's state (`OptimizerKind.memory`: AdamW's two fp32 moments; under Muon one momentum
    buffer in the parameter dtype for the hidden matrices and AdamW's two moments for the embedding, head and
    routers, all of them counted on every rank: an upper bound). Backward: what each token of a micro-batch keeps
    in each layer (`kept_bytes_per_token_layer`, and what the kinds add), and with activation checkpointing the one
    block being recomputed; the logits with their fp32 loss and gradient; and, under autocast, the compute-dtype
    copies of the weights, which the backward keeps whether they are made per micro-batch or once a step
    (`ferry/precision/step_weights.py`: released before the optimizer step). Optimizer: AdamW's full-size temporary
    (the square root of the second moments, in the foreach implementation torch uses by default) over the moments
    it steps, and the kind's own working set (Newton-Schulz's for Muon's largest matrix).
    """
    model, moe = config.model, config.model.moe
    micro = micro_batch or (config.train.micro_batch if config.train.micro_batch != "auto" else 1)
    layout = layout or lay_out_job(config.parallel, config.model, world_size)
    size = count_model(model, config.data.seq_len)
    expert_params = model.moe_layer_count * moe.num_experts * 3 * model.dim * moe.expert_ffn_dim
    whole = RankShare(size.total_params, expert_params, model.n_layers + model.mtp.depth, head=True, in_flight=1)
    kinds = RunLayout.of(config)
    estimates = [
        _rank_estimate(config, layout, kinds, device, micro, share)
        for share in kinds.shares(config, layout, micro, whole)
    ]
    return max(estimates, key=lambda estimate: estimate.total_bytes)


def _rank_estimate(
    config: RunConfig, layout: JobLayout, kinds: RunLayout, device: str, micro: int, share: RankShare
) -> MemoryEstimate:
    """One rank's estimate: `share` of the model over the ranks that replicate or split it, as the kinds place it."""
    param_bytes = _param_bytes(config)
    compute_bytes = _compute_bytes(config, device)
    start = MemoryTerms(
        share,
        layout.replicas,
        local=share.total_params,
        moments=share.total_params,
        tokens=micro * config.data.seq_len,
        compute_bytes=compute_bytes,
    )
    terms = kinds.memory(config, layout, start)
    local, moments = terms.local, terms.moments
    kind = OPTIMIZER_KINDS[config.optim.name]
    optimizer_terms = kind.memory(
        config,
        share.total_params,
        share.expert_params,
        param_bytes,
        terms.experts_split_over,
        terms.weights_sharded_over,
    )
    adamw_share = optimizer_terms.adamw_share
    state = local * 2 * param_bytes + moments * (8 * adamw_share + param_bytes * (1 - adamw_share))
    tokens = terms.tokens  # this rank's positions of the micro-batch's sequences
    mode = config.train.activation_checkpointing
    kept = kept_bytes_per_token_layer(config, mode, compute_bytes) + terms.extra_kept_per_token_layer
    activations = tokens * share.layers * kept * share.in_flight
    if mode != "none":  # the block the backward recomputes holds what a plain block keeps
        activations += tokens * kept_bytes_per_token_layer(config, "none", compute_bytes)
    logits = _head_bytes(config, tokens, compute_bytes) * share.in_flight if share.head else 0
    copies = local * compute_bytes if compute_bytes < param_bytes else 0
    optimizer = moments * 4 * adamw_share + optimizer_terms.working_bytes
    saved_state = local * param_bytes + state - local * 2 * param_bytes  # the parameters and the optimizer's state
    snapshot = (
        saved_state if config.checkpoint.enabled and config.checkpoint.saves_in_background(layout.world_size) else 0
    )
    return MemoryEstimate(
        int(state), int(activations + logits + copies), int(optimizer), kind.state_held, int(snapshot)
    )


def kept_bytes_per_token_layer(config: RunConfig, mode: str, compute_bytes: int) -> int:
    """What one token keeps for the backward in one block, by `train.activation_checkpointing` mode.

    none: the block's input, both norms' outputs and the residual between attention and FFN (4 x dim), the
    smaller keeps (norm statistics, router scores, the routing choice), estimated at 2 x dim, what the attention
    kind keeps (`AttentionKind.kept_values`) and, for each of its top-k experts, the expert's input, hidden and
    output rows. selective: the block's input (the residual stream, in the parameter dtype), the outputs of the
    attention's GEMMs and kernels, the router's scores, each expert's gate, up and down rows, and the routing
    choice. full: the block's input and the routing choice. Both also keep the dispatch's three maps between
    token order and expert order, which the MoE kernels hold on their autograd context, where a checkpoint
    cannot drop them. What a layout adds (the rows an expert exchange received, which a recompute reads instead of
    sending them again) is its kind's (`LayoutKind.memory`).
    """
    model, moe = config.model, config.model.moe
    dim, top_k, ffn = model.dim, moe.top_k, moe.expert_ffn_dim
    attention = model.attention_kind.kept_values(model, mode) * compute_bytes
    if mode == "none":
        return (6 * dim + top_k * (2 * dim + 3 * ffn)) * compute_bytes + attention
    routing = top_k * (_INDEX_BYTES + compute_bytes) + 3 * top_k * _INDEX_BYTES  # the choice; the dispatch's maps
    kept = dim * _param_bytes(config) + routing + attention
    if mode == "selective":
        kept += (moe.num_experts + top_k * (2 * ffn + dim)) * compute_bytes
    return kept


def _head_bytes(config: RunConfig, tokens: int, compute_bytes: int) -> int:
    """The output head and loss: the logits with their fp32 log-softmax and gradient; with `train.loss_chunk`, one
    chunk's of those, the head weight's fp32 gradient and the hidden states' gradient, held from forward to
    backward (ferry/model/head_loss.py)."""
    vocab, dim, chunk = config.model.vocab_size, config.model.dim, config.train.loss_chunk
    if not chunk:
        return tokens * vocab * (compute_bytes + 8)
    return min(chunk, tokens) * vocab * (compute_bytes + 8) + vocab * dim * 4 + tokens * dim * compute_bytes


def choose_micro_batch(config: RunConfig, layout: JobLayout, device: str) -> tuple[int, dict]:
    """`train.micro_batch: auto`: the largest micro-batch that splits the rank's share of every batch and whose
    estimate fits `HEADROOM` of the device; with what run.json records of the choice. Nothing fitting is refused
    with the estimate of the smallest."""
    world_size = layout.world_size
    data_ranks = layout.data_ranks  # context-parallel ranks share their rows
    batches = [config.train.global_batch]
    if config.eval.sources and config.eval.batch_size is not None:
        batches.append(config.eval.batch_size)
    per_rank = config.train.global_batch // data_ranks
    candidates = [micro for micro in range(per_rank, 0, -1) if all(b % (micro * data_ranks) == 0 for b in batches)]
    where, available = device_memory_bytes(device, world_size)
    per_rank_bytes = available / world_size if device == "cpu" else available
    estimates = {micro: memory_estimate(config, world_size, device, micro, layout) for micro in candidates}
    fitting = [micro for micro in candidates if estimates[micro].total_bytes <= HEADROOM * per_rank_bytes]
    if not fitting:
        smallest = estimates[candidates[-1]]
        raise UserError(
            f"train.micro_batch: auto found no micro-batch that fits: one sequence a forward needs about "
            f"{gib(smallest.total_bytes)} GiB per rank ({smallest.describe()}) and {where} has "
            f"{gib(per_rank_bytes)} GiB per rank on {device}, of which {HEADROOM:.0%} may be planned; set "
            "train.activation_checkpointing (selective or full), more ranks, or a smaller model"
        )
    chosen = fitting[0]
    return chosen, {
        "requested": "auto",
        "chosen": chosen,
        "estimate_gib": round(estimates[chosen].total_bytes / 2**30, 1),
        "device": where,
        "device_gib": round(per_rank_bytes / 2**30, 1),
        "headroom": HEADROOM,
        "activation_checkpointing": config.train.activation_checkpointing,
        "larger_refused": {
            str(micro): round(estimates[micro].total_bytes / 2**30, 1) for micro in candidates if micro > chosen
        },
    }


def device_memory_bytes(device: str, ranks: int = 1) -> tuple[str, int]:
    """(what, bytes) of memory one rank has on `device`: the host's for a CPU run; on a GPU, the smallest of
    the GPUs the first `ranks` local ranks take (rank i runs on GPU i), since the rank on it fails first."""
    if device == "cpu":
        return "this host", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    gpus = [torch.cuda.get_device_properties(index) for index in range(ranks)]
    index = min(range(ranks), key=lambda i: gpus[i].total_memory)
    smallest = gpus[index]
    if len({gpu.total_memory for gpu in gpus}) > 1:
        return f"{smallest.name} (GPU {index}, the smallest of the {ranks} the ranks take)", smallest.total_memory
    return smallest.name, smallest.total_memory


def gib(value: float) -> str:
    return f"{value / 2**30:,.1f}"


def _param_bytes(config: RunConfig) -> int:
    return 2 if config.precision.param_dtype in ("bf16", "fp16") else 4


def _compute_bytes(config: RunConfig, device: str) -> int:
    compute = config.precision.compute_dtype
    half = compute in ("bf16", "fp16") or (compute is None and device != "cpu")  # accelerator profiles compute in bf16
    return 2 if half else 4

"""Whole training steps on a CPU: ferry's trainer against transformers' `OlmoeForCausalLM`, and both against
the dense-GEMM limit of the model's shapes.

One process, the same OLMoE-shaped model (ferry's config written as transformers' with `ferry.interop`,
the same initial weights), the same tokens each step (the batch ferry's loader hands its step is handed to
transformers too), AdamW with the same settings and gradient clipping on both sides:

- ferry: `Trainer.train_step()`, exactly what `ferry train` runs a step with (loss, router losses, MoE
  diagnostics, clipping, AdamW, the step's metrics record), with the kernels `--policy` selects;
- transformers: `OlmoeForCausalLM` with its fastest CPU settings (`experts_implementation="grouped_mm"`,
  SDPA attention), the router's auxiliary loss on as ferry's is, `clip_grad_norm_`, `torch.optim.AdamW`
  (its fused CPU kernel, as transformers' Trainer defaults to);
- the limit: every matmul of a step (forward, input and weight gradients of each projection with the
  rows it sees, the active experts as one dense GEMM each) timed alone; ferry's FLOPs per token over that
  time is the GEMM rate no whole step can beat here.

The sides alternate step by step so a drift in machine speed hits both. Before timing, the first
step's losses are checked to agree. Prints a table and, last, one JSON line: both tokens/s, their
ratio, each side's fraction of the GEMM limit, and ferry's step split (forward, backward, optimizer).

    python benchmarks/whole_step.py [--data data/stdlib] [--steps 8] [--policy auto] [--compile] [--breakdown]
        [--dtype fp32|bf16] [--op OP=IMPL] [--variant KEY=VALUE[,KEY=VALUE]] [--host-allocator ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ferry.config.loader import load_config
from ferry.interop.architectures import hf_config, to_hf_state
from ferry.model.counting import count_model
from ferry.train.config import RunConfig
from ferry.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# How far the sides' first losses may differ: rounding of the compute dtype, summed in other orders.
FIRST_LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 4e-3}


def ferry_config(args: argparse.Namespace, run_dir: Path, compile_mode: str, extra: list[str] = ()) -> RunConfig:
    overrides = {
        "run.dir": run_dir,
        "run.seed": 0,
        "data.sources": f"[{{name: bench, path: {args.data}}}]",
        "data.seq_len": args.seq,
        "model.vocab_size": args.vocab,
        "model.dim": args.dim,
        "model.n_layers": args.layers,
        "model.n_heads": args.heads,
        "model.n_kv_heads": args.heads,
        "model.max_seq_len": args.seq,
        "model.dense_layers": 0,
        "model.qk_norm": "true",
        "model.qk_norm_scope": "projection",
        "model.moe.num_experts": args.experts,
        "model.moe.top_k": args.top_k,
        "model.moe.expert_ffn_dim": args.ffn,
        "model.moe.z_loss_coef": 0.0,
        "train.steps": 1000,
        "train.global_batch": args.batch,
        "train.micro_batch": args.batch,
        "optim.warmup_steps": 0,
        "kernels.policy": args.policy,
        "train.compile": compile_mode,
        "run.host_allocator": args.host_allocator,
        "precision.compute_dtype": args.dtype,
    }
    pins = [f'kernels.ops."{op}"={implementation}' for op, implementation in (pin.split("=", 1) for pin in args.op)]
    return load_config(
        RunConfig,
        REPO / "configs" / "tiny.yaml",
        [f"{key}={value}" for key, value in overrides.items()] + pins + list(extra),
    )


def transformers_model(trainer: Trainer):
    from transformers import OlmoeForCausalLM

    config = hf_config(trainer.config.model, "olmoe", eos_token_id=None, dtype="float32")
    config.output_router_logits = True  # its auxiliary loss, as ferry computes its own
    model = OlmoeForCausalLM._from_config(config, attn_implementation="sdpa", experts_implementation="grouped_mm")
    state = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    model.load_state_dict(to_hf_state(state, trainer.config.model), strict=True)
    return model


class TransformersSide:
    """What a transformers training loop runs a step with: forward with the loss, backward, clip, AdamW."""

    def __init__(self, model, trainer: Trainer, compute_dtype: torch.dtype):
        optim = trainer.config.optim
        self.compute_dtype = compute_dtype
        self.model = model.train()
        decayed = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
        kept = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": optim.weight_decay}, {"params": kept, "weight_decay": 0.0}],
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            fused=True,
        )
        self.grad_clip = optim.grad_clip
        self.vocab = trainer.config.model.vocab_size

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            output = self.model(input_ids=inputs_BS)
        loss = F.cross_entropy(output.logits.float().view(-1, self.vocab), targets_BS.reshape(-1))
        total = loss + self.model.router_aux_loss_coef * output.aux_loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return loss.item()


def gemm_limit_s(args: argparse.Namespace, repeats: int = 3) -> float:
    """Seconds for every matmul of one step, each shape timed alone (best of `repeats`): forward, input
    gradient and weight gradient of every projection, and attention's score and value products (forward
    and backward, half of them: causal), the FLOPs ferry's counter counts."""
    tokens = args.batch * args.seq
    expert_rows = tokens * args.top_k // args.experts
    generator = torch.Generator().manual_seed(0)
    dtype = COMPUTE_DTYPES[args.dtype]

    def best(run) -> float:
        seconds = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            seconds = min(seconds, time.perf_counter() - started)
        return seconds

    total = 0.0
    projections = [  # (rows, in, out, how many a step)
        (tokens, args.dim, args.dim, 4 * args.layers),  # q, k, v, o
        (tokens, args.dim, args.experts, args.layers),  # router
        (expert_rows, args.dim, args.ffn, 2 * args.experts * args.layers),  # gate, up
        (expert_rows, args.ffn, args.dim, args.experts * args.layers),  # down
        (tokens, args.dim, args.vocab, 1),  # output head
    ]
    for rows, width_in, width_out, count in projections:
        x_MI = torch.randn(rows, width_in, generator=generator).to(dtype)
        w_OI = torch.randn(width_out, width_in, generator=generator).to(dtype)
        grad_MO = torch.randn(rows, width_out, generator=generator).to(dtype)
        total += count * best(lambda: (F.linear(x_MI, w_OI), grad_MO @ w_OI, grad_MO.t() @ x_MI))
    head_dim = args.dim // args.heads
    q_XSC, k_XSC, v_XSC, grad_XSC = (
        torch.randn(args.batch * args.heads, args.seq, head_dim, generator=generator).to(dtype) for _ in range(4)
    )
    p_XSS = torch.randn(args.batch * args.heads, args.seq, args.seq, generator=generator).to(dtype)

    def attention_products():
        q_XSC @ k_XSC.transpose(1, 2), p_XSS @ v_XSC  # forward
        grad_XSC @ v_XSC.transpose(1, 2), p_XSS.transpose(1, 2) @ grad_XSC  # backward
        p_XSS @ k_XSC, p_XSS.transpose(1, 2) @ q_XSC

    total += 0.5 * args.layers * best(attention_products)
    return total


# What each op of a profiled ferry step is spent on; an op not listed counts as "other".
CATEGORIES = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"),
    "attention kernel": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "loss": (
        "aten::_log_softmax",
        "aten::_log_softmax_backward_data",
        "aten::nll_loss_forward",
        "aten::nll_loss_backward",
        "aten::argmax",
    ),
    "optimizer and clipping": (
        "aten::_fused_adamw_",
        "aten::_foreach_norm",
        "aten::_foreach_mul_",
        "aten::linalg_vector_norm",
    ),
    "token moves (gather, scatter, sort)": (
        "aten::index_select",
        "aten::index_add_",
        "aten::scatter_add_",
        "aten::sort",
        "aten::argsort",
        "aten::gather",
        "aten::index",
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::topk",
    ),
    "elementwise (norms, RoPE, SwiGLU, residuals)": (
        "aten::mul",
        "aten::mul_",
        "aten::add",
        "aten::add_",
        "aten::pow",
        "aten::rsqrt",
        "aten::silu",
        "aten::silu_backward",
        "aten::div",
        "aten::mean",
        "aten::sum",
        "aten::neg",
        "aten::cat",
        "aten::fill_",
        "aten::copy_",
        "aten::zero_",
        "aten::softmax",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::where",
        "aten::xlogy",
        "aten::logsumexp",
        "aten::exp",
        "aten::sub",
        "aten::linalg_vecdot",
        "aten::lerp_",
        "aten::addcmul_",
        "aten::addcdiv_",
        "aten::sqrt",
        "aten::masked_fill",
    ),
}
# Autograd functions whose every op counts toward one category, whatever the op (the cross-entropy's backward
# is an exponential, a scale and a scatter, which alone would read as elementwise work and token moves).
CATEGORY_SCOPES = {"_CrossEntropy": "loss", "_CrossEntropyBackward": "loss"}


def breakdown(trainer: Trainer, steps: int = 3) -> dict[str, float]:
    """Seconds per step by category (`CATEGORIES`; every op inside a `CATEGORY_SCOPES` function counts toward its
    category), from the self times of a profiled ferry step, scaled to the step's unprofiled length (the
    profiler's own cost spreads over every op)."""
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    step_s = (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            trainer.train_step()
    category_of_op = {op: name for name, ops in CATEGORIES.items() for op in ops}
    other = "other (Python, autograd, small ops)"
    seconds = dict.fromkeys([*CATEGORIES, other], 0.0)
    for event in profiler.events():
        scope = event.cpu_parent
        while scope is not None and scope.name not in CATEGORY_SCOPES:
            scope = scope.cpu_parent
        category = CATEGORY_SCOPES[scope.name] if scope is not None else category_of_op.get(event.name, other)
        seconds[category] += event.self_cpu_time_total
    total = sum(seconds.values())
    shares = {name: value / total for name, value in seconds.items()}
    return {name: round(share * step_s, 4) for name, share in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"), help="a dataset `make demo` prepares")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a side, after 2 warm-up steps")
    parser.add_argument("--policy", choices=["auto", "portable"], default="auto")
    parser.add_argument(
        "--compile", action="store_true", help="also ferry with train.compile=blocks, a third side in the same run"
    )
    parser.add_argument(
        "--host-allocator",
        choices=["profile", "default", "keep_freed"],
        default="profile",
        help="ferry's run.host_allocator; it holds for the whole process, transformers' side included",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also profile ferry's step and print where its time goes"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more ferry side with these config overrides, e.g. train.loss_chunk=512 (repeatable)",
    )
    parser.add_argument(
        "--op",
        action="append",
        default=[],
        metavar="OP=IMPLEMENTATION",
        help="pin a kernel op on every ferry side (kernels.ops), e.g. moe.grouped_mm=torch_grouped_mm",
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256, help="expert hidden width")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="sequences a step")
    parser.add_argument(
        "--dtype",
        choices=sorted(COMPUTE_DTYPES),
        default="fp32",
        help="compute dtype of both sides (bf16: autocast over fp32 parameters) and of the GEMM limit",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "bench-whole-step"))
    args = parser.parse_args()
    if not (Path(args.data) / "manifest.json").exists():
        parser.error(f"--data {args.data}: no prepared dataset there (make demo prepares data/stdlib)")
    torch.set_num_threads(args.threads)

    ferry = {"ferry": Trainer(ferry_config(args, Path(args.run_dir), "none"))}
    if args.compile:
        ferry["ferry compiled"] = Trainer(ferry_config(args, Path(args.run_dir), "blocks"))
    for variant in args.variant:
        ferry[f"ferry {variant}"] = Trainer(ferry_config(args, Path(args.run_dir), "none", variant.split(",")))
    reference = ferry["ferry"]
    theirs = TransformersSide(transformers_model(reference), reference, COMPUTE_DTYPES[args.dtype])
    tokens = args.batch * args.seq
    flops_per_token = count_model(reference.config.model, args.seq).flops_per_token

    times: dict[str, list[float]] = {side: [] for side in [*ferry, "transformers"]}
    splits: dict[str, list[dict]] = {side: [] for side in ferry}
    first_losses: dict[str, float] = {}
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for index in range(args.steps + 2):
        batch = reference.loader.micro_batches(reference.cursor, 0, 1, args.batch).micro[0]
        for side, trainer in ferry.items():
            started = time.perf_counter()
            record = trainer.train_step()
            times[side].append(time.perf_counter() - started)
            first_losses.setdefault(side, record["lm_loss"])
            splits[side].append({phase: record[f"{phase}_s"] for phase in ("forward", "backward", "optimizer")})
        started = time.perf_counter()
        first_losses.setdefault("transformers", theirs.step(batch.inputs_BS, batch.targets_BS))
        times["transformers"].append(time.perf_counter() - started)
        if index == 0:
            spread = max(first_losses.values()) - min(first_losses.values())
            if spread > FIRST_LOSS_TOLERANCE[args.dtype] * first_losses["transformers"]:
                raise SystemExit(f"the first step's losses differ: {first_losses}")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    times = {side: seconds[2:] for side, seconds in times.items()}  # the first two steps warm up (and compile)

    limit_s = gemm_limit_s(args)
    tok_s = {side: tokens / statistics.median(seconds) for side, seconds in times.items()}
    limit_tok_s = tokens / limit_s
    result = {
        **{f"{side.replace(' ', '_')}_tok_s": round(value, 1) for side, value in tok_s.items()},
        "ratio": round(tok_s["ferry"] / tok_s["transformers"], 3),
        "gemm_limit_tok_s": round(limit_tok_s, 1),
        **{f"{side.replace(' ', '_')}_fraction_of_limit": round(v / limit_tok_s, 3) for side, v in tok_s.items()},
        "ferry_gflops": round(tok_s["ferry"] * flops_per_token / 1e9, 1),
        "gemm_limit_gflops": round(limit_tok_s * flops_per_token / 1e9, 1),
        "split_s": {
            side: {phase: round(statistics.median(s[phase] for s in rows[2:]), 4) for phase in rows[0]}
            for side, rows in splits.items()
        },
        "first_step_loss": {side: round(loss, 6) for side, loss in first_losses.items()},
        "step_s": {side: [round(s, 4) for s in seconds] for side, seconds in times.items()},
        "experts_kernel": reference.kernels.choices["moe.routed_experts"].implementation.key,
        "pinned_ops": args.op,
        "host_allocator": reference.host_allocator,
        "minor_faults_per_step": round(faults / (args.steps + 2)),
        "threads": args.threads,
        "tokens_per_step": tokens,
        "compute_dtype": args.dtype,
    }
    if args.breakdown:
        result["ferry_breakdown_s"] = breakdown(reference)
        result["gemm_limit_s"] = round(limit_s, 4)
    if args.compile:
        result["compiled_ratio"] = round(tok_s["ferry compiled"] / tok_s["transformers"], 3)
        result["compile_speedup"] = round(tok_s["ferry compiled"] / tok_s["ferry"], 3)
    for variant in args.variant:
        result[f"speedup {variant}"] = round(tok_s[f"ferry {variant}"] / tok_s["ferry"], 3)
    width = max(16, *(len(side) + 2 for side in tok_s))
    print(f"{'side':<{width}}{'tokens/s':>10}{'vs transformers':>17}{'of GEMM limit':>15}")
    for side, value in tok_s.items():
        print(f"{side:<{width}}{value:>10.0f}{value / tok_s['transformers']:>17.2f}{value / limit_tok_s:>15.2f}")
    print(f"{'GEMM limit':<{width}}{limit_tok_s:>10.0f}{limit_tok_s / tok_s['transformers']:>17.2f}{1.0:>15.2f}")
    for name, seconds in result.get("ferry_breakdown_s", {}).items():
        print(f"  ferry step: {name:<46}{seconds * 1e3:>8.0f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Expert-resident EP against the FSDP2 weight-gathering baseline, 2 CPU processes, one run.

The same MoE model (64 experts, so expert weights far outweigh a step's activations),
the same seed and the same token batches; each mode trains a few steps after a
warm-up and reports tokens/s and the bytes its collectives moved per step (both
measured through ferry's collectives interface). Prints one JSON line last.

    python benchmarks/ep_vs_fsdp.py [--steps 6] [--experts 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ferry.comm import CommConfig, init_distributed
from ferry.comm.spawn import run_on_ranks
from ferry.model import ModelConfig, Transformer
from ferry.parallel import ParallelConfig, build_plan
from ferry.parallel.optimizers import adamw_recipe

WORLD = 2
SEQ_LEN = 128
GLOBAL_BATCH = 8


def model_config(experts: int) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "vocab_size": 1024,
            "dim": 256,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 4,
            "max_seq_len": SEQ_LEN,
            "moe": {"num_experts": experts, "top_k": 4, "expert_ffn_dim": 256},
        }
    )


def run_mode(mode: str, experts: int, steps: int, warmup: int) -> dict:
    device = torch.device("cpu")
    context = init_distributed(CommConfig(backend="gloo"), device)
    torch.manual_seed(0)
    model = Transformer(model_config(experts))
    plan = build_plan(ParallelConfig(mode=mode, ep=WORLD if mode == "ep" else 1), context, model, device)
    optimizer = plan.build_optimizer(adamw_recipe(set(), 0.0, lr=1e-3))
    rows = GLOBAL_BATCH // WORLD
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    step_bytes, elapsed = [], 0.0
    for step in range(warmup + steps):
        generator = torch.Generator().manual_seed(step)
        batch = torch.randint(0, 1024, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
        mine = batch[context.rank * rows : (context.rank + 1) * rows]
        plan.stats.take()
        torch.distributed.barrier()
        started = time.perf_counter()
        output = model(mine[:, :-1])
        logits = output.logits_BSV.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten(), reduction="sum")
        (loss / tokens_per_step).backward()
        plan.sync_gradients()
        plan.clip_gradients(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        if step >= warmup:
            elapsed += time.perf_counter() - started
            step_bytes.append(sum(op.bytes for op in plan.stats.take().values()))
    return {"tok_s": steps * tokens_per_step / elapsed, "bytes_per_step": sum(step_bytes) / len(step_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    ep = run_on_ranks(run_mode, WORLD, "ep", args.experts, args.steps, args.warmup, timeout_s=600)
    fsdp = run_on_ranks(run_mode, WORLD, "fsdp", args.experts, args.steps, args.warmup, timeout_s=600)
    ep_bytes = sum(rank["bytes_per_step"] for rank in ep)
    fsdp_bytes = sum(rank["bytes_per_step"] for rank in fsdp)
    result = {
        "experts": args.experts,
        "world_size": WORLD,
        "ep_tok_s": round(min(rank["tok_s"] for rank in ep), 1),
        "fsdp_tok_s": round(min(rank["tok_s"] for rank in fsdp), 1),
        "ep_bytes_per_step": int(ep_bytes),
        "fsdp_bytes_per_step": int(fsdp_bytes),
    }
    result["speedup"] = round(result["ep_tok_s"] / result["fsdp_tok_s"], 3)
    result["bytes_ratio"] = round(ep_bytes / fsdp_bytes, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

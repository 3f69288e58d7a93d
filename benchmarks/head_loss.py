"""The output projection and the loss of one micro-batch, forward and backward: logits-then-loss (what
`train.loss_chunk: 0` runs) against the chunked head loss (`train.loss_chunk: N`), time and peak memory.

Each variant runs in processes of its own, so that its peak is its own: on a GPU the allocator's peak
(`torch.cuda.max_memory_allocated`); on a CPU the growth of the process's peak resident memory over what
the inputs hold (`ru_maxrss`), in a process with the C library's default allocator, which maps every large
tensor afresh and unmaps it when freed, so that the peak is what was live at once, while the times come
from a second process with ferry's CPU allocator preset, as training runs.
The inputs are the head's: hidden states [tokens, dim] and the weight [vocabulary, dim], fp32, or bf16
compute under autocast with `--bf16`. Prints a table and one JSON line.

    python benchmarks/head_loss.py [--tokens 4096] [--dim 256] [--vocab 4096] [--chunks 0,512,1024] [--device cpu]
    python benchmarks/head_loss.py --tokens 4096 --dim 2048 --vocab 50304 --device cuda --bf16   # OLMoE's head
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ferry.data.targets import IGNORE_INDEX
from ferry.model.head_loss import HeadTargets, chunked_head_loss
from ferry.platform.allocator import apply_host_allocator
from ferry.train.objectives.cross_entropy import cross_entropy


def run_variant(args: argparse.Namespace, chunk: int, allocator: str) -> dict:
    """Time and peak memory of `--repeats` forward + backward passes of one variant, in this process."""
    device = torch.device(args.device)
    apply_host_allocator(allocator)
    generator = torch.Generator(device).manual_seed(0)
    # made in place: a temporary the size of the weight would set the peak before anything is measured
    h_TD = torch.empty(args.tokens, args.dim, device=device).normal_(generator=generator).requires_grad_()
    weight_VD = torch.empty(args.vocab, args.dim, device=device).normal_(0.0, 0.02, generator=generator)
    weight_VD.requires_grad_()
    targets_T = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    targets_T[:: args.ignore_every] = IGNORE_INDEX
    baseline = _memory(device)
    seconds, losses = [], []
    for _ in range(args.repeats + 1):
        h_TD.grad = weight_VD.grad = None
        _synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            if chunk:
                loss = chunked_head_loss(h_TD[None], weight_VD, HeadTargets(targets_T[None], chunk)).lm_loss_sum
            else:
                loss = cross_entropy(F.linear(h_TD, weight_VD).float(), targets_T, IGNORE_INDEX, "sum")
        (loss / args.tokens).backward()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    return {
        "chunk": chunk,
        "step_ms": round(1e3 * statistics.median(seconds[1:]), 2),
        "peak_mib": round((_memory(device, peak=True) - baseline) / 2**20, 1),
        "loss": losses[-1],
        "grad_norms": [round(h_TD.grad.norm().item(), 6), round(weight_VD.grad.norm().item(), 6)],
    }


def _variant_process(chunk: int, allocator: str) -> dict:
    argv = [*sys.argv[1:], "--one", str(chunk), "--allocator", allocator]
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the variant with chunk {chunk} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _memory(device: torch.device, peak: bool = False) -> int:
    """Bytes: the allocator's (peak) allocation on a GPU, the process's peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the micro-batch")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--chunks", default="0,512,1024", help="comma-separated; 0: logits, then the loss")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ignore-every", type=int, default=7, help="every n-th target is not trained")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="the GEMMs in bfloat16 under autocast")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a variant's own process
    parser.add_argument("--allocator", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_variant(args, args.one, args.allocator)))
        return
    rows = []
    on_cpu = torch.device(args.device).type == "cpu"
    for chunk in (int(value) for value in args.chunks.split(",")):
        measured = _variant_process(chunk, "default")
        if on_cpu:
            measured["step_ms"] = _variant_process(chunk, "keep_freed")["step_ms"]
        rows.append(measured)
    logits = next((row for row in rows if row["chunk"] == 0), rows[0])
    print(f"{'loss_chunk':>10}{'ms':>10}{'peak MiB':>11}{'vs logits':>11}{'loss':>16}")
    for row in rows:
        row["peak_vs_logits"] = round(row["peak_mib"] / logits["peak_mib"], 3) if logits["peak_mib"] else None
        row["time_vs_logits"] = round(row["step_ms"] / logits["step_ms"], 3)
        print(
            f"{row['chunk']:>10}{row['step_ms']:>10.1f}{row['peak_mib']:>11.1f}{row['peak_vs_logits']:>11}"
            f"{row['loss']:>16.4f}"
        )
    shape = {"tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "bf16": args.bf16, "device": args.device}
    print(json.dumps({**shape, "variants": rows}))


if __name__ == "__main__":
    main()

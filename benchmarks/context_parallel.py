"""Context parallelism on CPU ranks: activations kept per rank, exchange bytes against the analytic figure, step time.

    python benchmarks/context_parallel.py [--dir DIR] [--seq-len 2048] [--steps 8]

One MoE model (GQA, 2 layers of 128 wide, 4 query and 2 key/value heads of 32, 8 experts) on windows of `--seq-len`
tokens packed from the embedded corpus with document masking, trained the same way three times: in one process
(torch's threads on both cores), at cp 2 on 2 ranks (a core each), and, for its bytes and memory only, at cp 4 on
4 ranks (4 processes would oversubscribe 2 cores: no time reported). Per layout: what one training forward keeps
for its backward on the rank keeping most (counted as the activation-checkpointing tests count it), the bytes of
the context-parallel exchanges per step from the step records against the analytic figure, and the median step
time after the first.

Then one attention layer's exchanges by each way of attending over a split sequence, timed alone on 2 ranks at the
same shapes: all-gathering keys and values (ferry's), a ring's passes, Ulysses' head all-to-alls.

The last line printed is one JSON object: kept_ratio (cp 2 over one process; the test bound is 0.55), kept_ratio_cp4,
bytes_ratio (measured over analytic, 1.0 when every byte is accounted for), cp_comm_share (the step's time in the
exchanges at cp 2), step_ratio (cp 2 over one process) and exchange_us per method.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from scratch import DIR_HELP, scratch_dir

from ferry.comm.spawn import run_on_ranks
from ferry.data import PrepareSpec, prepare_dataset

MODEL = {
    "vocab_size": 4096,
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "dense_layers": 0,
    "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 128},
}
ROWS = 2  # the global batch: both rows in one micro-batch


def run(dataset: str, run_dir: str, seq_len: int, steps: int, cp: int, timed: bool) -> dict:
    """One rank's run: what its first forward keeps, and on rank 0 the step records."""
    import torch

    from ferry.config.loader import validate
    from ferry.metrics.kept_memory import KeptMemory
    from ferry.model.head_loss import HeadTargets
    from ferry.train import RunConfig, Trainer

    raw = {
        "run": {"name": "context-parallel", "seed": 0, "device": "cpu", "dir": run_dir},
        "model": {**MODEL, "max_seq_len": seq_len},
        "data": {"seq_len": seq_len, "document_masking": True, "sources": [{"name": "stdlib", "path": dataset}]},
        "train": {
            "steps": steps if timed else 1,
            "global_batch": ROWS,
            "micro_batch": ROWS,
            "log_every": steps,
            "loss_chunk": 512,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "parallel": {"cp": cp},
        "eval": {"sources": []},
        "checkpoint": {"enabled": False},
    }
    trainer = Trainer(validate(RunConfig, raw))
    model = trainer.parts.model.model
    generator = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(1, MODEL["vocab_size"], (ROWS, seq_len), generator=generator)
    document_ids_BS = (torch.rand(ROWS, seq_len, generator=generator) < 1 / 300).long().cumsum(dim=1)
    with KeptMemory() as kept:
        output = model(tokens_BS, document_ids_BS=document_ids_BS, targets=HeadTargets(tokens_BS, 512))
    kept_bytes = kept.kept_bytes()
    del output
    trainer.parts.model.plan.stats.take()
    if not timed:
        return {"kept": kept_bytes}
    trainer.fit()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"kept": kept_bytes, "records": records}


def exchanges(seq_len: int, repeats: int) -> dict:
    """On each of 2 ranks, the median seconds of one attention layer's exchanges by each method, at the benchmark's
    shapes (fp32, both rows): all-gathering keys and values (ferry's), passing them to the ring's next rank (N - 1
    sends; with 2 ranks one, the same bytes, which a ring could hide behind the attention of its own block), and
    Ulysses' four all-to-alls (queries, keys and values to a split of the heads, the output back)."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    heads, kv_heads = MODEL["n_heads"], MODEL["n_kv_heads"]
    width = MODEL["dim"] // heads
    world, rank = dist.get_world_size(), dist.get_rank()
    local = seq_len // world
    kv_BGLZ = torch.randn(ROWS, kv_heads, local, 2 * width)
    q_BHLC = torch.randn(ROWS, heads, local, width)

    def all_gather() -> None:
        dist.all_gather_into_tensor(torch.empty(world * ROWS, *kv_BGLZ.shape[1:]), kv_BGLZ)

    def ring() -> None:
        block = kv_BGLZ
        for _ in range(world - 1):
            received = torch.empty_like(block)
            sends = [
                dist.P2POp(dist.isend, block, (rank + 1) % world),
                dist.P2POp(dist.irecv, received, (rank - 1) % world),
            ]
            for request in dist.batch_isend_irecv(sends):
                request.wait()
            block = received

    def ulysses() -> None:
        for x in (q_BHLC, kv_BGLZ[..., :width], kv_BGLZ[..., width:], q_BHLC):  # q, k, v in; the output back
            pieces = x.movedim(1, 0).contiguous()
            dist.all_to_all_single(torch.empty_like(pieces), pieces)

    timings = {}
    for name, exchange in (("all_gather", all_gather), ("ring", ring), ("ulysses", ulysses)):
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            exchange()
            seconds.append(time.perf_counter() - started)
        timings[name] = statistics.median(seconds)
    dist.destroy_process_group()
    return timings


def analytic_bytes(seq_len: int) -> int:
    """A step's context-parallel bytes on one rank, as the collectives count them: per attention layer the gather's
    output (every rank's keys and values, fp32) in the forward and the reduce-scatter's input (the same size) in
    the backward; per MoE layer one sum of the loads and the count."""
    kv_width = 2 * MODEL["n_kv_heads"] * (MODEL["dim"] // MODEL["n_heads"])
    gathered = ROWS * seq_len * kv_width * 4
    return MODEL["n_layers"] * (2 * gathered + (MODEL["moe"]["num_experts"] + 1) * 4)


def measure(work: Path, seq_len: int, steps: int) -> dict:
    """The three layouts' figures, printed as they come; the summary returned."""
    dataset = work / "data"
    if not (dataset / "manifest.json").exists():
        prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=600_000, vocab_size=4096), dataset)
    one = run(str(dataset), str(work / "cp1"), seq_len, steps, 1, timed=True)
    two = run_on_ranks(run, 2, str(dataset), str(work / "cp2"), seq_len, steps, 2, True)
    four = run_on_ranks(run, 4, str(dataset), str(work / "cp4"), seq_len, steps, 4, False)
    methods = run_on_ranks(exchanges, 2, seq_len, 50)[0]
    kept = {1: one["kept"], 2: max(r["kept"] for r in two), 4: max(r["kept"] for r in four)}
    step_s = {
        cp: statistics.median(record["step_s"] for record in records[1:])
        for cp, records in ((1, one["records"]), (2, two[0]["records"]))
    }
    measured = two[0]["records"][-1]["cp.bytes"]
    for cp in (1, 2, 4):
        print(f"cp {cp}: one forward keeps {kept[cp] / 2**20:.1f} MiB a rank ({kept[cp] / kept[1]:.2f} of one process)")
    print(
        f"cp 2: {measured:,} bytes of exchanges a step, analytic {analytic_bytes(seq_len):,}; "
        f"{two[0]['records'][-1]['cp.comm_s'] * 1000:.1f} ms in them"
    )
    print(f"step time: one process {step_s[1] * 1000:.0f} ms, cp 2 on 2 ranks {step_s[2] * 1000:.0f} ms")
    print(
        "one attention layer's exchanges on 2 ranks: "
        + ", ".join(f"{name} {seconds * 1e6:.0f} us" for name, seconds in methods.items())
    )
    figures = {
        "seq_len": seq_len,
        "kept_ratio": round(kept[2] / kept[1], 3),
        "kept_ratio_cp4": round(kept[4] / kept[1], 3),
        "bytes_ratio": round(measured / analytic_bytes(seq_len), 4),
        "cp_comm_share": round(two[0]["records"][-1]["cp.comm_s"] / step_s[2], 3),
        "step_ratio": round(step_s[2] / step_s[1], 3),
        "exchange_us": {name: round(seconds * 1e6, 1) for name, seconds in methods.items()},
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help=DIR_HELP)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with scratch_dir(args.dir, "context-parallel-") as work:
        figures = measure(work, args.seq_len, args.steps)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

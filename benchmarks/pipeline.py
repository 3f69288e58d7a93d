"""Pipeline schedules on CPU ranks: the measured bubble of each against the analytic one.

For each rank count p (2 and 4 gloo processes, one pipeline of p stages, one thread each) and each schedule of
torch.distributed.pipelining that ferry runs (`parallel.pp_schedule`), `ferry train` trains the same model on the
same synthetic tokens (`ferry/data/synthetic.py`) with m micro-batches a step, and reports the medians, over the
steps after the warm-up, of the step time, the time in the schedule and the bubble (`pp.bubble`: the share of the
schedule's time a rank was not computing a stage's forward or backward, mean over the ranks; and that of the
busiest rank, the one on the critical path, whose idle share is the schedule's fill and drain while the other
ranks' extra idle is the stages' imbalance). The analytic bubble
of GPipe and 1F1B is (p-1)/(m+p-1), of interleaved 1F1B with v stages a rank (p-1)/(v m + p-1): the pipeline's
fill and drain for stages of equal cost and free transfers. The measured one adds what the model does not: the
activations' transfers between processes, stages of unequal cost (the embedding on the first, the head and loss
on the last), and on a loaded machine, other processes taking a rank's core.

The model: 8 MoE blocks of width 384 (8 experts of width 768, top-2), sequences of 256, a 512-token vocabulary
(so that the embedding and head weigh little against a block), one sequence a micro-batch, the head and loss
computed inside the last stage (`train.loss_chunk`).

    python benchmarks/pipeline.py [--ranks 2,4] [--micro-batches 8] [--schedules gpipe,1f1b,...] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ferry_runs import train_records  # noqa: E402

from ferry.data.synthetic import write_synthetic_dataset  # noqa: E402

WARMUP_STEPS = 3
VOCAB, SEQ_LEN = 512, 256
MODEL = [
    "model.dim=384",
    "model.n_layers=8",
    "model.n_heads=6",
    "model.n_kv_heads=6",
    "model.dense_layers=0",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.expert_ffn_dim=768",
    f"model.max_seq_len={SEQ_LEN}",
    "model.qk_norm=false",
]
SCHEDULES = {
    "gpipe": ["parallel.pp_schedule=gpipe"],
    "1f1b": ["parallel.pp_schedule=1f1b"],
    "interleaved_1f1b": ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"],
    "looped_bfs": ["parallel.pp_schedule=looped_bfs", "parallel.pp_virtual_stages=2"],
}


def analytic_bubble(schedule: str, stages: int, micro_batches: int) -> float | None:
    """The fill-and-drain share of a schedule's time for stages of equal cost (None where no simple formula holds:
    looped BFS's depends on how its loops overlap)."""
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    if schedule == "looped_bfs":
        return None
    return (stages - 1) / (virtual * micro_batches + stages - 1)


def run(ranks: int, schedule: str, micro_batches: int, steps: int, data: Path, root: Path) -> dict:
    run_dir = root / f"pp{ranks}-{schedule}"
    command = [
        sys.executable,
        "-m",
        "ferry",
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        "--nproc",
        str(ranks),
        f"data.sources=[{{name: synthetic, path: {data}}}]",
        f"data.seq_len={SEQ_LEN}",
        f"model.vocab_size={VOCAB}",
        f"train.global_batch={micro_batches}",
        "train.micro_batch=1",
        f"train.loss_chunk={SEQ_LEN}",
        f"train.steps={steps}",
        "train.log_every=1000",
        f"parallel.pp={ranks}",
        "checkpoint.enabled=false",
        "checkpoint.interval=0",
        "metrics.sinks.prometheus.enabled=false",
        "eval.sources=[]",
        f"run.dir={run_dir}",
        *MODEL,
        *SCHEDULES[schedule],
    ]
    records = train_records(command, run_dir, WARMUP_STEPS, REPO)
    if isinstance(records, str):
        return {"failed": records}

    def median(key: str) -> float:
        return statistics.median(record[key] for record in records)

    stage_busy = [statistics.median(values) for values in zip(*(record["pp.stage_busy_s"] for record in records))]

    def busiest_rank_bubble(record: dict) -> float:
        rank_busy = [sum(record["pp.stage_busy_s"][rank::ranks]) for rank in range(ranks)]
        return 1.0 - max(rank_busy) / record["pp.schedule_s"]

    return {
        "step_s": median("step_s"),
        "schedule_s": median("pp.schedule_s"),
        "bubble": median("pp.bubble"),
        "busiest_rank_bubble": statistics.median(busiest_rank_bubble(record) for record in records),
        "stage_busy_s": stage_busy,
        "tokens_per_s": median("tokens_per_s"),
        "analytic_bubble": analytic_bubble(schedule, ranks, micro_batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ferry-pipeline-") as root:
        data = Path(root) / "data"
        write_synthetic_dataset(data, 20261205, VOCAB, args.steps * args.micro_batches * (SEQ_LEN + 1) + 1, 1.1)
        for ranks in (int(r) for r in args.ranks.split(",")):
            for schedule in args.schedules.split(","):
                figure = run(ranks, schedule, args.micro_batches, args.steps, data, Path(root))
                results[f"pp{ranks}/{schedule}"] = figure
                if args.json:
                    continue
                if "failed" in figure:
                    print(f"pp {ranks} {schedule:<17} FAILED: {figure['failed']}")
                    continue
                analytic = figure["analytic_bubble"]
                mean, busiest = figure["bubble"], figure["busiest_rank_bubble"]
                against = (
                    f"analytic {analytic:.3f} (mean {mean / analytic:.2f}x, busiest {busiest / analytic:.2f}x)"
                    if analytic
                    else "analytic -"
                )
                busy = ", ".join(f"{1000 * seconds:.0f}" for seconds in figure["stage_busy_s"])
                print(
                    f"pp {ranks} {schedule:<17} m {args.micro_batches}: step {1000 * figure['step_s']:6.0f} ms, "
                    f"schedule {1000 * figure['schedule_s']:6.0f} ms, bubble mean {mean:.3f} busiest rank "
                    f"{busiest:.3f}, {against}; stage busy ms [{busy}]",
                    flush=True,
                )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

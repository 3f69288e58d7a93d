"""What a checkpoint save costs a 2-rank run, saved in the foreground and in the background.

    python benchmarks/checkpoint_async.py [--dir DIR] [--steps 42] [--interval 8]

The same training run twice on 2 CPU ranks (EP2 with ZeRO-1, a 117M-parameter MoE: 1.4 GB of train state
with AdamW's moments), saving every `--interval` steps and at the end: once with `checkpoint.async_save: false`,
once with `true`. From the step records: what training waited for each save (`checkpoint.blocked_s`), what a
save took to write (`checkpoint.write_s`), the steps that ran while a background write went on against the
steps that ran with none, and the whole run's time. On 2 cores the writers compete with training for them, so
the steps during a write are slower: the whole run says whether the background still wins.

The last line printed is one JSON object: blocked_ratio (the median wait of the background saves after the first
over the median foreground save's; the first, which allocates the host snapshot and faults its pages in, apart as
first_blocked_ratio), the step times, and run_ratio (background run time over foreground).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from scratch import DIR_HELP, scratch_dir

from ferry.checkpoint import list_checkpoints
from ferry.comm.spawn import run_on_ranks
from ferry.data import PrepareSpec, prepare_dataset

MODEL = {
    "vocab_size": 4096,
    "dim": 1024,
    "n_layers": 2,
    "n_heads": 8,
    "n_kv_heads": 8,
    "max_seq_len": 128,
    "dense_layers": 0,
    "moe": {"num_experts": 16, "top_k": 1, "expert_ffn_dim": 1024},
}


def train(dataset: str, run_dir: str, steps: int, interval: int, asynchronous: bool) -> dict:
    """One rank's run; rank 0 returns its step records and the run's time."""
    from ferry.config.loader import validate
    from ferry.train import RunConfig, Trainer

    raw = {
        "run": {"name": "checkpoint-async", "seed": 0, "device": "cpu", "dir": run_dir},
        "model": MODEL,
        "data": {"seq_len": 128, "sources": [{"name": "stdlib", "path": dataset}]},
        "train": {"steps": steps, "global_batch": 4, "micro_batch": 2, "log_every": steps},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "zero": True},
        "parallel": {"ep": 2},
        "eval": {"sources": []},
        "checkpoint": {"interval": interval, "keep": 2, "async_save": asynchronous},
    }
    trainer = Trainer(validate(RunConfig, raw))
    started = time.perf_counter()
    trainer.fit()
    run_s = time.perf_counter() - started
    if trainer.parts.job.rank != 0:
        return {}
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"run_s": run_s, "records": records}


def summary(run: dict, interval: int) -> dict:
    """The run's saves and steps: waits and writes per save, and the steps during a background write apart."""
    records = run["records"]
    last = records[-1]["step"]  # its save, at the run's end, is waited for either way: not counted here
    saves = [row for row in records if row["step"] % interval == 0 and row["step"] != last]
    during = [row["step_s"] for row in records if row["step"] % interval != 0 and _writing(row, records)]
    quiet = [row["step_s"] for row in records if row["step"] % interval != 0 and not _writing(row, records)]
    return {
        "run_s": round(run["run_s"], 2),
        "blocked_s": [round(row["checkpoint.blocked_s"], 3) for row in saves],
        "write_s": [round(row["checkpoint.write_s"], 3) for row in records if row["checkpoint.write_s"] > 0],
        "step_s_during_write": round(statistics.median(during), 3) if during else None,
        "step_s_quiet": round(statistics.median(quiet), 3) if quiet else None,
    }


def _writing(row: dict, records: list[dict]) -> bool:
    """Whether a background write was in flight during this step: a save was started before it and had not
    yet been seen to end (its `checkpoint.write_s` comes in the record of the step it was seen to end in)."""
    started = [r["step"] for r in records if r["step"] < row["step"] and r["checkpoint.blocked_s"] > 0]
    if not started:
        return False
    ended = [r["step"] for r in records if started[-1] < r["step"] < row["step"] and r["checkpoint.write_s"] > 0]
    return not ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help=DIR_HELP)
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--interval", type=int, default=8)
    args = parser.parse_args()
    if args.steps <= 2 * args.interval:
        parser.error("--steps must exceed twice --interval: the first background save is reported apart")
    with scratch_dir(args.dir, "checkpoint-async-") as work:
        dataset = work / "stdlib"
        prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=2_000_000, vocab_size=4096), dataset)
        runs = {}
        for name, asynchronous in (("foreground", False), ("background", True)):
            run = run_on_ranks(
                train, 2, str(dataset), str(work / name), args.steps, args.interval, asynchronous, timeout_s=1800
            )[0]
            runs[name] = summary(run, args.interval)
            print(f"{name}: {json.dumps(runs[name])}")
        last = list_checkpoints(work / "foreground" / "checkpoints")[-1]
        state = sum(path.stat().st_size for path in last.glob("*.safetensors"))
    fore, back = runs["foreground"], runs["background"]
    figures = {
        "state_gb": round(state / 1e9, 3),
        "foreground_blocked_s": statistics.median(fore["blocked_s"]),
        "background_first_blocked_s": back["blocked_s"][0],
        "background_blocked_s": statistics.median(back["blocked_s"][1:]),
        "background_write_s": statistics.median(back["write_s"]),
        "step_s_quiet": back["step_s_quiet"],
        "step_s_during_write": back["step_s_during_write"],
        "foreground_run_s": fore["run_s"],
        "background_run_s": back["run_s"],
    }
    figures["blocked_ratio"] = round(figures["background_blocked_s"] / figures["foreground_blocked_s"], 4)
    figures["first_blocked_ratio"] = round(figures["background_first_blocked_s"] / figures["foreground_blocked_s"], 4)
    figures["run_ratio"] = round(back["run_s"] / fore["run_s"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

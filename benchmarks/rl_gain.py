"""What GRPO adds over its SFT warm-start on the embedded largest-digit task, over several seeds, in one run.

For every seed: SFT from scratch on the task's conversations (a deliberately short warm-start, so
the model is right often but not always), then GRPO from that checkpoint on the task's prompts.
Both checkpoints are scored on the same held-out prompts (problems no training view holds), with
the figures GRPO reports: the sampled solve rate (4 completions a prompt at temperature 1, fixed
seeds, the same draws for both checkpoints) and the greedy one. Prints a row per seed and the
mean gain with its spread.

    python benchmarks/rl_gain.py [--seeds 0 1 2] [--sft-steps 40] [--grpo-steps 60] [--work runs/bench-rl]

The task's datasets are prepared with the demo's tokenizer (`data/stdlib/tokenizer.json`,
made by `make demo`; prepared here from a smaller slice of the corpus when it is absent).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.records import RecordDataset
from ferry.inference.generate import generate
from ferry.inference.loading import load_model
from ferry.train.config import load_run_config
from ferry.train.objectives.grpo import EVAL_SAMPLES, solved_prompts
from ferry.train.objectives.verifiers import VERIFIERS
from ferry.train.trainer import train

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.vocab_size=4160", "model.max_seq_len=64", "data.seq_len=64", "metrics.sinks.console=false"]


def prepare(work: Path) -> dict[str, Path]:
    tokenizer = REPO / "data" / "stdlib" / "tokenizer.json"
    if not tokenizer.is_file():
        base = work / "stdlib"
        prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=2_000_000), base)
        tokenizer = base / "tokenizer.json"
    views = {
        "chat": ("largest", {"chat": True, "seq_len": 64}),
        "prompts": ("largest", {"records": "prompts"}),
        "held-out": ("largest-held-out", {"records": "prompts"}),
    }
    paths = {}
    for name, (task, flags) in views.items():
        paths[name] = work / "data" / name
        prepare_dataset(PrepareSpec(embedded=task, tokenizer=str(tokenizer), **flags), paths[name])
    return paths


def solve_rates(run_dir: Path, held_out: RecordDataset) -> tuple[float, float]:
    model = load_model(run_dir, device="cpu").model
    verify = VERIFIERS["numeric"]
    generation = partial(generate, model)
    sampled = solved_prompts(generation, held_out, verify, 4, temperature=1.0, samples=EVAL_SAMPLES) / len(held_out)
    greedy = solved_prompts(generation, held_out, verify, 4) / len(held_out)
    return sampled, greedy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench-rl")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = prepare(args.work)
    held_out = RecordDataset(data["held-out"], "held-out prompts", "prompts")
    rows = []
    started = time.perf_counter()
    for seed in args.seeds:
        sft_dir, grpo_dir = args.work / f"sft-{seed}", args.work / f"grpo-{seed}"
        train(
            load_run_config(
                REPO / "configs" / "tiny.yaml",
                [
                    *MODEL,
                    f"run.dir={sft_dir}",
                    "run.overwrite=true",
                    f"run.seed={seed}",
                    "checkpoint.interval=0",
                    f"data.sources=[{{name: chat, path: {data['chat']}}}]",
                    f"train.steps={args.sft_steps}",
                    "optim.warmup_steps=10",
                ],
            )
        )
        train(
            load_run_config(
                REPO / "configs" / "tiny.yaml",
                [
                    *MODEL,
                    f"run.dir={grpo_dir}",
                    "run.overwrite=true",
                    f"run.seed={seed}",
                    "checkpoint.interval=0",
                    "train.objective=grpo",
                    f"init_from={sft_dir / 'checkpoints'}",
                    f"data.sources=[{{name: prompts, path: {data['prompts']}}}]",
                    "grpo.verifier=numeric",
                    "grpo.max_new_tokens=4",
                    "train.global_batch=16",
                    "train.micro_batch=8",
                    f"train.steps={args.grpo_steps}",
                    "optim.lr=6e-4",
                    "optim.warmup_steps=5",
                    "optim.schedule=constant",
                ],
            )
        )
        before, after = solve_rates(sft_dir, held_out), solve_rates(grpo_dir, held_out)
        rows.append((seed, *before, *after))
        print(
            f"seed {seed}: held-out solve rate sampled {before[0]:.1%} -> {after[0]:.1%} "
            f"({after[0] - before[0]:+.1%}), greedy {before[1]:.1%} -> {after[1]:.1%} ({after[1] - before[1]:+.1%})",
            flush=True,
        )
    for label, index in (("sampled", 1), ("greedy", 2)):
        gains = [row[index + 2] - row[index] for row in rows]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(
            f"{label}: mean gain of GRPO over SFT {statistics.mean(gains):+.1%} (std {spread:.1%}, "
            f"min {min(gains):+.1%}) "
            f"over {len(gains)} seeds; {len(held_out)} held-out prompts"
        )
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""Muon against AdamW on the demo model and data, each at its best learning rate from a small sweep, in one run.

Every (optimizer, learning rate) trains the demo (`configs/tiny.yaml`, its 300 steps and schedule) with held-out
evaluation every `--eval-interval` steps. Per optimizer the learning rate with the lowest final held-out loss is
kept; then: the held-out loss of each at equal tokens (the last step), the steps Muon needs to reach AdamW's final
held-out loss (interpolated between evaluations; the goal is at most 0.75 of AdamW's), the optimizer phase's
median time a step (reductions, clipping and the update) and the optimizer state, Muon's against AdamW's. Then
QK-clip: the MLA demo (`configs/mla-tiny.yaml`) with Muon, its largest attention logit every 50 steps without and
with `optim.muon.qk_clip` at `--qk-clip`, and what recording that logit costs the demo's step (AdamW, median step
time with `metrics.attn_max_logit` against without).

    python benchmarks/muon_vs_adamw.py [--lrs 1e-3 3e-3 6e-3] [--steps 300] [--eval-interval 20] [--qk-clip 3]
                                       [--work runs/bench-muon] [--threads N]

Needs the demo's datasets (`make demo` prepares `data/stdlib` and `data/stdlib-held-out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ferry.train.config import load_run_config
from ferry.train.trainer import train

REPO = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "muon")


def run(optimizer: str, lr: float, steps: int, interval: int, work: Path, config: str = "tiny", *extra: str) -> dict:
    run_dir = work / "-".join([config, optimizer, f"lr{lr:g}", *(value.split("=")[-1] for value in extra)])
    held_out = f"eval.sources=[{{name: held_out, path: {REPO / 'data' / 'stdlib-held-out'}}}]"
    config = load_run_config(
        REPO / "configs" / f"{config}.yaml",
        [
            f"data.sources.0.path={REPO / 'data' / 'stdlib'}",
            held_out,
            f"eval.interval={interval}",
            f"train.steps={steps}",
            f"optim.name={optimizer}",
            f"optim.lr={lr}",
            f"run.dir={run_dir}",
            "run.overwrite=true",
            "checkpoint.interval=0",
            "train.log_every=100",
            *extra,
        ],
    )
    train(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(record["step"], record["eval.loss"]["held_out"]) for record in records if "eval.loss" in record]
    return {
        "optimizer": optimizer,
        "lr": lr,
        "curve": curve,
        "final": curve[-1][1],
        "optimizer_s": statistics.median(record["optimizer_s"] for record in records[1:]),
        "step_s": statistics.median(record["step_s"] for record in records[1:]),
        "state_mib": records[-1]["optimizer_state_mib"],
        "max_logit": [record.get("attn.max_logit") for record in records],
    }


def qk_clip(args: argparse.Namespace, adamw: dict) -> None:
    """The MLA demo's largest logit with and without QK-clip, and the cost of recording it on the demo."""
    logged = "metrics.attn_max_logit=true"
    free = run("muon", 3e-3, args.steps, args.eval_interval, args.work, "mla-tiny", logged)
    clipped = run(
        "muon", 3e-3, args.steps, args.eval_interval, args.work, "mla-tiny", f"optim.muon.qk_clip={args.qk_clip}"
    )
    shown = range(0, args.steps, 50)
    print(f"MLA demo, Muon lr 3e-3: largest attention logit at steps {[step + 1 for step in shown]}")
    for name, result in (("without QK-clip", free), (f"QK-clip {args.qk_clip:g}", clipped)):
        logits = ", ".join(f"{result['max_logit'][step]:.2f}" for step in shown)
        print(f"  {name:<16} {logits}; peak {max(result['max_logit']):.2f}; held-out {result['final']:.4f}")
    recorded = run("adamw", adamw["lr"], args.steps, args.eval_interval, args.work, "tiny", logged)
    print(
        f"recording attn.max_logit on the demo: median step {1000 * recorded['step_s']:.1f} ms against "
        f"{1000 * adamw['step_s']:.1f} ms ({recorded['step_s'] / adamw['step_s'] - 1:+.1%})"
    )


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step the held-out loss is at or below `target`, interpolated linearly between evaluations."""
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            (last_step, last_loss) = previous
            return last_step + (step - last_step) * (last_loss - target) / (last_loss - loss)
        previous = (step, loss)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--qk-clip", type=float, default=3.0, help="QK-clip's threshold on the MLA demo")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench-muon")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [run(name, lr, args.steps, args.eval_interval, args.work) for name in OPTIMIZERS for lr in args.lrs]
    print(f"{'optimizer':<10}{'lr':>8}{'held-out':>10}{'optimizer ms':>14}{'step ms':>9}{'state MiB':>11}")
    for result in results:
        print(
            f"{result['optimizer']:<10}{result['lr']:>8g}{result['final']:>10.4f}"
            f"{1000 * result['optimizer_s']:>14.1f}{1000 * result['step_s']:>9.1f}{result['state_mib']:>11.2f}"
        )
    best = {name: min((r for r in results if r["optimizer"] == name), key=lambda r: r["final"]) for name in OPTIMIZERS}
    adamw, muon = best["adamw"], best["muon"]
    reached = steps_to_reach(muon["curve"], adamw["final"])
    print(
        f"best: AdamW lr {adamw['lr']:g} held-out {adamw['final']:.4f}; Muon lr {muon['lr']:g} held-out "
        f"{muon['final']:.4f} at equal tokens ({muon['final'] - adamw['final']:+.4f})"
    )
    if reached is None:
        print(f"Muon does not reach AdamW's final held-out loss within {args.steps} steps")
    else:
        print(
            f"Muon reaches AdamW's final held-out loss at step {reached:.0f} of {args.steps}: "
            f"{reached / args.steps:.2f}x the steps (goal <= 0.75)"
        )
    print(
        f"optimizer phase a step: Muon/AdamW {muon['optimizer_s'] / adamw['optimizer_s']:.2f}x "
        f"({muon['optimizer_s'] / muon['step_s']:.1%} of Muon's step, {adamw['optimizer_s'] / adamw['step_s']:.1%} "
        f"of AdamW's); optimizer state Muon/AdamW {muon['state_mib'] / adamw['state_mib']:.2f}x"
    )
    qk_clip(args, adamw)


if __name__ == "__main__":
    main()

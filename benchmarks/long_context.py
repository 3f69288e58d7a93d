"""Long-context extension: a model pre-trained at S tokens and extended to 4S in a second stage, against the same
model continued for as many tokens at S, both scored on held-out text in windows of 4S.

    python benchmarks/long_context.py [--seq-len 64] [--pretrain-steps 300] [--extend-steps 100] \
        [--seed 0] [--threads N] [--data data] [--work DIR] [--out FILE]

Every stage is a plain `ferry train` run of the demo model (configs/tiny.yaml) built in this process
from the same overrides the command line takes. Stage 1 pre-trains from scratch at S with
`model.max_seq_len` S and the demo's optimizer. Stage 2 starts from its checkpoint (`init_from`, AdamW
state carried with `init_optimizer`), with the same steps, schedule (`--extend-lr`, a tenth of the steps
warming up, cosine decay) and data seed in every variant:

- no extension: S tokens a window, 32 windows a step (the control);
- extended, no scaling: 4S a window, 8 windows a step, RoPE as pre-trained;
- extended, ABF: the same with `model.rope_theta` raised so that the slowest frequency rotates as far
  over 4S as it did over S (theta * 4^(C/(C-2)) for head size C);
- extended, YaRN x4: the same with `model.rope_scaling` yarn, factor 4 over `original_max_seq_len` S.

A step is 32 x S tokens in each, so every variant of stage 2 trains on the same number of tokens and
the control's extra training cannot explain a difference. Stage 1 runs with `--seed`, stage 2 with the
next seed in every variant, so the control does not re-read the batches stage 1 began with. Each
checkpoint, the pre-trained one too, is scored with `HeldOutEvaluation` (what `ferry eval` runs) on the
held-out slice of the embedded corpus (no document of it is trained on), the same number of tokens at S
and at 4S; a model pre-trained at S is scored at 4S with its RoPE tables extended and its frequencies
unchanged, which is what running it on a longer input does. With the seeds fixed a rerun with the same
thread count gives the same figures; another `--seed` (initialisation and data order) shows how much
of a difference is chance.

The data is prepared under `--data` when missing (what `make demo` prepares); the runs go to `--work`,
by default a temporary directory removed at the end. Prints one table, the differences against the
control, the wall time, and last one JSON line (also written to `--out`). On a machine shared with
other work pass `--threads 1`: torch's two threads then wait on each other and run ~10x slower.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.tokenizer import encoding_digest
from ferry.inference import EvalConfig, HeldOutEvaluation, HeldOutSource, load_model
from ferry.inference.loading import build_model
from ferry.inference.scoring import score_with
from ferry.train import load_run_config, train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
FACTOR = 4
BATCH_AT_S = 32  # windows of S per step; 8 windows of 4S carry the same tokens
EVAL_BATCH = 16


def prepare_data(data_dir: Path) -> tuple[Path, Path]:
    """The demo corpus and its held-out slice (the text after the 6 MB trained on, same tokenizer); an
    up-to-date directory is reused, so this costs only the check on a machine that ran `make demo`."""
    corpus, held_out = data_dir / "stdlib", data_dir / "stdlib-held-out"
    prepare_dataset(PrepareSpec(embedded="stdlib"), corpus)
    tokenizer = str(corpus / "tokenizer.json")
    held_out_spec = dict(embedded_skip_bytes=6_000_000, embedded_max_bytes=400_000, tokenizer=tokenizer)
    prepare_dataset(PrepareSpec(embedded="stdlib", **held_out_spec), held_out)
    return corpus, held_out


def abf_theta(theta: float, head_dim: int, factor: int) -> float:
    """The RoPE base at which the slowest of the C/2 frequencies rotates as far over `factor` times the
    length as it did over the original one: its wavelength, proportional to theta^((C-2)/C), grows by `factor`."""
    return theta * factor ** (head_dim / (head_dim - 2))


def window_overrides(short: int, seq_len: int) -> list[str]:
    """Windows of `seq_len` tokens, as many a step as make BATCH_AT_S windows of `short`: the same tokens a step."""
    batch = BATCH_AT_S * short // seq_len
    return [
        f"data.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}",
        f"train.global_batch={batch}",
        f"train.micro_batch={batch}",
    ]


def stage_2_variants(short: int, theta: float, head_dim: int) -> dict[str, list[str]]:
    """Stage 2's variants as `ferry train` overrides (over the common ones of `extend`)."""
    at_long = window_overrides(short, FACTOR * short)
    abf = abf_theta(theta, head_dim, FACTOR)
    return {
        "no extension": window_overrides(short, short),
        "extended, no scaling": at_long,
        f"extended, ABF (theta {abf:,.0f})": [*at_long, f"model.rope_theta={abf:.1f}"],
        f"extended, YaRN x{FACTOR}": [
            *at_long,
            "model.rope_scaling.kind=yarn",
            f"model.rope_scaling.factor={FACTOR}",
            f"model.rope_scaling.original_max_seq_len={short}",
        ],
    }


def run_stage(run_dir: Path, corpus: Path, steps: int, overrides: list[str]) -> tuple[float, float]:
    """One `ferry train configs/tiny.yaml ...` run in this process: (seconds, last training loss). The
    console sink is off so that the benchmark's own lines stay readable; metrics.jsonl has every step."""
    source = json.dumps([{"name": "stdlib", "path": str(corpus), "weight": 1.0}])
    common = [f"run.dir={run_dir}", f"data.sources={source}", f"train.steps={steps}", "metrics.sinks.console=false"]
    started = time.perf_counter()
    result = train(load_run_config(CONFIG, common + overrides))
    return time.perf_counter() - started, result.losses[-1]


def pretrain(args: argparse.Namespace, corpus: Path, run_dir: Path) -> None:
    """Stage 1: from scratch at S, with the demo's optimizer and schedule."""
    overrides = [*window_overrides(args.seq_len, args.seq_len), f"run.seed={args.seed}"]
    seconds, last = run_stage(run_dir, corpus, args.pretrain_steps, overrides)
    print(
        f"pre-trained: {args.pretrain_steps} steps of {BATCH_AT_S * args.seq_len:,} tokens in {seconds:.0f} s, "
        f"train loss {last:.4f}"
    )


def extend(args: argparse.Namespace, corpus: Path, parent: Path, work: Path) -> dict[str, Path]:
    """Stage 2 in every variant, from the parent's weights and AdamW state, with one schedule and data seed."""
    config = load_model(parent, device="cpu").model.config
    common = [
        f"init_from={parent}",
        "init_optimizer=true",
        f"run.seed={args.seed + 1}",
        f"optim.lr={args.extend_lr}",
        f"optim.warmup_steps={max(1, args.extend_steps // 10)}",
    ]
    runs = {}
    variants = stage_2_variants(args.seq_len, config.rope_theta, config.head_dim)
    for index, (name, overrides) in enumerate(variants.items()):
        runs[name] = work / f"stage-2-{index}"
        seconds, last = run_stage(runs[name], corpus, args.extend_steps, common + overrides)
        print(
            f"{name}: {args.extend_steps} steps of {BATCH_AT_S * args.seq_len:,} tokens in {seconds:.0f} s, "
            f"train loss {last:.4f}"
        )
    return runs


def held_out_loss(run_dir: Path, held_out: Path, seq_len: int, tokens: int) -> float:
    """Mean next-token loss of the run's checkpoint on `tokens` held-out tokens in windows of `seq_len`;
    a model shorter than the windows gets RoPE tables that reach them (no weight changes)."""
    loaded = load_model(run_dir, device="cpu")
    model = loaded.model
    if model.config.max_seq_len < seq_len:
        longer = model.config.model_copy(update={"max_seq_len": seq_len})
        model = build_model(longer, model.state_dict(), "cpu", "fp32")
    source = HeldOutSource(name="held_out", path=str(held_out))
    batches = max(1, tokens // (seq_len * EVAL_BATCH))
    evaluation = HeldOutEvaluation(
        EvalConfig(sources=[source], batches=batches, batch_size=EVAL_BATCH), seq_len, EVAL_BATCH, EVAL_BATCH
    )
    evaluation.check_tokenizer(encoding_digest(loaded.tokenizer), model.config.vocab_size, str(loaded.tokenizer_path))
    return evaluation.run(score_with(model), next(model.parameters()).device)["held_out"].loss


def measure(args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    """Both stages, then every checkpoint's held-out loss at S and at 4S."""
    corpus, held_out = prepare_data(Path(args.data))
    pretrain(args, corpus, work / "pre-trained")
    runs = {"pre-trained (reference)": work / "pre-trained", **extend(args, corpus, work / "pre-trained", work)}
    short, long = args.seq_len, FACTOR * args.seq_len
    return {
        name: {
            "loss_at_s": held_out_loss(path, held_out, short, args.eval_tokens),
            "loss_at_4s": held_out_loss(path, held_out, long, args.eval_tokens),
        }
        for name, path in runs.items()
    }


def report(args: argparse.Namespace, losses: dict[str, dict[str, float]], wall_s: float) -> dict:
    """The table, then each extended variant against the control at 4S, then one JSON line."""
    short, long = args.seq_len, FACTOR * args.seq_len
    width = max(len(name) for name in losses)
    print(f"\nheld-out loss ({args.eval_tokens:,} tokens at each length; perplexity in brackets)")
    print(f"{'variant':<{width}}  {'at ' + str(short):>16}  {'at ' + str(long):>16}")
    for name, row in losses.items():
        cells = [f"{row[key]:.4f} ({math.exp(row[key]):6.1f})" for key in ("loss_at_s", "loss_at_4s")]
        print(f"{name:<{width}}  {cells[0]:>16}  {cells[1]:>16}")
    control = losses["no extension"]["loss_at_4s"]
    differences = {name: row["loss_at_4s"] - control for name, row in losses.items() if name.startswith("extended")}
    ratios = [f"{name} {delta:+.4f} (perplexity x{math.exp(delta):.3f})" for name, delta in differences.items()]
    print(f"at {long} against no extension ({control:.4f}): " + ", ".join(ratios))
    print(f"wall time {wall_s:.0f} s")
    return {
        "seq_len": short,
        "extended_seq_len": long,
        "pretrain_steps": args.pretrain_steps,
        "extend_steps": args.extend_steps,
        "tokens_per_step": BATCH_AT_S * short,
        "eval_tokens": args.eval_tokens,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "held_out_loss": {name: {key: round(value, 4) for key, value in row.items()} for name, row in losses.items()},
        "loss_at_4s_vs_no_extension": {name: round(delta, 4) for name, delta in differences.items()},
        "wall_s": round(wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=64, help="S, the pre-training length; the extension is 4S")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--extend-steps", type=int, default=100, help="stage 2's steps, the same in every variant")
    parser.add_argument("--extend-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="stage 1's seed; stage 2 runs with the next one")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--eval-tokens", type=int, default=32_768, help="held-out tokens scored at each length")
    parser.add_argument("--data", default="data", help="where the corpus and held-out set are (prepared if missing)")
    parser.add_argument("--work", default=None, help="where the runs go (kept); default a temporary directory")
    parser.add_argument("--out", default=None, help="also write the JSON figures to this file")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.work is None:
        with tempfile.TemporaryDirectory(prefix="ferry-long-context-") as work:
            losses = measure(args, Path(work))
    else:
        losses = measure(args, Path(args.work))
    figures = report(args, losses, time.perf_counter() - started)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

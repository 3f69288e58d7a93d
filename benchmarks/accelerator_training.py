"""Whole training steps on an accelerator: what the vendor kernels, compilation and FP8 buy over the portable path.

The kernel bench (`ferry kernels bench`) times each op alone; this times `ferry train` itself, so
launch overheads, the router, attention and the optimizer count as they do in a run. Two shapes:

- `mid` (default): dim 1024, 8 layers (the first dense), 16 heads over 4 kv heads, 64 experts, top-8,
  expert width 512, vocabulary 4,096; one micro-batch of 16 sequences of 1,024 (16,384 tokens a step).
- `olmoe-1b-7b`: OLMoE-1B-7B's shape (as benchmarks/suites/olmoe-1b-7b.yaml): dim 2048, 16 MoE layers,
  16 heads with 16 kv heads, one query/key norm over the whole projection, 64 experts, top-8, expert
  width 1024, vocabulary 50,304, sequences of 4,096; 6.9B parameters, 1.3B active. Sized for one H200
  (141 GB; torch sees about 139 GiB). ferry has no activation checkpointing, so memory decides the
  micro-batch: by ferry's estimate (`memory_estimate` in ferry/portability/suites.py) the fp32
  parameters, gradients and AdamW moments take 103 GiB, and one sequence of 4,096 adds 25 GiB at the
  end of the forward (its activations, the logits and the bf16 weight copies kept for the backward)
  or 26 GiB at the optimizer step: ~129 GiB. Two sequences would need ~140 GiB, more than fits. So the
  default is one sequence a micro-batch and 8 micro-batches a step (32,768 tokens). `fp8-torchao`
  keeps a padded copy of each expert GEMM's input for the backward (a few GiB more at this shape); a
  variant that does not fit is reported as failed.

Variants, each its own `ferry train` process, bfloat16 compute:

- `portable`: `kernels.policy=portable`, every op on the portable path;
- `auto`: the approved vendor kernels (on an SM90 GPU, `torch_grouped_mm` for the expert GEMMs);
- `compiled`: `auto` with `train.compile=blocks` (each transformer block compiled);
- `fp8-emulated`: FP8 expert GEMMs, portable (rounded to FP8, multiplied in bfloat16);
- `fp8-native`: FP8 expert GEMMs on the approved vendor kernel (`torch_scaled_grouped_mm` on SM90);
- `fp8-torchao`: FP8 expert GEMMs on torchao's kernels, pinned (`kernels.ops."moe.fp8_grouped_mm"=torchao`)
  while their ledger entry is unapproved; needs `pip install ferry-moe[gpu]`;
- `chunked-loss`: `auto` with `train.loss_chunk=1024` (the head and the loss by chunks of 1,024 tokens,
  no full logits): its peak memory against `auto`'s is the point.

Each reports the medians over the steps after the warm-up of tokens/s, MFU (against the hardware
profile's peak for the compute dtype, bf16: FP8 expert GEMMs do not change it), the step and its
split (forward, backward, optimizer, time blocked in collectives), the peak memory, and which kernels
the run recorded. A variant that fails (out of memory, a kernel that is not available) is reported
with its reason and the others still run. Every variant draws its initial weights on the device
(`run.init_device: run`; the same seed, so the same weights for every variant on one machine): the host's
draw, which keeps a seed's weights alike on any hardware, is serial, ~31 ns a parameter on one core
whatever the core count, ~3.5 minutes of each OLMoE-1B-7B variant. Prints each variant's line as it
finishes and, last, one JSON line with the variants and the ratios `auto_vs_portable`, `compiled_vs_auto`,
`fp8_native_vs_emulated`, `fp8_torchao_vs_native` (null where either side did not run). It exits 0
whenever it ran, whatever the variants did: a failure is an entry `{"failed": reason}` among the variants.

    python benchmarks/accelerator_training.py --data DIR [--shape mid|olmoe-1b-7b] [--steps 25]
        [--batch N] [--variants auto,compiled] [--device cuda] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 5
SHAPES = {
    "mid": {
        "model.vocab_size": 4096,
        "model.dim": 1024,
        "model.n_layers": 8,
        "model.n_heads": 16,
        "model.n_kv_heads": 4,
        "model.max_seq_len": 1024,
        "model.dense_layers": 1,
        "model.dense_ffn_dim": 2816,
        "model.moe.num_experts": 64,
        "model.moe.top_k": 8,
        "model.moe.expert_ffn_dim": 512,
        "data.seq_len": 1024,
        "optim.warmup_steps": 5,
    },
    "olmoe-1b-7b": {
        "model.vocab_size": 50304,
        "model.dim": 2048,
        "model.n_layers": 16,
        "model.n_heads": 16,
        "model.n_kv_heads": 16,
        "model.max_seq_len": 4096,
        "model.qk_norm": "true",
        "model.qk_norm_scope": "projection",
        "model.dense_layers": 0,
        "model.moe.num_experts": 64,
        "model.moe.top_k": 8,
        "model.moe.expert_ffn_dim": 1024,
        "data.seq_len": 4096,
        "optim.lr": 4.0e-4,
        "optim.warmup_steps": 5,
    },
}
# (sequences per micro-batch, micro-batches per step): the micro-batch is what memory bounds
BATCHES = {"mid": (16, 1), "olmoe-1b-7b": (1, 8)}
FP8 = {"precision.experts": "fp8"}
VARIANTS = {
    "portable": {"kernels.policy": "portable"},
    "auto": {"kernels.policy": "auto"},
    "compiled": {"kernels.policy": "auto", "train.compile": "blocks"},
    "fp8-emulated": {"kernels.policy": "portable", **FP8},
    "fp8-native": {"kernels.policy": "auto", **FP8},
    "fp8-torchao": {"kernels.policy": "auto", **FP8, 'kernels.ops."moe.fp8_grouped_mm"': "torchao"},
    "chunked-loss": {"kernels.policy": "auto", "train.loss_chunk": 1024},
}
# ratio name -> (numerator variant, denominator variant), by tokens/s
RATIOS = {
    "auto_vs_portable": ("auto", "portable"),
    "compiled_vs_auto": ("compiled", "auto"),
    "fp8_native_vs_emulated": ("fp8-native", "fp8-emulated"),
    "fp8_torchao_vs_native": ("fp8-torchao", "fp8-native"),
    "chunked_loss_vs_auto": ("chunked-loss", "auto"),
}
SPLIT = ("forward_s", "backward_s", "optimizer_s", "comm_s")
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")  # a traceback's last line: `torch.OutOfMemoryError: ...`


def run_variant(name: str, overrides: dict, args: argparse.Namespace, root: Path) -> dict:
    """One `ferry train` run; its medians, or `failed` with the reason the run gave."""
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    micro_batch, global_batch = batches(args)
    settings = {
        **SHAPES[args.shape],
        "train.micro_batch": micro_batch,
        "train.global_batch": global_batch,
        **overrides,
        "data.sources.0.path": args.data,
        "run.device": args.device,
        "run.dir": run_dir,
        "run.overwrite": "true",
        "checkpoint.enabled": "false",  # OLMoE-1B-7B's train state: ~80 GB to write, near the disk's size
        "run.init_device": "run",  # drawn by the GPU: the host's serial draw of 6.9B parameters takes ~3.5 min
        "train.steps": args.steps,
        "train.log_every": args.steps,
    }
    command = [sys.executable, "-m", "ferry", "train", str(REPO / "configs" / "tiny.yaml")]
    command += [f"{key}={value}" for key, value in settings.items()] + list(args.set)
    log = run_dir / "train.log"
    print(f"{name}: running ({log})", flush=True)
    with log.open("w") as output:
        returncode = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        return {"failed": _failure(log.read_text(errors="replace"), returncode)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [record for record in records if record["step"] > WARMUP_STEPS]
    run = json.loads((run_dir / "run.json").read_text())

    def median(key: str) -> float:
        return statistics.median(record[key] for record in measured)

    return {
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "step_s": median("step_s"),
        **{key: median(key) for key in SPLIT},
        "mem_peak_mib": max(record["mem_peak_mib"] for record in measured),
        "grouped_mm": run["kernels"]["ops"]["moe.grouped_mm"]["implementation"],
        "experts_kernel": run["precision"]["experts_kernel"],
        "experts_mode": run["precision"]["experts_mode"],
        "final_loss": records[-1]["loss"],
    }


def batches(args: argparse.Namespace) -> tuple[int, int]:
    """(sequences per micro-batch, sequences per step): `--batch` or the shape's micro-batch, its count kept."""
    micro_batch, micro_batches = BATCHES[args.shape]
    micro_batch = args.batch or micro_batch
    return micro_batch, micro_batch * micro_batches


def _failure(log: str, returncode: int) -> str:
    """What says why a run failed: ferry's error with the lines under it (an invalid config lists its problems),
    else a traceback's exception (an out-of-memory error), else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("ferry: ") and "error" in line]
    exceptions = [line for line in lines if EXCEPTION.match(line)]
    if errors:
        reason = " ".join(lines[errors[-1] :])
    else:
        reason = (exceptions or lines or [f"exit status {returncode}"])[-1]
    return reason if len(reason) <= 400 else reason[:397] + "..."


def describe(name: str, result: dict) -> str:
    if "failed" in result:
        return f"{name:13s} FAILED: {result['failed']}"
    split = " / ".join(f"{result[key] * 1e3:.0f}" for key in SPLIT)
    return (
        f"{name:13s} {result['tokens_per_s']:>10,.0f} tok/s  mfu {result['mfu']:.1%}  "
        f"step {result['step_s'] * 1e3:.1f} ms (fwd/bwd/opt/comm {split} ms)  "
        f"peak {result['mem_peak_mib'] / 1024:,.1f} GiB  grouped_mm {result['grouped_mm']}  "
        f"experts {result['experts_kernel']} ({result['experts_mode']})  loss {result['final_loss']:.4f}"
    )


def ratios(results: dict) -> dict:
    def ratio(top: str, bottom: str) -> float | None:
        a, b = results.get(top, {}), results.get(bottom, {})
        return a["tokens_per_s"] / b["tokens_per_s"] if "tokens_per_s" in a and "tokens_per_s" in b else None

    return {name: ratio(*pair) for name, pair in RATIOS.items()}


def _variants(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"variants are {', '.join(VARIANTS)}; got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared dataset (ferry data prepare)")
    parser.add_argument("--shape", choices=list(SHAPES), default="mid")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--batch", type=int, default=None,
        help="sequences per micro-batch (mid: 16, olmoe-1b-7b: 1); the step keeps the shape's micro-batch count",
    )
    parser.add_argument(
        "--variants", type=_variants, default=list(VARIANTS), help=f"a comma-separated subset of {','.join(VARIANTS)}"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name in args.variants:  # each line as soon as it is known: a call cut short keeps the finished variants
            results[name] = run_variant(name, VARIANTS[name], args, Path(root))
            print(describe(name, results[name]), flush=True)
    micro_batch, global_batch = batches(args)
    summary = {
        "benchmark": "accelerator_training",
        "shape": args.shape,
        "device": args.device,
        "steps": args.steps,
        "micro_batch": micro_batch,
        "global_batch": global_batch,
        "variants": results,
        **ratios(results),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

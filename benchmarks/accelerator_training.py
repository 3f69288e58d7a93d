"""Whole training steps on an accelerator: what the vendor expert kernels buy over the portable path.

The kernel bench (`ferry kernels bench`) times each op alone; this times `ferry train` itself on a
mid-size MoE (64 experts, top-8, 8 layers, 16k tokens a step), so launch overheads, the router,
attention and the optimizer count as they do in a run. Four variants, each its own process:

- `portable`: `kernels.policy=portable`, every op on the portable path, bfloat16 compute;
- `auto`: the approved vendor kernels (on an SM90 GPU, `torch_grouped_mm` for the expert GEMMs);
- `fp8-emulated`: FP8 expert GEMMs, portable (rounded to FP8, multiplied in bfloat16);
- `fp8-native`: FP8 expert GEMMs on the vendor kernel where one is approved.

Each reports the median tokens/s and MFU of its steps after the warm-up, and which experts
kernel the run recorded. Prints a table and, last, one JSON line with the ratios
`auto_vs_portable` and `fp8_native_vs_emulated`.

    python benchmarks/accelerator_training.py --data DIR [--steps 25] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 5
MODEL = {
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
    "train.global_batch": 16,
    "train.micro_batch": 16,
    "optim.warmup_steps": 5,
}
VARIANTS = {
    "portable": {"kernels.policy": "portable"},
    "auto": {"kernels.policy": "auto"},
    "fp8-emulated": {"kernels.policy": "portable", "precision.experts": "fp8"},
    "fp8-native": {"kernels.policy": "auto", "precision.experts": "fp8"},
}


def run_variant(name: str, overrides: dict, args: argparse.Namespace, root: Path) -> dict:
    run_dir = root / name
    settings = {
        **MODEL,
        **overrides,
        "data.sources.0.path": args.data,
        "run.device": args.device,
        "run.dir": run_dir,
        "run.overwrite": "true",
        "train.steps": args.steps,
        "train.log_every": args.steps,
    }
    command = [sys.executable, "-m", "ferry", "train", str(REPO / "configs" / "tiny.yaml")]
    command += [f"{key}={value}" for key, value in settings.items()]
    subprocess.run(command, check=True, cwd=REPO)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [record for record in records if record["step"] > WARMUP_STEPS]
    run = json.loads((run_dir / "run.json").read_text())
    return {
        "tokens_per_s": statistics.median(record["tokens_per_s"] for record in measured),
        "mfu": statistics.median(record["mfu"] for record in measured),
        "step_s": statistics.median(record["step_s"] for record in measured),
        "mem_peak_mib": max(record["mem_peak_mib"] for record in measured),
        "grouped_mm": run["kernels"]["ops"]["moe.grouped_mm"]["implementation"],
        "experts_kernel": run["precision"]["experts_kernel"],
        "experts_mode": run["precision"]["experts_mode"],
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared dataset (ferry data prepare)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = {name: run_variant(name, overrides, args, Path(root)) for name, overrides in VARIANTS.items()}
    for name, result in results.items():
        print(
            f"{name:13s} {result['tokens_per_s']:>10,.0f} tok/s  mfu {result['mfu']:.1%}  "
            f"step {result['step_s'] * 1e3:.1f} ms  peak {result['mem_peak_mib']:,.0f} MiB  "
            f"grouped_mm {result['grouped_mm']}  experts {result['experts_kernel']} ({result['experts_mode']})  loss {result['final_loss']:.4f}"
        )
    summary = {
        "benchmark": "accelerator_training",
        "device": args.device,
        "steps": args.steps,
        "variants": results,
        "auto_vs_portable": results["auto"]["tokens_per_s"] / results["portable"]["tokens_per_s"],
        "fp8_native_vs_emulated": results["fp8-native"]["tokens_per_s"] / results["fp8-emulated"]["tokens_per_s"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Whole training steps on an accelerator: what vendor kernels, compilation, activation checkpointing and FP8 buy.

The kernel bench (`ferry kernels bench`) times each op alone; this times `ferry train` itself, so
launch overheads, the router, attention and the optimizer count as they do in a run. Two shapes:

- `mid` (default): dim 1024, 8 layers (the first dense), 16 heads over 4 kv heads, 64 experts, top-8,
  expert width 512, vocabulary 4,096; one micro-batch of 16 sequences of 1,024 (16,384 tokens a step).
- `olmoe-1b-7b`: OLMoE-1B-7B's shape (as benchmarks/suites/olmoe-1b-7b.yaml): dim 2048, 16 MoE layers,
  16 heads with 16 kv heads, one query/key norm over the whole projection, 64 experts, top-8, expert
  width 1024, vocabulary 50,304, sequences of 4,096; 6.9B parameters, 1.3B active. Sized for one H200
  (141 GB; torch sees about 139 GiB). By ferry's estimate (`memory_estimate` in ferry/train/memory.py)
  the fp32 parameters, gradients and AdamW moments take 103 GiB, and one sequence of 4,096 adds 25 GiB at
  the end of the forward (its activations, the logits and the bf16 weight copies kept for the backward)
  or 26 GiB at the optimizer step: ~129 GiB. Keeping every activation, two sequences would need ~140 GiB,
  more than fits, so the default is one sequence a micro-batch and 8 micro-batches a step (32,768 tokens).
  Activation checkpointing (`train.activation_checkpointing`) lifts that bound: `selective` keeps the
  GEMM and attention outputs and recomputes the element-wise work in the backward, `full` recomputes
  whole blocks; by the estimate selective fits 2 sequences a micro-batch, full 4, and full with the head and
  loss by chunks (`train.loss_chunk=4096`) the whole step of 8, each weight then cast and its gradient added
  once a step. The `large-micro` variants set that up with `train.micro_batch: auto`: ferry picks the
  largest micro-batch its memory model says fits, the step keeping its sequences (8 here), and each line
  reports the micro-batch the run recorded. `fp8-torchao` keeps a padded copy of each expert GEMM's input for the
  backward (a few GiB more at this shape); a variant that does not fit is reported as failed.

Variants, each its own `ferry train` process, bfloat16 compute. ferry compiles blocks by default on
CUDA and ROCm (`train.compile: auto`), so the eager variants say `train.compile: none`:

- `portable`: `kernels.policy=portable`, every op on the portable path, eager;
- `auto`: the approved vendor kernels (on an SM90 GPU, `torch_grouped_mm` for the expert GEMMs), eager;
- `compiled`: `auto` with `train.compile=blocks` (each transformer block compiled);
- `checkpointed`, `checkpointed-full`: `compiled` with `train.activation_checkpointing` `selective`, `full`:
  what the recomputation costs at the same micro-batch;
- `large-micro`: `checkpointed-full` with `train.loss_chunk=4096` and `train.micro_batch=auto`;
  `large-micro-eager`: the same, eager;
- `fp8-emulated`: FP8 expert GEMMs, portable (rounded to FP8, multiplied in bfloat16), eager;
- `fp8-native`: FP8 expert GEMMs on the approved vendor kernel (`torch_scaled_grouped_mm` on SM90), eager;
- `fp8-torchao`: FP8 expert GEMMs on torchao's kernels, pinned (`kernels.ops."moe.fp8_grouped_mm"=torchao`)
  while their ledger entry is unapproved, eager; needs `pip install ferry-moe[gpu]`;
- `fp8-torchao-compiled`: `fp8-torchao` set up as `large-micro` (compiled, full checkpointing, chunked
  loss, the micro-batch ferry picks): FP8 measured against the best bfloat16 set-up, not against an eager one;
- `chunked-loss`: `auto` with `train.loss_chunk=1024` (the head and the loss by chunks of 1,024 tokens,
  no full logits), eager: its peak memory against `auto`'s is the point.

Each reports the medians over the steps after the warm-up of tokens/s, MFU (against the hardware
profile's peak for the compute dtype, bf16: FP8 expert GEMMs do not change it), the step and its
split (forward, backward, optimizer, time blocked in collectives), the peak memory, the micro-batch and
compile mode the run recorded, and which kernels it used. A variant that fails (out of memory, a kernel
that is not available) is reported with its reason and the others still run. Every variant draws its
initial weights on the device (`run.init_device: run`; the same seed, so the same weights for every
variant on one machine): the host's draw, which keeps a seed's weights alike on any hardware, is serial,
~31 ns a parameter on one core whatever the core count, ~3.5 minutes of each OLMoE-1B-7B variant.

`--trace VARIANT` records a torch.profiler trace (`profile.torch_trace`) of that variant's first step after
the warm-up and prints, under its line, where the GPU time went (benchmarks/trace_summary.py: busy share,
top kernels, GEMM / attention / element-wise / optimizer / collective shares). The profiler slows the
traced step's host side, so that step is left out of the medians; the kernel shares are unaffected, the
busy share of a launch-bound step reads low.

Prints each variant's line as it finishes and, last, one JSON line with the variants, the trace summary
(`trace`, null without `--trace`) and the ratios of tokens/s `auto_vs_portable`, `compiled_vs_auto`,
`checkpointed_vs_compiled`, `large_micro_vs_compiled`, `fp8_native_vs_emulated`, `fp8_torchao_vs_native`,
`fp8_torchao_compiled_vs_large_micro` (FP8's approval figure: approved at 1.1 or more) and
`chunked_loss_vs_auto` (null where either side did not run). It exits 0 whenever it ran, whatever the
variants did: a failure is an entry `{"failed": reason}` among the variants.

    python benchmarks/accelerator_training.py --data DIR [--shape mid|olmoe-1b-7b] [--steps 25]
        [--batch N] [--variants auto,compiled] [--trace VARIANT] [--device cuda] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
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
# (sequences per micro-batch, micro-batches per step): without activation checkpointing memory bounds the micro-batch
BATCHES = {"mid": (16, 1), "olmoe-1b-7b": (1, 8)}
EAGER = {"train.compile": "none"}  # ferry's default, auto, compiles blocks on CUDA and ROCm
COMPILED = {"train.compile": "blocks"}
SELECTIVE = {"train.activation_checkpointing": "selective"}
# full checkpointing and the head and loss by chunks of one sequence: what lets ferry's memory model fit the whole
# OLMoE-1B-7B step (8 sequences) in one forward on an H200; selective fits 2 (tests/test_step_shape.py)
LARGE_MICRO = {
    **COMPILED,
    "train.activation_checkpointing": "full",
    "train.loss_chunk": 4096,
    "train.micro_batch": "auto",
}
FP8 = {"precision.experts": "fp8"}
TORCHAO = {**FP8, 'kernels.ops."moe.fp8_grouped_mm"': "torchao"}
VARIANTS = {
    "portable": {"kernels.policy": "portable", **EAGER},
    "auto": {"kernels.policy": "auto", **EAGER},
    "compiled": {"kernels.policy": "auto", **COMPILED},
    "checkpointed": {"kernels.policy": "auto", **COMPILED, **SELECTIVE},
    "checkpointed-full": {"kernels.policy": "auto", **COMPILED, "train.activation_checkpointing": "full"},
    "large-micro": {"kernels.policy": "auto", **LARGE_MICRO},
    "large-micro-eager": {"kernels.policy": "auto", **LARGE_MICRO, **EAGER},
    "fp8-emulated": {"kernels.policy": "portable", **FP8, **EAGER},
    "fp8-native": {"kernels.policy": "auto", **FP8, **EAGER},
    "fp8-torchao": {"kernels.policy": "auto", **TORCHAO, **EAGER},
    "fp8-torchao-compiled": {"kernels.policy": "auto", **TORCHAO, **LARGE_MICRO},
    "chunked-loss": {"kernels.policy": "auto", "train.loss_chunk": 1024, **EAGER},
}
# ratio name -> (numerator variant, denominator variant), by tokens/s
RATIOS = {
    "auto_vs_portable": ("auto", "portable"),
    "compiled_vs_auto": ("compiled", "auto"),
    "checkpointed_vs_compiled": ("checkpointed", "compiled"),
    "large_micro_vs_compiled": ("large-micro", "compiled"),
    "fp8_native_vs_emulated": ("fp8-native", "fp8-emulated"),
    "fp8_torchao_vs_native": ("fp8-torchao", "fp8-native"),
    "fp8_torchao_compiled_vs_large_micro": ("fp8-torchao-compiled", "large-micro"),
    "chunked_loss_vs_auto": ("chunked-loss", "auto"),
}
TRACED_STEP = WARMUP_STEPS + 1
RANK0_TRACE = "traces/rank0-steps-*.json*"  # where ferry/metrics/trace.py writes rank 0's trace
SPLIT = ("forward_s", "backward_s", "optimizer_s", "comm_s")
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")  # a traceback's last line: `torch.OutOfMemoryError: ...`


def _sibling(name: str):
    """A module beside this file, whether this runs as a script or is loaded by path (the tests)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trace_summary = _sibling("trace_summary")


def settings(overrides: dict, args: argparse.Namespace, run_dir: Path, traced: bool = False) -> dict:
    """A variant's `ferry train` overrides: the shape, the batch, the variant's own keys (`overrides`), then what
    every run shares. A variant with `train.micro_batch: auto` keeps it: ferry picks that micro-batch, not
    `--batch`."""
    micro_batch, global_batch = batches(args)
    return {
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
        **({"profile.torch_trace": [TRACED_STEP, TRACED_STEP]} if traced else {}),
    }


def run_variant(name: str, overrides: dict, args: argparse.Namespace, root: Path, traced: bool = False) -> dict:
    """One `ferry train` run; its medians (and, traced, its trace's summary under `trace`), or `failed` with
    the reason the run gave."""
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "ferry", "train", str(REPO / "configs" / "tiny.yaml")]
    command += [f"{key}={value}" for key, value in settings(overrides, args, run_dir, traced).items()] + list(args.set)
    log = run_dir / "train.log"
    print(f"{name}: running ({log})", flush=True)
    with log.open("w") as output:
        returncode = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        return {"failed": _failure(log.read_text(errors="replace"), returncode)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [
        record for record in records if record["step"] > WARMUP_STEPS and not (traced and record["step"] == TRACED_STEP)
    ]
    run = json.loads((run_dir / "run.json").read_text())

    def median(key: str) -> float:
        return statistics.median(record[key] for record in measured)

    result = {
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "step_s": median("step_s"),
        **{key: median(key) for key in SPLIT},
        "mem_peak_mib": max(record["mem_peak_mib"] for record in measured),
        "micro_batch": micro_batch_used(run),
        "compile": (run.get("compile") or {}).get("mode"),
        "grouped_mm": run["kernels"]["ops"]["moe.grouped_mm"]["implementation"],
        "experts_kernel": run["precision"]["experts_kernel"],
        "experts_mode": run["precision"]["experts_mode"],
        "final_loss": records[-1]["loss"],
    }
    if traced:
        result["trace"] = _summarise_trace(run_dir)
    return result


def micro_batch_used(run: dict) -> int | None:
    """The sequences per micro-batch a run trained with, from its run.json: `micro_batch.chosen` (what
    `train.micro_batch: auto` picked, or the number it was given); None from a run.json without it."""
    chosen = (run.get("micro_batch") or {}).get("chosen")
    return chosen if isinstance(chosen, int) and not isinstance(chosen, bool) else None


def _summarise_trace(run_dir: Path) -> dict:
    """The summary of the run's rank-0 trace, or `failed` saying why there is none."""
    traces = sorted(run_dir.glob(RANK0_TRACE))
    if not traces:
        return {"failed": f"the run wrote no {RANK0_TRACE} under {run_dir}"}
    try:
        return trace_summary.summarise(traces[0])
    except trace_summary.TraceError as error:
        return {"failed": str(error)}


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
        return f"{name:20s} FAILED: {result['failed']}"
    split = " / ".join(f"{result[key] * 1e3:.0f}" for key in SPLIT)
    micro_batch = "?" if result["micro_batch"] is None else result["micro_batch"]
    return (
        f"{name:20s} {result['tokens_per_s']:>10,.0f} tok/s  mfu {result['mfu']:.1%}  "
        f"step {result['step_s'] * 1e3:.1f} ms (fwd/bwd/opt/comm {split} ms)  "
        f"peak {result['mem_peak_mib'] / 1024:,.1f} GiB  micro-batch {micro_batch}  compile {result['compile']}  "
        f"grouped_mm {result['grouped_mm']}  experts {result['experts_kernel']} ({result['experts_mode']})  "
        f"loss {result['final_loss']:.4f}"
    )


def describe_trace(name: str, trace: dict) -> str:
    if "failed" in trace:
        return f"{name}: no trace summary: {trace['failed']}"
    return f"{name}: step {TRACED_STEP} under the profiler, " + trace_summary.describe(trace)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared dataset (ferry data prepare)")
    parser.add_argument("--shape", choices=list(SHAPES), default="mid")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per micro-batch (mid: 16, olmoe-1b-7b: 1); the step keeps the shape's micro-batch count; "
        "variants with train.micro_batch=auto take ferry's choice instead",
    )
    parser.add_argument(
        "--variants", type=_variants, default=list(VARIANTS), help=f"a comma-separated subset of {','.join(VARIANTS)}"
    )
    parser.add_argument(
        "--trace",
        choices=list(VARIANTS),
        default=None,
        metavar="VARIANT",
        help=f"profile step {TRACED_STEP} of this variant (one of --variants) and print where its GPU time went",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.trace is not None and args.trace not in args.variants:
        parser.error(f"--trace {args.trace}: not among --variants ({','.join(args.variants)})")
    if args.trace is not None and args.steps <= TRACED_STEP:
        parser.error(f"--steps must exceed {TRACED_STEP} with --trace: the traced step is left out of the medians")
    return args


def main() -> None:
    args = parse_args()
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    results, trace = {}, None
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name in args.variants:  # each line as soon as it is known: a call cut short keeps the finished variants
            results[name] = run_variant(name, VARIANTS[name], args, Path(root), traced=name == args.trace)
            print(describe(name, results[name]), flush=True)
            if "trace" in results[name]:
                trace = {"variant": name, **results[name].pop("trace")}
                print(describe_trace(name, trace), flush=True)
    micro_batch, global_batch = batches(args)
    summary = {
        "benchmark": "accelerator_training",
        "shape": args.shape,
        "device": args.device,
        "steps": args.steps,
        "micro_batch": micro_batch,
        "global_batch": global_batch,
        "variants": results,
        "trace": trace,
        **ratios(results),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Where a profiled step's GPU time goes, from the chrome trace ferry writes with `profile.torch_trace`.

A trace opened in Perfetto answers one question at a time; the questions a training benchmark asks first
are always the same: is the GPU busy, which kernels take the time, and how much of it is matrix
multiplication (what MFU counts) against element-wise work, the optimizer and communication. This prints
those figures as text, so they can be read from a device call's output without the trace itself.

What it reports, all from events with a duration (`"ph": "X"`):

- the window: first event start to last event end, host and device events alike;
- GPU time: events whose `cat` is `kernel`, `gpu_memcpy` or `gpu_memset`, their durations summed
  (streams that run at once count twice) and their union (overlaps count once); the busy share is the
  union over the window;
- the top kernels by total time, named without namespaces, return type or argument list;
- GPU time by class, the first class whose pattern matches the kernel's name (case-insensitive), in
  this order:
    - `memcpy`, `memset`: the `gpu_memcpy` and `gpu_memset` events, by category, not by name;
    - `collectives`: nccl, rccl;
    - `optimizer`: multi_tensor_apply, adam (foreach and fused AdamW kernels; foreach gradient
      clipping lands here too);
    - `attention`: flash, fmha, sdpa, attention, attn (checked before GEMM: FlashAttention and cuDNN's
      attention kernels carry cutlass or wgmma in their names);
    - `gemm`: gemm, gemv, cutlass, cublas, xmma (sm80_xmma, sm90_xmma), nvjet, wgmma, grouped_mm,
      scaled_mm, splitKreduce (cuBLAS's split-K epilogue), Cijk_ (hipBLASLt on ROCm), fbgemm,
      triton_tem_ (inductor's matmul templates), matmul;
    - `other`, by name: sort, topk (the router's selection; gatherTopK would otherwise count as a gather);
    - `elementwise`: element-wise, reduction and data-movement kernels: elementwise, vectorized,
      unrolled, reduce, copy, cat (a word start: not scatter), fill, index, gather, scatter, softmax,
      norm, triton_poi_ / triton_red_ / triton_per_ (inductor's fused point-wise and reduction kernels);
    - `other`: those and the rest (random number generation, ...).

    python benchmarks/trace_summary.py TRACE [--top 15] [--json]

TRACE is the `.json` (or `.json.gz`) under `<run.dir>/traces`. Exits 2, naming the file, when it is
missing or not a chrome trace.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

GPU_CATEGORIES = {"kernel": None, "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
CLASS_PATTERNS = {
    "collectives": r"nccl|rccl",
    "optimizer": r"multi_tensor_apply|adam",
    "attention": r"flash|fmha|sdpa|attention|attn",
    "gemm": r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|grouped_mm|scaled_mm|splitkreduce|cijk_|fbgemm"
    r"|triton_tem_|matmul",
    "other": r"sort|topk",
    "elementwise": r"elementwise|vectorized|unrolled|reduce|copy|(?<![a-z])cat|fill|index|gather|scatter|softmax"
    r"|norm|triton_poi_|triton_red_|triton_per_",
}
CLASSES = ("gemm", "attention", "elementwise", "optimizer", "collectives", "memcpy", "memset", "other")
_PATTERNS = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in CLASS_PATTERNS.items()}
_NAMESPACE = re.compile(r"\(anonymous namespace\)::|\b\w+::")
NAME_WIDTH = 96


class TraceError(ValueError):
    """The file is missing or is not a chrome trace; the message names it."""


def summarise(path: str | Path, top: int = 15) -> dict:
    """The figures `describe` prints, as a JSON-ready dict; times in milliseconds, shares of GPU time
    (the summed durations) except `busy_share`, a share of the window."""
    events = _events(Path(path))
    timed = [event for event in events if event.get("ph") == "X" and "dur" in event and "ts" in event]
    gpu = [event for event in timed if str(event.get("cat", "")).lower() in GPU_CATEGORIES]
    window_us = _span(timed)
    gpu_us = sum(float(event["dur"]) for event in gpu)
    busy_us = _union(gpu)
    by_kernel: dict[str, list[float]] = {}
    by_class = {name: [0.0, 0] for name in CLASSES}
    for event in gpu:
        name, duration = short_name(str(event.get("name", ""))), float(event["dur"])
        kernel = by_kernel.setdefault(name, [0.0, 0])
        kernel[0] += duration
        kernel[1] += 1
        totals = by_class[kernel_class(str(event.get("name", "")), str(event.get("cat", "")))]
        totals[0] += duration
        totals[1] += 1
    ranked = sorted(by_kernel.items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return {
        "path": str(path),
        "window_ms": window_us / 1e3,
        "gpu_span_ms": _span(gpu) / 1e3,
        "gpu_ms": gpu_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "busy_share": busy_us / window_us if window_us > 0 else None,
        "launches": len(gpu),
        "classes": {
            name: {"ms": us / 1e3, "launches": launches, "share": us / gpu_us if gpu_us > 0 else None}
            for name, (us, launches) in by_class.items()
        },
        "top": [
            {"name": name, "ms": us / 1e3, "launches": launches, "share": us / gpu_us if gpu_us > 0 else None}
            for name, (us, launches) in ranked
        ],
    }


def describe(summary: dict) -> str:
    """The summary as lines of text: window and busy share, the classes, then the top kernels."""
    lines = [f"trace {summary['path']}"]
    if not summary["launches"]:
        lines.append(f"  window {summary['window_ms']:,.1f} ms; no GPU kernels in it (a CPU run records none)")
        return "\n".join(lines)
    busy = summary["busy_share"]
    lines.append(
        f"  window {summary['window_ms']:,.1f} ms, GPU busy {summary['busy_ms']:,.1f} ms"
        f" ({'n/a' if busy is None else f'{busy:.1%}'}); GPU time {summary['gpu_ms']:,.1f} ms in"
        f" {summary['launches']:,} launches (streams overlapping count twice)"
    )
    classes = [(name, figures) for name, figures in summary["classes"].items() if figures["launches"]]
    lines.append("  by class: " + ", ".join(f"{name} {figures['share']:.1%}" for name, figures in classes))
    lines.append(f"  top {len(summary['top'])} kernels by GPU time:")
    lines.append(f"  {'ms':>10} {'launches':>9} {'share':>7}  kernel")
    for kernel in summary["top"]:
        name = kernel["name"] if len(kernel["name"]) <= NAME_WIDTH else kernel["name"][: NAME_WIDTH - 3] + "..."
        lines.append(f"  {kernel['ms']:>10,.2f} {kernel['launches']:>9,} {kernel['share']:>7.1%}  {name}")
    return "\n".join(lines)


def kernel_class(name: str, category: str = "kernel") -> str:
    """The class a GPU event's time counts under: see the module docstring for the patterns and order."""
    by_category = GPU_CATEGORIES.get(category.lower())
    if by_category is not None:
        return by_category
    return next((label for label, pattern in _PATTERNS.items() if pattern.search(name)), "other")


def short_name(name: str) -> str:
    """A kernel's name without its return type, argument list and namespaces: the template arguments stay,
    they tell an add from a multiply."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    if name.endswith(")"):
        depth = 0
        for index in range(len(name) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index]
                break
    name = _NAMESPACE.sub("", name)
    return re.sub(r">\s+(?=>)", ">", re.sub(r"\s+", " ", name)).strip()


def _events(path: Path) -> list[dict]:
    """The trace's events: the object form (`{"traceEvents": [...]}`) or the bare array form."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise TraceError(f"{path}: cannot read it ({error.strerror or error})") from None
    try:
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        trace = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TraceError(f"{path}: not a chrome trace (not JSON: {error})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise TraceError(f"{path}: not a chrome trace (no traceEvents list)")
    return events


def _span(events: list[dict]) -> float:
    if not events:
        return 0.0
    return max(float(e["ts"]) + float(e["dur"]) for e in events) - min(float(e["ts"]) for e in events)


def _union(events: list[dict]) -> float:
    """Time covered by at least one event: intervals sorted by start, merged where they overlap."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a chrome trace (.json or .json.gz), as <run.dir>/traces/rank0-steps-*.json")
    parser.add_argument("--top", type=int, default=15, help="how many kernels to list (default 15)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object instead")
    args = parser.parse_args()
    if args.top < 0:
        parser.error("--top must be at least 0")
    try:
        summary = summarise(args.trace, top=args.top)
    except TraceError as error:
        print(f"trace_summary: {error}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary) if args.json else describe(summary))


if __name__ == "__main__":
    main()

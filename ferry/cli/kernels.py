"""`ferry kernels list | boundary | bench`: the kernel boundary, its ledger and its overhead budget."""

from __future__ import annotations

import argparse
from pathlib import Path

from ferry.cli.options import device_option


def add_kernels_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `kernels` and its actions on the `ferry` command's sub-parsers."""
    kernels = subparsers.add_parser("kernels", help="kernel ops, their implementations, the debt ledger, the budget")
    actions = kernels.add_subparsers(dest="kernels_command", required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="every op's implementations, availability here and ledger status")
    listing.add_argument(
        "--device", default="auto", type=device_option, help="judge availability on this device (default: auto)"
    )
    listing.set_defaults(handler=list_kernels)

    boundary = actions.add_parser("boundary", help="write the boundary document (abstracted, vendor-specific, cost)")
    boundary.add_argument("--output", type=Path, default=None, help="default: docs/boundary.md")
    boundary.set_defaults(handler=write_boundary_doc)

    bench = actions.add_parser("bench", help="time every available implementation on fixed inputs; budget verdicts")
    bench.add_argument("--device", default="auto", type=device_option, help="time the implementations on this device")
    bench.add_argument("--budget", type=float, default=None, help="throughput loss allowed (default: kernels config's)")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median)")
    bench.add_argument("--tokens", type=int, default=4096, help="routed tokens of the benchmark MoE layer")
    bench.add_argument("--dim", type=int, default=512, help="model width")
    bench.add_argument("--ffn", type=int, default=256, help="expert hidden width")
    bench.add_argument("--experts", type=int, default=64, help="experts of the layer")
    bench.add_argument("--top-k", type=int, default=8, help="experts each token is routed to")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="inputs and weights")
    bench.add_argument(
        "--history",
        default="runs/portability",
        help="portability directory the figures are appended to, for `ferry report` (default runs/portability)",
    )
    bench.add_argument(
        "--host-allocator",
        choices=["profile", "default", "keep_freed"],
        default="profile",
        help="the C allocator's preset while timing: the hardware profile's, as a training run on the device gets "
        "(cpu: keep_freed), or another to see what it is worth",
    )
    bench.set_defaults(handler=bench_kernels)


def list_kernels(args: argparse.Namespace) -> int:
    from ferry.kernels.boundary import list_rows
    from ferry.platform import resolve_device

    device = resolve_device(args.device)
    header = ("op", "implementation", "platform", f"available on {device}", "ledger")
    rows = [header, *list_rows(device)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0


def write_boundary_doc(args: argparse.Namespace) -> int:
    from ferry.kernels.boundary import BOUNDARY_DOC, write_boundary

    path = write_boundary(args.output or BOUNDARY_DOC)
    print(f"ferry: wrote {path}")
    return 0


def bench_kernels(args: argparse.Namespace) -> int:
    import datetime

    import torch

    from ferry.config import UserError
    from ferry.kernels import KernelsConfig
    from ferry.kernels.bench import BenchShape, run_bench
    from ferry.platform import environment_fingerprint, resolve_device
    from ferry.portability.report.history import KERNEL_BENCH, append_record, check_history_dir

    check_history_dir(args.history)
    budget = KernelsConfig().overhead_budget if args.budget is None else args.budget
    if not 0.0 <= budget < 1.0:
        raise UserError(f"--budget must lie in [0, 1), got {budget}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    sizes = {
        "--tokens": args.tokens,
        "--dim": args.dim,
        "--ffn": args.ffn,
        "--experts": args.experts,
        "--top-k": args.top_k,
    }
    for flag, value in sizes.items():
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.top_k > args.experts:
        raise UserError(f"--top-k ({args.top_k}) cannot exceed --experts ({args.experts})")
    shape = BenchShape(tokens=args.tokens, dim=args.dim, ffn=args.ffn, experts=args.experts, top_k=args.top_k)
    device = resolve_device(args.device)
    host_allocator = _host_allocator(args.host_allocator, device)
    report = run_bench(device, budget, shape, args.repeats, getattr(torch, args.dtype), _recipes(device))
    print(f"host allocator: {host_allocator['preset']}" + ("" if host_allocator["applied"] else " (not applied)"))
    for line in report.lines():
        print(line)
    record = {
        "kind": "kernel-bench",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "repeats": args.repeats,
        **report.as_record(),
        "host_allocator": host_allocator,
        "environment": environment_fingerprint(device),
    }
    print(f"ferry: figures appended to {append_record(args.history, KERNEL_BENCH, record)}")
    return 0


def _host_allocator(choice: str, device) -> dict:
    """Apply the allocator preset the timings are taken under. A kernel's verdict must come from the conditions
    a training run on the device has: a kernel that allocates large temporaries pays page faults under the C
    library's default that a CPU run, under its profile's `keep_freed`, never pays (and the other way round)."""
    from ferry.platform.allocator import apply_host_allocator
    from ferry.platform.hardware import resolve_profile

    return apply_host_allocator(resolve_profile("auto", device).host_allocator if choice == "profile" else choice)


def _recipes(device) -> dict:
    """The recipe each low-precision expert op is benched with: the formats of this device's hardware profile."""
    from ferry.platform.hardware import resolve_profile
    from ferry.precision import PrecisionConfig, resolve_precision
    from ferry.precision.kernels import low_precision_op

    profile = resolve_profile("auto", device)
    recipes = {}
    for kind in ("fp8", "mxfp8"):
        recipe = resolve_precision(PrecisionConfig(experts=kind, on_unsupported="emulate"), profile).recipe
        recipes[low_precision_op(recipe)] = recipe
    return recipes

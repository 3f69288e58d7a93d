"""`ferry hardware show | measure`: the hardware profile a run on this machine uses, and the CPU peak behind MFU."""

from __future__ import annotations

import argparse

from ferry.cli.options import device_option


def add_hardware_commands(commands) -> None:
    hardware = commands.add_parser("hardware", help="the hardware profile of this machine and its measured CPU peak")
    actions = hardware.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the profile `hardware: auto` resolves to here")
    show.add_argument("--device", default="auto", type=device_option, help="auto, cpu, cuda, ...")
    show.set_defaults(handler=show_profile)
    measure = actions.add_parser("measure", help="measure this CPU's matmul peaks again and cache them")
    measure.add_argument("--seconds", type=float, default=2.0, help="best-of window per dtype (default 2.0)")
    measure.add_argument("--replace", action="store_true", help="keep this measurement, not the best one so far")
    measure.set_defaults(handler=measure_peak)


def show_profile(args: argparse.Namespace) -> int:
    from ferry.platform import resolve_device
    from ferry.platform.hardware import cached_cpu_peak, measured_cpu_profile, resolve_profile

    device = resolve_device(args.device)
    profile = resolve_profile("auto", device)
    if profile.measure_peak and device.type == "cpu":
        profile = measured_cpu_profile()
    print(f"profile {profile.name} ({profile.vendor}) for {device}")
    for dtype, tflops in profile.peak_tflops.items():
        print(f"  peak {dtype:6s} {tflops * 1e3:10.1f} GFLOP/s")
    entry = cached_cpu_peak() if device.type == "cpu" else None
    if entry is not None:
        print(
            f"  best fp32 figure measured {entry['measured_at']} at load average {entry['load_average']} on "
            f"{entry['cores']} cores; `ferry hardware measure` on a quiet machine measures again"
        )
    return 0


def measure_peak(args: argparse.Namespace) -> int:
    from ferry.config import UserError
    from ferry.platform.hardware import cached_cpu_peak, measure_cpu_peak

    if args.seconds <= 0:
        raise UserError(f"--seconds must be positive, got {args.seconds}")
    before = cached_cpu_peak()
    entry = measure_cpu_peak(seconds=args.seconds, replace=args.replace)
    for dtype, tflops in entry["peak_tflops"].items():
        was = None if before is None else before["peak_tflops"].get(dtype)
        previous = "" if was is None else f" (was {was * 1e3:.1f})"
        print(f"ferry: peak {dtype:6s} {tflops * 1e3:10.1f} GFLOP/s{previous}")
    print(
        f"ferry: the fp32 figure kept was measured {entry['measured_at']} at load average {entry['load_average']} "
        f"on {entry['cores']} cores; cached for MFU"
    )
    return 0

"""`ferry compare` and `ferry plot`: judge and draw runs from their metrics.jsonl."""

from __future__ import annotations

import argparse


def add_metrics_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `compare` and `plot` on the `ferry` command's sub-parsers."""
    compare = subparsers.add_parser(
        "compare",
        help="judge whether two runs' early trajectories agree within a named tolerance profile",
        description="Exit code 0 when run B agrees with run A, 1 when it does not, 2 on bad input.",
    )
    compare.add_argument("run_a", help="reference run directory (or its metrics.jsonl)")
    compare.add_argument("run_b", help="candidate run directory (or its metrics.jsonl)")
    compare.add_argument(
        "--profile",
        default=None,
        help="bitwise | same-hardware | cross-accelerator | sampled (ferry/portability/tolerances.yaml); "
        "default same-hardware",
    )
    compare.add_argument("--steps", type=int, default=None, help="judge the first N steps (default: the profile's)")
    compare.add_argument("--metric", default=None, help="record key to compare (default: the profile's, e.g. loss)")
    compare.add_argument(
        "--seed-run",
        action="append",
        default=[],
        help="a run of run A's config with another seed, for a profile judged against the seed spread (repeatable)",
    )
    compare.add_argument("--output", default=None, help="where the PNG and JSON verdict go (default: run B's dir)")
    compare.set_defaults(handler=_compare)

    plot = subparsers.add_parser("plot", help="draw loss, throughput, time split and expert load as PNGs")
    plot.add_argument("run", help="run directory (or its metrics.jsonl)")
    plot.add_argument("--output", default=None, help="directory for the PNGs (default: RUN/plots)")
    plot.set_defaults(handler=_plot)


def _compare(args: argparse.Namespace) -> int:
    from ferry.portability import DEFAULT_PROFILE, compare_runs

    verdict = compare_runs(
        args.run_a,
        args.run_b,
        profile=args.profile or DEFAULT_PROFILE,
        steps=args.steps,
        metric=args.metric,
        output_dir=args.output,
        seed_runs=args.seed_run,
    )
    print(f"ferry: {verdict.summary()}")
    return 0 if verdict.passed else 1


def _plot(args: argparse.Namespace) -> int:
    from ferry.metrics.plots import plot_run

    result = plot_run(args.run, args.output)
    for path in result.written:
        print(f"ferry: wrote {path}")
    for name, reason in result.skipped.items():
        print(f"ferry: skipped {name}: {reason}")
    return 0

"""`ferry rehearse` (one machine, or `start` and `finish` on two), `ferry report`, `ferry bench` and `ferry cost`.

Exit codes: 0 the move passed, 1 it failed (or could not be carried out), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ferry.cli.options import parse_forms
from ferry.config import UserError

_FORMS = """usage:
  ferry rehearse CONFIG [KEY=VALUE ...] --from ENV --to ENV [--steps N] [--switch-at K] [--profile P] [--dir DIR]
                 [--history DIR]                          the whole drill on this machine
  ferry rehearse start CONFIG [KEY=VALUE ...] --from ENV --out BUNDLE [--steps N] [--switch-at K] [--dir DIR]
                                                          the source half: train, write a bundle
  ferry rehearse finish BUNDLE --to ENV [KEY=VALUE ...] [--profile P] [--dir DIR] [--history DIR]
                                                          the target half, on another machine: resume, judge

ENV is a file or the name of a file in configs/environments/ (cpu, cpu-ep2, cpu-bf16-portable, h100-numerics,
mi300x-numerics, cuda). Exit code 0: PASS, 1: FAIL, 2: bad input (nothing recorded)."""


def add_portability_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `rehearse` and `report` on the `ferry` command's sub-parsers."""
    rehearse = subparsers.add_parser(
        "rehearse",
        add_help=False,
        help="prove a move between environments: train, checkpoint, resume, judge",
    )
    rehearse.add_argument("argv", nargs=argparse.REMAINDER)
    rehearse.set_defaults(handler=_rehearse, forms=parse_rehearse)

    bench = subparsers.add_parser(
        "bench",
        help="measure a benchmark suite here (same model, same token values, same weights everywhere)",
        description="Exit code 0 with a record written, 1 when the measurement failed, 2 on bad input.",
    )
    bench.add_argument("suite", help="a suite file or the name of one in benchmarks/suites/ (moe-tiny, ...)")
    bench.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. kernels.policy=portable"
    )
    bench.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None, help="default: the suite's")
    bench.add_argument("--nproc", type=int, default=None, help="local ranks (default: the suite's)")
    bench.add_argument("--out", required=True, help="the JSON record to write")
    bench.add_argument("--dir", default=None, help="working directory (default runs/bench/<suite>-<time>)")
    bench.set_defaults(handler=_bench)

    cost = subparsers.add_parser(
        "cost",
        help="turn bench records into $ per million tokens and time to train, rented and owned",
        description="Refuses records of different suites or inputs (exit 2).",
    )
    cost.add_argument("records", nargs="+", help="JSON records written by `ferry bench` (same suite, same inputs)")
    cost.add_argument("--tokens", type=float, default=None, help="token budget (default 7.1e12, Instella-MoE)")
    cost.add_argument("--devices", type=int, default=None, help="devices to train it on (default 128)")
    cost.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="PROFILE=USD_PER_HOUR",
        help="rent per device-hour for a hardware profile (repeatable)",
    )
    cost.add_argument(
        "--own",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="owned-hardware assumption: depreciation_years, pue, electricity_usd_per_kwh, "
        "utilization, system_share, purchase_price_usd.PROFILE, power_kw.PROFILE (repeatable)",
    )
    cost.add_argument("--out", required=True, help="directory for cost.json, cost.md and the charts")
    cost.set_defaults(handler=_cost)

    drill = subparsers.add_parser(
        "drill",
        help="a failure drill: the job uninterrupted and under random faults, whose final states must match",
        description="Exit code 0 when the drilled run ends bitwise equal to the uninterrupted one, 1 when not, "
        "2 on bad input.",
    )
    drill.add_argument("config", help="YAML run config")
    drill.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    drill.add_argument("--nproc", type=int, default=1, help="local ranks (default 1)")
    drill.add_argument("--faults", type=int, default=3, help="faults to inject (default 3)")
    drill.add_argument("--seed", type=int, default=0, help="draws the fault schedule (default 0)")
    drill.add_argument("--max-restarts", type=int, default=None, help="restart budget (default: faults + 2)")
    drill.add_argument("--dir", default=None, help="working directory (default runs/drills/<name>-seed<S>)")
    drill.set_defaults(handler=_drill)

    report = subparsers.add_parser(
        "report", help="the portability report (md, json, self-contained html, png) from the rehearsal history"
    )
    report.add_argument(
        "--history", default="runs/portability", help="portability directory (default runs/portability)"
    )
    report.add_argument("--out", required=True, help="directory to write report.md, report.json, report.html into")
    report.add_argument(
        "--fresh-days", type=int, default=90, help="a passing rehearsal proves a path for this many days (default 90)"
    )
    report.set_defaults(handler=_report)


def parse_rehearse(argv: list[str]) -> tuple[str, argparse.Namespace | None]:
    """The form (`rehearse`, `start`, `finish`, or `help` when asked or given nothing) and its options."""
    return parse_forms(argv, _parser, ("start", "finish"), "rehearse")


def _rehearse(args: argparse.Namespace) -> int:
    from ferry.portability.rehearsal.rehearse import RehearsalError, finish, rehearse, start

    form, options = args.options
    if form == "help":
        print(_FORMS, file=sys.stdout if args.argv else sys.stderr)
        return 0 if args.argv else 2
    overrides = options.overrides
    if form != "start":
        from ferry.portability.report.history import check_history_dir

        check_history_dir(options.history)
    try:
        if form == "start":
            start(
                options.config,
                overrides,
                options.source,
                options.out,
                steps=options.steps,
                switch_at=options.switch_at,
                work_dir=options.dir,
            )
            return 0
        if form == "finish":
            result = finish(
                options.bundle,
                options.target,
                overrides,
                work_dir=options.dir,
                profile=options.profile,
                history_dir=options.history,
            )
        else:
            result = rehearse(
                options.config,
                overrides,
                options.source,
                options.target,
                steps=options.steps,
                switch_at=options.switch_at,
                work_dir=options.dir,
                profile=options.profile,
                history_dir=options.history,
            )
    except RehearsalError as exc:
        print(f"ferry: rehearse: {exc}", file=sys.stderr)
        return 1
    return result.exit_code


def _parser(form: str) -> argparse.ArgumentParser:
    prog = "ferry rehearse" if form == "rehearse" else f"ferry rehearse {form}"
    parser = argparse.ArgumentParser(prog=prog, exit_on_error=True)
    if form == "finish":
        parser.add_argument("bundle", help="a bundle written by `ferry rehearse start`")
    else:
        parser.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    if form != "finish":
        parser.add_argument("--from", dest="source", required=True, metavar="ENV", help="the source environment")
        parser.add_argument("--steps", type=int, default=None, help="steps in all (default: the config's train.steps)")
        parser.add_argument("--switch-at", type=int, default=None, help="the step the run moves at (default steps/2)")
    if form != "start":
        parser.add_argument("--to", dest="target", required=True, metavar="ENV", help="the target environment")
        parser.add_argument(
            "--profile",
            default=None,
            help="tolerance profile (default: same-hardware when only layout, kernels or collectives differ, "
            "else cross-accelerator)",
        )
        parser.add_argument("--history", default="runs/portability", help="where the verdict is appended")
    if form == "start":
        parser.add_argument("--out", required=True, help="the bundle directory to write")
    parser.add_argument("--dir", default=None, help="working directory for the legs' runs (default under runs/)")
    return parser


def _bench(args: argparse.Namespace) -> int:
    from ferry.portability.bench.bench import BenchError, run_bench

    unknown = [item for item in args.overrides if "=" not in item]
    if unknown:
        raise UserError(f"ferry bench: unrecognized arguments: {' '.join(unknown)}")
    try:
        run_bench(args.suite, args.overrides, out=args.out, device=args.device, nproc=args.nproc, work_dir=args.dir)
    except BenchError as exc:
        print(f"ferry: bench: {exc}", file=sys.stderr)
        return 1
    return 0


def _cost(args: argparse.Namespace) -> int:
    from ferry.portability.bench.cost_report import write_cost

    result = write_cost(
        args.records, args.out, tokens=args.tokens, devices=args.devices, prices=args.price, own=args.own
    )
    for path in result.written:
        print(f"ferry: wrote {path}")
    return 0


def _drill(args: argparse.Namespace) -> int:
    from ferry.portability.drill import run_drill

    unknown = [item for item in args.overrides if "=" not in item]
    if unknown:
        raise UserError(f"ferry drill: unrecognized arguments: {' '.join(unknown)}")
    result = run_drill(
        args.config,
        args.overrides,
        nproc=args.nproc,
        faults=args.faults,
        seed=args.seed,
        max_restarts=args.max_restarts,
        work_dir=args.dir,
    )
    return 0 if result.passed else 1


def _report(args: argparse.Namespace) -> int:
    from ferry.portability.report.report import write_report

    if args.fresh_days < 1:
        raise UserError(f"--fresh-days must be at least 1, got {args.fresh_days}")
    if Path(args.history).is_file():
        raise UserError(f"--history {args.history!r} is a file; give the directory that holds rehearsals.jsonl")
    if not Path(args.history).is_dir():
        print(
            f"ferry: note: no rehearsal history at {args.history} (no rehearsal has written there): every "
            "environment is reported as not proven",
            file=sys.stderr,
        )
    result = write_report(args.history, args.out, fresh_days=args.fresh_days)
    for line in result.lines:
        print(line)
    return 0

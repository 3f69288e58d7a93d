"""`ferry pipeline run FILE` and `ferry pipeline show DIR`: training stages as one recorded chain."""

from __future__ import annotations

import argparse


def add_pipeline_commands(commands) -> None:
    pipeline = commands.add_parser("pipeline", help="run a chain of training stages and show its lineage")
    actions = pipeline.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run", help="run the stages in order; finished ones are skipped, an interrupted one resumes"
    )
    run.add_argument("file", help="a pipeline file, e.g. configs/pipelines/tiny.yaml")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config keys for every stage")
    run.add_argument("--dir", default=None, help="where the stages go (default runs/pipelines/<name>)")
    run.add_argument("--nproc", type=int, default=1, metavar="N", help="local ranks per stage (a stage's nproc wins)")
    run.add_argument("--rerun", default=None, metavar="STAGE", help="run this stage and every later one again")
    run.set_defaults(handler=_run)
    show = actions.add_parser("show", help="print a pipeline directory's lineage")
    show.add_argument("dir", help="the pipeline directory (its lineage.json)")
    show.set_defaults(handler=_show)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ferry.config import UserError
    from ferry.stages import lineage_lines, load_pipeline, run_pipeline

    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    directory = Path(args.dir) if args.dir else Path("runs") / "pipelines" / load_pipeline(args.file).name
    lineage = run_pipeline(args.file, directory, args.overrides, args.nproc, args.rerun)
    print("\n".join(lineage_lines(directory)))
    return 0 if all(stage["status"] == "finished" for stage in lineage.stages.values()) else 1


def _show(args: argparse.Namespace) -> int:
    from ferry.stages import lineage_lines

    print("\n".join(lineage_lines(args.dir)))
    return 0

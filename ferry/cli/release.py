"""`ferry release PIPELINE_DIR --out DIR`, `ferry release verify DIR`, `ferry release replay DIR --stage NAME`,
`ferry release branch DIR --stage NAME --out RUN_DIR`.

`verify` and `replay` answer like the other verifying commands: exit 0 pass, 1 a failed check (named), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from ferry.cli.options import complete_help, parse_forms

_FORMS = """usage: ferry release PIPELINE_DIR --out DIR [--optimizer] [--data] [--no-export] [--seed-runs]
       ferry release RUN_DIR --out DIR [...]
       ferry release verify DIR
       ferry release replay DIR --stage NAME [--steps N] [--env ENV] [--work DIR] [KEY=VALUE ...]
       ferry release branch DIR --stage NAME [--out RUN_DIR] [--nproc N] [KEY=VALUE ...]

  PIPELINE_DIR --out DIR   package a finished pipeline (ferry pipeline run) as a verifiable release
  RUN_DIR --out DIR        package one finished run (ferry train) as a one-stage release
  verify DIR               check every file's sha256 and the stage chain; exit 0 pass, 1 fail, 2 not a release
  replay DIR               train a stage's first steps again from the release and judge them against the
                           recorded curve; exit 0 pass, 1 fail (naming the profile), 2 bad input
  branch DIR               train a new run from a stage of the release (its config and data, its final
                           checkpoint's weights and optimizer state where carried), from here or anywhere"""


def add_release_commands(commands) -> None:
    release = commands.add_parser(
        "release",
        help="package a finished pipeline as a verifiable release; verify or replay one",
        description=_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    release.add_argument("argv", nargs=argparse.REMAINDER)
    release.set_defaults(handler=_release, forms=parse_release)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    build = argparse.ArgumentParser(prog="ferry release", description="package a finished pipeline or run")
    build.add_argument(
        "pipeline_dir", help="a pipeline directory (ferry pipeline run --dir), or a run directory (ferry train)"
    )
    build.add_argument("--out", required=True, help="the release directory to write (new or empty)")
    build.add_argument(
        "--optimizer",
        action="store_true",
        help="keep each checkpoint's optimizer state (AdamW's moments or Muon's momentum, as it was trained)",
    )
    build.add_argument("--data", action="store_true", help="include the data files, not only their manifests")
    build.add_argument("--no-export", action="store_true", help="leave out the transformers exports")
    build.add_argument(
        "--seed-runs",
        action="store_true",
        help="train and carry the seed runs a replay of a sampling stage (GRPO) is judged against",
    )
    verify = argparse.ArgumentParser(prog="ferry release verify", description="verify a release")
    verify.add_argument("dir", help="a release directory")
    replay = argparse.ArgumentParser(prog="ferry release replay", description="replay a stage of a release")
    replay.add_argument("dir", help="a release directory")
    replay.add_argument("--stage", required=True, help="the stage to replay")
    replay.add_argument("--steps", type=int, default=None, help="how many of its first steps (default: all recorded)")
    replay.add_argument("--env", default=None, help="an environment file or name (default: the recorded config)")
    replay.add_argument(
        "--work",
        default=None,
        help="where the replay runs, outside the release (default runs/release-replay/<pipeline>-<stage>, or "
        "<release>-replays/<pipeline>-<stage> when run from inside the release)",
    )
    replay.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config keys laid over the environment's, judged as part of it",
    )
    branch = argparse.ArgumentParser(prog="ferry release branch", description="train a new run from a released stage")
    branch.add_argument("dir", help="a release directory")
    branch.add_argument("--stage", required=True, help="the stage to start from")
    branch.add_argument(
        "--out",
        default=None,
        help="the new run's directory (run.dir), outside the release (default runs/release-branch/<pipeline>-<stage>, "
        "or <release>-branches/<pipeline>-<stage> when run from inside the release)",
    )
    branch.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="start N local ranks (as ferry train --nproc N)"
    )
    branch.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted config keys laid over the stage's config"
    )
    return {
        name: complete_help(parser)
        for name, parser in {"build": build, "verify": verify, "replay": replay, "branch": branch}.items()
    }


def parse_release(argv: list[str]) -> tuple[str, argparse.Namespace | None]:
    """The form (`build`, `verify`, `replay`, `branch`, or `help` when asked or given nothing) and its options."""
    return parse_forms(argv, lambda form: _parsers()[form], ("verify", "replay", "branch"), "build")


def _release(args: argparse.Namespace) -> int:
    form, options = args.options
    if form == "help":
        print(_FORMS, file=sys.stdout if args.argv else sys.stderr)
        return 0 if args.argv else 2
    return {"build": _build, "verify": _verify, "replay": _replay, "branch": _branch}[form](options)


def _build(options: argparse.Namespace) -> int:
    from ferry.portability.release.build import build_release
    from ferry.portability.release.seeds import carry_seed_runs

    content = build_release(
        options.pipeline_dir,
        options.out,
        optimizer=options.optimizer,
        data=options.data,
        export=not options.no_export,
    )
    if options.seed_runs and carry_seed_runs(Path(options.out), say=lambda line: print(line, file=sys.stderr)):
        content = json.loads((Path(options.out) / "release.json").read_text(encoding="utf-8"))
    total = sum(record["bytes"] for record in content["files"].values())
    print(
        f"ferry: release {options.out}: {len(content['stages'])} stage(s) "
        f"({' -> '.join(stage['name'] for stage in content['stages'])}), {len(content['data'])} data source(s), "
        f"{len(content['files'])} files, {total:,} bytes; manifest {options.out}/release.json, model card "
        f"{options.out}/README.md"
    )
    return 0


def _verify(options: argparse.Namespace) -> int:
    from ferry.portability.release.verify import verify_release

    check = verify_release(options.dir)
    print("\n".join(check.lines()))
    return 0 if check.passed else 1


def _replay(options: argparse.Namespace) -> int:
    from ferry.portability.release.replay import replay_stage, write_summary

    replay = replay_stage(
        options.dir,
        options.stage,
        options.steps,
        options.env,
        options.work,
        say=lambda line: print(line, file=sys.stderr),
        overrides=options.overrides,
    )
    write_summary(replay, replay.run_dir.parent / "replay.json")
    print("\n".join(replay.lines()))
    return 0 if replay.passed else 1


def _branch(options: argparse.Namespace) -> int:
    """The branch's config composed from the release, then `ferry train` on it (its ranks read it from a file
    that lives as long as they do; the run keeps the resolved config in RUN_DIR/config.yaml, which
    `ferry train RUN_DIR/config.yaml resume=latest` continues)."""
    from ferry.cli.training import run_training
    from ferry.portability.release.branch import branch_config

    raw = branch_config(options.dir, options.stage, options.out, options.overrides)
    with tempfile.TemporaryDirectory(prefix="ferry-branch-") as scratch:
        config = Path(scratch) / f"{options.stage}.yaml"
        config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return run_training(str(config), [], nproc=options.nproc)

"""`ferry ckpt inspect DIR` and `ferry ckpt verify DIR`: look into a checkpoint without training."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect and verify checkpoints")
    actions = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    inspect = actions.add_parser("inspect", help="step, layout, files, and every tensor with dtype, shape and size")
    inspect.add_argument("dir", help="a checkpoint directory, e.g. runs/tiny/checkpoints/step-00000300")
    inspect.set_defaults(handler=_inspect)
    verify = actions.add_parser(
        "verify", help="check files, sizes, every digest (sha256, xxh3_128) and headers; exit 0 valid, 1 invalid"
    )
    verify.add_argument("dir", help="a checkpoint directory")
    verify.set_defaults(handler=_verify)


def _inspect(args: argparse.Namespace) -> int:
    from ferry.checkpoint import inspect_lines

    print("\n".join(inspect_lines(Path(args.dir))))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Invalid is an answer, not a usage error: exit 1 with the reason (a path that does not exist exits 2)."""
    from ferry.checkpoint import CheckpointError, verify_lines

    try:
        lines = verify_lines(Path(args.dir))
    except CheckpointError as exc:
        print(f"ferry: checkpoint {args.dir} is invalid: {exc}")
        return 1
    print("\n".join(lines))
    return 0

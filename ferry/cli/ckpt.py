"""`ferry ckpt inspect DIR`, `ferry ckpt verify DIR` and `ferry ckpt average CKPT... --out DIR`: checkpoints
without training."""

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
    average = actions.add_parser("average", help="average the weights of checkpoints of one model (a soup)")
    average.add_argument("checkpoints", nargs="+", help="two or more checkpoint directories")
    average.add_argument("--out", required=True, help="directory to write the averaged checkpoint into (step-N/)")
    average.add_argument("--weights", default=None, help="comma-separated weights, one per checkpoint (default equal)")
    average.add_argument(
        "--optimizer",
        choices=["drop", "average"],
        default="drop",
        help="drop the optimizer's state (default) or average it too (AdamW's moments, Muon's momentum; step "
        "counts: the largest)",
    )
    average.set_defaults(handler=_average)


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


def _average(args: argparse.Namespace) -> int:
    from ferry.checkpoint.average import average_checkpoints
    from ferry.config import UserError

    weights = None
    if args.weights is not None:
        try:
            weights = [float(value) for value in args.weights.split(",")]
        except ValueError:
            raise UserError(f"--weights {args.weights!r}: comma-separated numbers, one per checkpoint") from None
    result = average_checkpoints(args.checkpoints, args.out, weights, args.optimizer)
    shares = ", ".join(f"{weight:.3g}" for weight in result.weights)
    optimizer = "averaged" if result.optimizer == "average" else "dropped"
    print(
        f"ferry: averaged {len(args.checkpoints)} checkpoints (weights {shares}; optimizer state {optimizer}) "
        f"into {result.path}: {result.tensors} tensors"
    )
    print(f"  start a stage from it: ferry train CONFIG init_from={result.path}")
    return 0

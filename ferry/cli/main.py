"""`ferry` entry point: sub-commands, and the rule that bad input exits 2 with one clear line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ferry.cli import ckpt
from ferry.cli.hardware import add_hardware_commands
from ferry.cli.inference import add_inference_commands
from ferry.cli.interop import add_interop_commands
from ferry.cli.kernels import add_kernels_commands
from ferry.cli.launch import add_launch_command
from ferry.cli.metrics import add_metrics_commands
from ferry.cli.models import add_models_commands
from ferry.cli.options import complete_help, refuse_unknown_options
from ferry.cli.pipeline import add_pipeline_commands
from ferry.cli.portability import add_portability_commands
from ferry.cli.release import add_release_commands
from ferry.config import UserError
from ferry.platform.process import Stopped, stop_on_sigterm


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command(argv)
        return args.handler(args)
    except UserError as exc:
        print(f"ferry: {_rank_prefix()}error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
        # a path given where a directory is made or a file written is taken by the other kind: the user's path
        print(f"ferry: {_rank_prefix()}error: {exc.filename!r}: {exc.strerror.lower()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ferry: {_rank_prefix()}interrupted", file=sys.stderr)
        return 130
    except Stopped as exc:
        print(f"ferry: {_rank_prefix()}stopped by {exc}", file=sys.stderr)
        exc.end_process()
        return exc.exit_code


def parse_command(argv: list[str]) -> argparse.Namespace:
    """The command line as `ferry` reads it, every form and option checked and nothing run: what `main` runs,
    and what the documentation's check parses every quoted command with. A bad argument is a `UserError` or
    argparse's exit 2, as from `main`."""
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "argv"):  # a command that parses its own arguments (`rehearse` and its forms)
        args.argv = [*extra, *args.argv]
    elif extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    elif extra:  # overrides written after an option such as --nproc
        refuse_unknown_options(extra, argv)
        args.overrides = [*args.overrides, *extra]
    if hasattr(args, "forms"):
        args.options = args.forms(list(args.argv))
    return args


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Portable training for mixture-of-experts models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a model from a YAML config plus dotted overrides")
    train.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.steps=50 run.dir=/tmp/x resume=latest"
    )
    train.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="start N local ranks (as torchrun --nproc-per-node N)"
    )
    train.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help="replace the config's model section with a named shape (`ferry models` lists them); overrides follow",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="K",
        help="supervise: after a failure restart every rank from the newest valid checkpoint, up to K times",
    )
    train.set_defaults(handler=_train)

    data = commands.add_parser("data", help="prepare token datasets")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prepare = data_commands.add_parser("prepare", help="tokenize text into memory-mapped shards with a manifest")
    prepare.add_argument(
        "inputs",
        nargs="*",
        help=".txt, .jsonl, .jsonl.gz/.json.gz, .jsonl.zst/.json.zst, .parquet or .arrow files, directories of them, "
        "or a Hugging Face datasets save_to_disk directory",
    )
    prepare.add_argument(
        "--embedded",
        choices=["stdlib", "stdlib-chat", "largest", "largest-held-out"],
        help="use an embedded offline set instead: stdlib (text), stdlib-chat (conversations, with --chat), or the "
        "largest-digit task (with --chat, --preferences or --prompts; -held-out: problems none of the others holds)",
    )
    prepare.add_argument("--output", required=True, help="dataset directory to write")
    prepare.add_argument("--tokenizer", default="bpe", help="bpe (train one here), byte, or a tokenizer.json path")
    prepare.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default 4096)")
    prepare.add_argument(
        "--text-field", default=None, help="the JSON field or Parquet/Arrow column holding the text (default text)"
    )
    prepare.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 16,777,216)")
    prepare.add_argument(
        "--max-bytes", type=int, default=None, help="text budget of the embedded corpus (default 6,000,000)"
    )
    prepare.add_argument(
        "--skip-bytes",
        type=int,
        default=0,
        help="pass over the documents this budget of the embedded corpus holds first (a held-out set)",
    )
    prepare.add_argument(
        "--chat",
        action="store_true",
        help="the inputs are conversations (rows with messages): chat template, loss on assistant tokens, packing",
    )
    prepare.add_argument("--seq-len", type=int, default=None, help="with --chat: the row length (data.seq_len)")
    prepare.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH|chatml",
        help="with --chat, --preferences or --prompts: the model's Jinja chat template (a .jinja file, a "
        "tokenizer_config.json, or a directory holding one); default: chat_template.jinja beside --tokenizer (what "
        "ferry import writes), else ferry's ChatML",
    )
    records = prepare.add_mutually_exclusive_group()
    records.add_argument(
        "--preferences",
        action="store_const",
        const="preferences",
        dest="records",
        help="preference pairs for DPO (rows with prompt, chosen, rejected), kept whole",
    )
    records.add_argument(
        "--prompts",
        action="store_const",
        const="prompts",
        dest="records",
        help="prompts with verifiable answers for GRPO (rows with prompt, answer)",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenise the input files (Parquet: row groups) in N processes, one core each; the dataset is the "
        "same for any N",
    )
    prepare.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="where the parts are tokenised: local (this process, or --workers N processes) or ray (Ray tasks: a "
        "local Ray on this machine's CPUs, or --workers N of them, or the cluster at --address); the same dataset",
    )
    prepare.add_argument(
        "--address",
        default=None,
        help="with --engine ray: the running Ray cluster to join (its head's host:port, e.g. head:6379, or auto on a "
        "node of the cluster)",
    )
    prepare.add_argument(
        "--retries",
        type=int,
        default=None,
        metavar="R",
        help="with --engine ray: run a part's task again up to R times after its worker or node died or its read "
        "failed (default 3)",
    )
    prepare.add_argument(
        "--task",
        type=int,
        default=None,
        metavar="I",
        help="with --tasks N: prepare only the I-th of N slices of the inputs, as a partial dataset for "
        "`ferry data merge` (needs --tokenizer PATH or byte)",
    )
    prepare.add_argument("--tasks", type=int, default=None, metavar="N", help="the number of tasks (with --task)")
    prepare.add_argument(
        "--render",
        default=None,
        metavar="DIR",
        help="with --tasks N (no --task): write a Slurm array job (or a Kubernetes Indexed Job, --render-for) running "
        "the N tasks, and their merge into --output, to DIR instead of preparing",
    )
    prepare.add_argument(
        "--render-for",
        choices=["slurm", "kubernetes"],
        default=None,
        help="with --render: the scheduler the job is written for (default slurm)",
    )
    prepare.add_argument(
        "--image",
        default=None,
        help="with --render-for kubernetes: the container image with ferry (default: ferry launch's, ferry:latest)",
    )
    prepare.add_argument(
        "--claim",
        default=None,
        help="with --render-for kubernetes: the ReadWriteMany volume claim every pod mounts at the directory the "
        "render runs in (default ferry-data)",
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace a dataset prepared from other inputs")
    prepare.set_defaults(handler=_data_prepare)
    merge = data_commands.add_parser(
        "merge", help="join the partial datasets of `prepare --task I --tasks N` into the dataset one process makes"
    )
    merge.add_argument("partials", nargs="+", metavar="PARTIAL_DIR", help="the partial datasets of every task")
    merge.add_argument("--output", required=True, help="dataset directory to write")
    merge.add_argument("--overwrite", action="store_true", help="replace a dataset prepared from other inputs")
    merge.set_defaults(handler=_data_merge)
    verify = data_commands.add_parser(
        "verify",
        help="check every file of prepared datasets against every digest its manifest records; exit 0 valid, 1 invalid",
    )
    verify.add_argument("datasets", nargs="+", metavar="DIR", help="prepared dataset directories")
    verify.add_argument(
        "--sample",
        metavar="K",
        default=None,
        help="check K data files chosen at random (or a fraction of them, 0.01), the tokenizer, and every file's "
        "presence and size: a quick check of a huge set",
    )
    verify.add_argument(
        "--seed", type=int, default=None, help="with --sample: the seed that chooses the files (printed when drawn)"
    )
    verify.set_defaults(handler=_data_verify)

    ckpt.register(commands)
    add_metrics_commands(commands)
    add_kernels_commands(commands)
    add_hardware_commands(commands)
    add_portability_commands(commands)
    add_launch_command(commands)
    add_interop_commands(commands)
    add_models_commands(commands)
    add_inference_commands(commands)
    add_pipeline_commands(commands)
    add_release_commands(commands)
    return complete_help(parser)


def _train(args: argparse.Namespace) -> int:
    from ferry.cli.training import run_training

    return run_training(args.config, args.overrides, args.nproc, args.model, args.max_restarts)


def _data_verify(args: argparse.Namespace) -> int:
    """Invalid is an answer, not a usage error: exit 1 naming the file (a path that is no dataset exits 2).
    A sample's seed is drawn when not given, and printed with the answer, so a failure can be repeated."""
    import secrets

    from ferry.data.verification import DatasetMismatch, sample_size, verify_dataset, verify_sample

    if args.seed is not None and args.sample is None:
        raise UserError("--seed chooses the files of --sample K; give --sample too")
    size = sample_size(args.sample) if args.sample is not None else None
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    invalid = 0
    for path in args.datasets:
        try:
            print(verify_dataset(Path(path)) if size is None else verify_sample(Path(path), size, seed))
        except DatasetMismatch as exc:
            print(f"ferry: invalid {exc}")
            if size is not None:
                print(f"ferry: the sample was drawn by --sample {args.sample} --seed {seed}; repeat it with those")
            invalid += 1
    return 1 if invalid else 0


def _rank_prefix() -> str:
    """In a multi-process job every rank reports its own failure, named by rank."""
    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _data_prepare(args: argparse.Namespace) -> int:
    from ferry.data import PrepareSpec, prepare_dataset
    from ferry.data.partial import check_task_flags

    stop_on_sigterm()  # a Slurm time limit or preemption: the staging directory is removed, the workers stopped

    spec = PrepareSpec.from_flags(
        inputs=list(args.inputs),
        embedded=args.embedded,
        max_bytes=args.max_bytes,
        skip_bytes=args.skip_bytes,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        chat=args.chat,
        seq_len=args.seq_len,
        records=args.records,
        chat_template=args.chat_template,
    )
    check_task_flags(args.task, args.tasks, args.render)
    if args.render is None:
        for flag, value in (("--render-for", args.render_for), ("--image", args.image), ("--claim", args.claim)):
            if value is not None:
                raise UserError(f"{flag} is a setting of the job --render DIR writes; add --render DIR --tasks N")
    ray = _ray_engine(args)
    if ray is not None:
        result = prepare_dataset(spec, args.output, overwrite=args.overwrite, ray=ray)
        return _print_dataset(result)
    if args.render is not None:
        return _data_render_job(spec, args)
    if args.task is not None:
        return _data_prepare_task(spec, args)
    result = prepare_dataset(spec, args.output, overwrite=args.overwrite, workers=args.workers)
    return _print_dataset(result)


def _ray_engine(args: argparse.Namespace):
    """The Ray engine `--engine ray` asks for; its own flags refused without it, and the task flags with it."""
    if args.engine != "ray":
        for flag, value in (("--address", args.address), ("--retries", args.retries)):
            if value is not None:
                raise UserError(f"{flag} is a setting of --engine ray; add --engine ray or leave {flag} out")
        return None
    if args.task is not None or args.render is not None:
        raise UserError(
            "--engine ray schedules every part itself on its cluster; --task/--tasks/--render share the work out "
            "among copies of the command that another engine runs: give one or the other"
        )
    from ferry.data.ray_engine import RayEngine

    return RayEngine(address=args.address, cpus=args.workers, retries=3 if args.retries is None else args.retries)


def _data_prepare_task(spec, args: argparse.Namespace) -> int:
    from ferry.data.partial import prepare_task

    result = prepare_task(spec, args.output, args.task, args.tasks, workers=args.workers, overwrite=args.overwrite)
    partial = result.partial
    state = "prepared" if result.rebuilt else "up to date"
    print(
        f"ferry: partial dataset {state}: {result.output} — task {partial['task']} of {partial['tasks']}: "
        f"{len(partial['part_files']):,} of {partial['parts']:,} parts, {partial['tokens']:,} tokens from "
        f"{partial['documents']:,} documents; join all {partial['tasks']} with `ferry data merge`"
    )
    return 0


def _data_render_job(spec, args: argparse.Namespace) -> int:
    from ferry.data.partial import check_task_spec
    from ferry.launch.data_job import render_data_job, write_data_job
    from ferry.launch.data_job_kubernetes import DEFAULT_DATA_CLAIM, render_kubernetes_data_job
    from ferry.launch.spec import DEFAULT_IMAGE

    check_task_spec(spec, args.workers)
    shared = [*spec.inputs, "--tokenizer", spec.tokenizer]
    if args.text_field is not None:
        shared += ["--text-field", args.text_field]
    if args.shard_tokens is not None:
        shared += ["--shard-tokens", str(args.shard_tokens)]
    workers = args.workers or 1
    out = Path(args.render)
    job_name = f"ferry-data-{Path(args.output).name}"
    if args.render_for == "kubernetes":
        paths = [*spec.inputs, *([] if spec.tokenizer == "byte" else [spec.tokenizer])]
        image, claim = args.image or DEFAULT_IMAGE, args.claim or DEFAULT_DATA_CLAIM
        files = render_kubernetes_data_job(shared, paths, args.output, args.tasks, workers, job_name, image, claim)
        submitted = "a merge Job"
    else:
        for flag, value in (("--image", args.image), ("--claim", args.claim)):
            if value is not None:
                raise UserError(f"{flag} is a setting of --render-for kubernetes; add it or leave {flag} out")
        files = render_data_job(shared, args.output, args.tasks, workers, job_name, out)
        submitted = "a merge"
    write_data_job(files, out, overwrite=args.overwrite)
    print(
        f"ferry: {job_name}: {args.tasks} task(s) of {workers} worker(s), then {submitted} into {args.output}; "
        f"wrote {len(files)} file(s) to {out}/ (submit with {out / 'submit.sh'})"
    )
    for name in files:
        print(f"  {out / name}")
    return 0


def _data_merge(args: argparse.Namespace) -> int:
    from ferry.data.partial import merge_partials

    stop_on_sigterm()
    return _print_dataset(merge_partials(args.partials, args.output, overwrite=args.overwrite))


def _print_dataset(result) -> int:
    manifest = result.manifest
    if result.repaired:
        print(f"ferry: warning: {result.repaired} no longer matched its manifest; written again from the same inputs")
    for path in result.empty:
        print(f"ferry: note: {path} holds no rows or text: no document of the dataset comes from it")
    state = "prepared" if result.rebuilt else "up to date"
    tokenizer = f"{manifest['tokenizer']['kind']} tokenizer with {manifest['tokenizer']['vocab_size']:,} tokens"
    records = manifest.get("records")
    if records:
        print(
            f"ferry: dataset {state}: {result.output} — {records['count']:,} {records['kind']} records "
            f"({manifest['total_tokens']:,} tokens, each record kept whole), {tokenizer}"
        )
        return 0
    print(
        f"ferry: dataset {state}: {result.output} — {manifest['total_tokens']:,} tokens from "
        f"{manifest['documents']:,} documents in {len(manifest['shards'])} shard(s), {tokenizer}"
    )
    where = manifest.get("prepared_by")
    if result.rebuilt and where:
        print(
            f"ferry: tokenised by Ray {where['ray']} at {where['address']}: {where['nodes']} node(s), "
            f"{where['cpus']} CPU(s) in use"
        )
    chat = manifest.get("chat")
    if chat:
        print(
            f"ferry: {chat['rows']:,} rows of {chat['seq_len']} tokens; "
            f"{chat['trained_tokens'] / manifest['total_tokens']:.1%} of tokens trained (assistant), "
            f"{chat['padding_tokens'] / manifest['total_tokens']:.1%} padding; "
            f"{chat['truncated']:,} conversation(s) longer than a row were cut, "
            f"{chat['dropped']:,} of them dropped for having no assistant token left"
        )
        template = chat["template"]
        if template.startswith("jinja:"):
            print(
                f"ferry: rendered in the model's chat template ({result.output / 'chat_template.jinja'}, "
                f"sha256 {template.removeprefix('jinja:')[:12]})"
            )
        else:
            print("ferry: rendered in ferry's ChatML template")
    return 0

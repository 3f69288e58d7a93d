"""`ferry export CKPT OUT` and `ferry import HF_DIR OUT`: checkpoints to and from transformers model directories."""

from __future__ import annotations

import argparse

from ferry.cli.options import RegistryChoices, architecture_names


def add_interop_commands(commands) -> None:
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a transformers model directory (OLMoE, Qwen3-MoE, DeepSeek-V3 or V2, GPT-OSS)",
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint (e.g. runs/tiny/checkpoints/step-00000300), or a run directory: its newest valid checkpoint",
    )
    export.add_argument("out", help="the model directory to write")
    export.add_argument(
        "--arch",
        choices=RegistryChoices(architecture_names),
        default=None,
        help="target architecture (default: deepseek_v3 for MLA, else the one whose query/key norm and dense layers "
        "the model has)",
    )
    export.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights dtype (default fp32)"
    )
    export.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's first dataset's)")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    export.set_defaults(handler=run_export)
    imported = commands.add_parser(
        "import",
        help="convert an OLMoE, Qwen3-MoE, DeepSeek-V3 / V2 or GPT-OSS transformers directory to a ferry checkpoint",
    )
    imported.add_argument("hf_dir", help="a transformers model directory (config.json and weights)")
    imported.add_argument(
        "out", help="directory to write: checkpoints/step-00000000, model.yaml, tokenizer.json, chat_template.jinja"
    )
    imported.add_argument("--tokenizer", default=None, help="tokenizer.json to copy (default: HF_DIR's)")
    imported.set_defaults(handler=run_import)


def run_export(args: argparse.Namespace) -> int:
    from ferry.interop import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.out, args.arch, args.dtype, args.tokenizer, args.overwrite)
    print(
        f"ferry: exported {result.checkpoint} (step {result.step}) as {result.arch} "
        f"({result.parameters:,} parameters, {args.dtype}) "
        f"to {result.out}/: {', '.join(result.files)}"
    )
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ferry.interop import import_hf

    result = import_hf(args.hf_dir, args.out, args.tokenizer)
    print(
        f"ferry: imported {result.arch} ({result.parameters:,} parameters) as {result.checkpoint} "
        "(weights only: training starts its optimizer afresh)"
    )
    print(f"  model config: {result.model_file} (the `model:` section of a run config)")
    if result.tokenizer is not None:
        print(f"  tokenizer: {result.tokenizer} (ferry data prepare --tokenizer {result.tokenizer})")
    if result.chat_template is not None:
        print(
            f"  chat template: {result.chat_template} (fine-tune in it: ferry data prepare --chat FILE --seq-len N "
            f"--tokenizer {result.tokenizer} takes it from beside the tokenizer)"
        )
    print(f"  continue training: ferry train CONFIG init_from={result.checkpoint}")
    return 0

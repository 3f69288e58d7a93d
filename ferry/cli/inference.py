"""`ferry generate` and `ferry eval`: a trained model run without training."""

from __future__ import annotations

import argparse
import json
import sys

from ferry.cli.options import device_option
from ferry.config import UserError
from ferry.config.loader import validate_named

SOURCE_HELP = "a checkpoint, a run (or `ferry import`) directory, or a transformers model directory"


def add_inference_commands(commands) -> None:
    generate = commands.add_parser("generate", help="continue prompts with a trained model (KV-cache decoding)")
    generate.add_argument("source", help=SOURCE_HELP)
    generate.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    generate.add_argument("--prompts-file", default=None, help="one prompt per line (added after the --prompt ones)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated after each prompt at most")
    generate.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    generate.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass")
    generate.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the same seed gives a prompt the same tokens, whatever prompts run beside it",
    )
    generate.add_argument("--stop", action="append", default=[], help="a string that ends a completion; repeatable")
    generate.add_argument(
        "--latent-decoding",
        choices=["auto", "absorbed", "expanded"],
        default="auto",
        help="MLA models: attend over the cached latents with the up-projections absorbed, over keys and values "
        "expanded from them, or whichever takes fewer multiply-adds for each step (default auto)",
    )
    _add_model_options(generate)
    generate.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message in the chat template; the answer ends at <|im_end|>",
    )
    generate.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    generate.add_argument("--json", action="store_true", help="print one JSON record per prompt instead of text")
    generate.set_defaults(handler=run_generate)

    evaluate = commands.add_parser(
        "eval",
        help="a checkpoint's held-out figures on prepared datasets: loss and perplexity on token datasets, solve "
        "rates on prompts, answer ranking (and DPO rewards) on preference pairs",
    )
    evaluate.add_argument("source", help=SOURCE_HELP)
    evaluate.add_argument(
        "--data", nargs="+", required=True, metavar="DIR", help="prepared datasets (ferry data prepare)"
    )
    evaluate.add_argument(
        "--seq-len", type=int, default=None, help="tokens per window (default: the run's data.seq_len)"
    )
    evaluate.add_argument(
        "--batches", type=int, default=None, help="batches per dataset (default: the run's eval.batches)"
    )
    evaluate.add_argument(
        "--batch-size", type=int, default=None, help="sequences per batch (default: the run's eval.batch_size)"
    )
    evaluate.add_argument("--micro-batch", type=int, default=None, help="sequences per forward (default: the batch)")
    evaluate.add_argument(
        "--document-masking",
        choices=["run", "on", "off"],
        default="run",
        help="token datasets: attend within each document of a window (default: as the run that saved the "
        "checkpoint trained; off for an export or import, which record no run)",
    )
    evaluate.add_argument(
        "--verifier", default=None, help="prompts: how a completion is scored (default: the run's grpo.verifier)"
    )
    evaluate.add_argument(
        "--reference",
        default=None,
        help="preferences: the reference checkpoint of the DPO rewards (default: a DPO run's init_from; none: skip)",
    )
    _add_model_options(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print the figures as JSON")
    evaluate.set_defaults(handler=run_eval)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", type=device_option, help="auto, cpu, cuda, ... (default auto)")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the dtype the weights are loaded in"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's, or SOURCE's)")


def run_generate(args: argparse.Namespace) -> int:
    from ferry.inference import GenerationConfig, generate, load_model

    config = validate_named(
        GenerationConfig,
        {
            "max_new_tokens": ("--max-new-tokens", args.max_new_tokens),
            "temperature": ("--temperature", args.temperature),
            "top_k": ("--top-k", args.top_k),
            "top_p": ("--top-p", args.top_p),
            "seed": ("--seed", args.seed),
            "stop": ("--stop", args.stop),
            "latent_decoding": ("--latent-decoding", args.latent_decoding),
        },
    )
    prompts = list(args.prompt) + _prompts_file(args.prompts_file)
    if not prompts:
        raise UserError("generate: give at least one --prompt (or --prompts-file)")
    if args.system is not None and not args.chat:
        raise UserError("generate: --system is a chat message; add --chat")
    loaded = load_model(args.source, args.device, args.dtype, args.tokenizer)
    if loaded.tokenizer is None:
        raise UserError(f"generate: no tokenizer found for {args.source}; pass --tokenizer")
    tokenizer = loaded.tokenizer
    from ferry.data.chat import CHAT_TEMPLATE, IM_END, ChatEncoder, Message
    from ferry.data.chat_template import TemplateChat, read_chat_template, template_beside, template_label

    template = template_beside(loaded.tokenizer_path)  # a model's own (imported, or its SFT data's)
    if template is not None and template_label(template) != CHAT_TEMPLATE:
        encoder = TemplateChat(tokenizer, read_chat_template(template), str(template))
    else:
        encoder = ChatEncoder(tokenizer) if args.chat else None
    if args.chat:
        system = [Message("system", args.system)] if args.system is not None else []
        tokens = [encoder.prompt([*system, Message("user", prompt)]).tolist() for prompt in prompts]
    else:
        tokens = [tokenizer.encode(prompt).tolist() for prompt in prompts]
    # a text ends at end-of-text and a chat answer at its template's end token (<|im_end|>); either ends any
    # completion, as the export's generation config says to transformers
    chat_ends = encoder.end_ids if encoder is not None else [tokenizer.token_id(IM_END)]
    end_ids = [tokenizer.eos_id, *(end for end in chat_ends if end is not None)]
    # every prompt draws from its own generator seeded with --seed, as a request to an inference server does:
    # what a prompt gets does not depend on the prompts batched with it
    result = generate(loaded.model, tokens, config, end_ids, tokenizer.decode, row_seeds=[config.seed] * len(tokens))
    for prompt, completion in zip(prompts, result.completions):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "completion": completion.text,
                        "finish_reason": completion.finish_reason,
                        "prompt_tokens": len(completion.prompt_tokens),
                        "tokens": completion.tokens,
                        "logprobs": [round(value, 6) for value in completion.logprobs],
                    }
                )
            )
        else:
            joint = "\n" if args.chat else ""  # a chat answer is a message of its own, not a continuation
            answer = f"\033[1m{completion.text}\033[0m" if sys.stdout.isatty() else completion.text
            print(f"{prompt}{joint}{answer}")
            print(f"[{len(completion.tokens)} tokens, {completion.finish_reason}]")
    print(
        f"ferry: {loaded.origin}: prefill {result.prefill_tokens} tokens at {result.prefill_tokens_per_s:,.0f} tok/s, "
        f"decode {result.decode_tokens} tokens at {result.decode_tokens_per_s:,.0f} tok/s "
        f"({len(prompts)} prompt(s), {next(loaded.model.parameters()).device}, {args.dtype}); "
        f"cache {result.cache_bytes_per_token:,} bytes per token "
        f"({loaded.model.config.attention_kind.describe_cache(loaded.model.config)})",
        file=sys.stderr,
    )
    return 0


def _prompts_file(path: str | None) -> list[str]:
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle]
    except OSError as exc:
        raise UserError(f"--prompts-file {path!r}: {exc.strerror or exc}") from None
    blank = [number for number, line in enumerate(lines, start=1) if not line.strip()]
    if blank:  # dropping it would shift every later output against its line
        raise UserError(f"--prompts-file {path!r}: line {blank[0]} is blank; give one prompt per line")
    return lines


def run_eval(args: argparse.Namespace) -> int:
    from ferry.train.evaluation import EvalRequest, evaluate_checkpoint

    request = EvalRequest(
        args.source,
        list(args.data),
        args.device,
        args.dtype,
        args.tokenizer,
        args.seq_len,
        args.batches,
        args.batch_size,
        args.micro_batch,
        args.document_masking,
        args.verifier,
        args.reference,
    )
    report = evaluate_checkpoint(request, say=_to_stderr)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    step = f"step {report.step}" if report.step is not None else "no step"
    per_dataset = ""
    if report.windows:
        per_dataset = ", {batches} x {batch_size} windows of {seq_len} tokens per dataset".format(**report.windows)
    print(f"ferry: {report.origin} ({step}){per_dataset}")
    width = max(len(name) for name in report.figures)
    for name, result in report.figures.items():
        print(f"  {name:<{width}}  {_figures_line(result)}")
    return 0


def _to_stderr(line: str) -> None:
    """Progress lines go to stderr: stdout holds the figures (JSON with --json)."""
    print(line, file=sys.stderr, flush=True)


def _figures_line(result: dict) -> str:
    if result["kind"] == "tokens":
        return f"loss {result['loss']:.4f}  perplexity {result['perplexity']:,.2f}  ({result['tokens']:,} tokens)"
    if result["kind"] == "prompts":
        return (
            f"solve rate {result['solve_rate']:.3f}  greedy {result['greedy_solve_rate']:.3f}  "
            f"({result['records']} prompts, verifier {result['verifier']})"
        )
    line = (
        f"preference accuracy {result['preference_accuracy']:.3f}  log-probs chosen {result['logps/chosen']:.2f}  "
        f"rejected {result['logps/rejected']:.2f}"
    )
    if "rewards/accuracy" in result:
        line += f"  rewards: accuracy {result['rewards/accuracy']:.3f}  margin {result['rewards/margin']:.4f}"
    return f"{line}  ({result['records']} pairs)"

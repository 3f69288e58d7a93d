"""`ferry models`: the named model shapes and what each costs."""

from __future__ import annotations

import argparse

import yaml


def add_models_commands(commands) -> None:
    models = commands.add_parser(
        "models", help="the named model shapes (configs/models/): parameters, active parameters, FLOPs, cache"
    )
    models.add_argument("names", nargs="*", help="presets to show (default: every one); a name or a YAML path")
    models.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="the sequence length of the attention FLOPs (default: 4,096 for every preset, or its context if shorter)",
    )
    models.add_argument("--show", action="store_true", help="print each preset's model section as YAML too")
    models.set_defaults(handler=run_models)


def run_models(args: argparse.Namespace) -> int:
    from ferry.model.presets import COMPARED_SEQ_LEN, preset_names, summarise

    rows = [summarise(name, args.seq_len) for name in args.names or preset_names()]
    width = max(len(row.name) for row in rows)
    length = args.seq_len or COMPARED_SEQ_LEN
    shorter = [row.name for row in rows if row.seq_len < length]
    print(
        f"training FLOPs per token at a sequence length of {length:,} (--seq-len)"
        + (f"; {', '.join(shorter)} at {'its' if len(shorter) == 1 else 'their'} whole context" if shorter else "")
    )
    labels = [_attention_label(row.config) for row in rows]
    column = max(9, *(len(label) for label in labels))
    print(
        f"{'preset':<{width}}  {'attention':<{column}}  {'total':>9}  {'active':>9}  {'train GFLOP/token':>17}  "
        f"{'cache B/token (bf16)':>20}"
    )
    for row, attention in zip(rows, labels):
        config = row.config
        print(
            f"{row.name:<{width}}  {attention:<{column}}  {_billions(row.size.total_params):>9}  "
            f"{_billions(row.size.active_params):>9}  {row.size.flops_per_token / 1e9:>11.3g} @{row.seq_len:<5}  "
            f"{row.cache_bytes_per_token:>20,}"
        )
        if args.show:
            print(yaml.safe_dump({"model": config.model_dump(mode="json")}, sort_keys=False))
    return 0


def _attention_label(config) -> str:
    """The attention kind and its parts: an output gate, sinks, a sliding window (`gqa+sinks+window128`)."""
    parts = (
        ("+gate", config.attention_gate != "none"),
        ("+sinks", config.attention_sinks),
        (f"+window{config.sliding_window}", bool(config.sliding_window)),
    )
    return config.attention + "".join(label for label, present in parts if present)


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"

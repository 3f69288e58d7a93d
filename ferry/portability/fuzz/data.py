"""What the fuzzer's runs read: the suite's pre-training text, and the largest-digit task in the three views the
other objectives train on (chat turns for SFT, preference pairs for DPO, prompts with answers for GRPO), all in
one tokenizer, so that one model shape serves every objective."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 576  # the 512-token BPE with the chat tokens the task's views add to it


@dataclass(frozen=True)
class FuzzData:
    """The datasets, by the placeholder a combination's overrides name them with."""

    text: Path
    chat: Path
    pairs: Path
    prompts: Path

    def substitute(self, override: str) -> str:
        for name in ("TEXT", "CHAT", "PAIRS", "PROMPTS"):
            override = override.replace(name, str(getattr(self, name.lower())))
        return override


def prepare_fuzz_data(work: Path, text: Path | None = None) -> FuzzData:
    """The suite's dataset (the first ~400 kB of the embedded corpus in a 512-token BPE; `text` where one is
    already prepared) and the task's views in its tokenizer, under `work/data`."""
    from ferry.data import PrepareSpec, prepare_dataset

    root = work / "data"
    if text is None:
        text = root / "stdlib"
        prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=400_000, vocab_size=512), text)
    tokenizer = str(text / "tokenizer.json")
    views = {
        "chat": {"chat": True, "seq_len": 64},
        "pairs": {"records": "preferences"},
        "prompts": {"records": "prompts"},
    }
    for view, flags in views.items():
        spec = PrepareSpec(embedded="largest", tokenizer=tokenizer, embedded_max_bytes=60_000, **flags)
        prepare_dataset(spec, root / view)
    return FuzzData(text, root / "chat", root / "pairs", root / "prompts")

"""Tokenizers: byte-level BPE trained locally with `tokenizers`, or plain bytes.

Both are stored as one JSON file beside the token shards, so a dataset carries the
exact tokenizer that made it and its sha256 identifies it in every manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ferry.config.errors import UserError

END_OF_TEXT = "<|endoftext|>"
BYTE_TOKENIZER_KIND = "ferry-byte-tokenizer"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as end-of-text."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int | None:
        """The id of a special token: end-of-text only (a byte tokenizer has no chat tokens)."""
        return self.eos_id if token == END_OF_TEXT else None

    def to_json(self) -> str:
        return json.dumps({"kind": BYTE_TOKENIZER_KIND, "vocab_size": self.vocab_size, "eos_id": self.eos_id})


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) over a `tokenizers.Tokenizer`."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer):
        # text that spells a special token (`<|endoftext|>`, `<|im_start|>`) stays text: documents end and
        # chat messages begin only where ferry puts those ids, never where a corpus or a prompt writes them
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(END_OF_TEXT)
        if eos_id is None:
            raise UserError(f"BPE tokenizer has no {END_OF_TEXT!r} token")
        self.eos_id = eos_id
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    def with_special_tokens(self, tokens: Iterable[str]) -> BPETokenizer:
        """A copy holding `tokens` as special tokens; those it lacks take the next free ids."""
        copy = HFTokenizer.from_str(self._tokenizer.to_str())
        copy.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens])
        return BPETokenizer(copy)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(enc.ids, dtype=np.int64) for enc in self._tokenizer.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def to_json(self) -> str:
        return self._tokenizer.to_str()


Tokenizer = ByteTokenizer | BPETokenizer


def encoding_digest(tokenizer: Tokenizer) -> str:
    """sha256 of what decides the ids a text gets (vocabulary, merges, added tokens, normalizer and
    pre-tokenizer), not of the file: the same tokenizer saved by transformers (pretty-printed, with a
    post-processor) has the same digest as the one `ferry data prepare` wrote."""
    data = json.loads(tokenizer.to_json())
    keys = ("kind", "vocab_size", "eos_id", "model", "added_tokens", "normalizer", "pre_tokenizer")
    identity = {key: data.get(key) for key in keys}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


def tokenizer_from_json(text: str, origin: str) -> Tokenizer:
    """Rebuild a tokenizer from its stored JSON; `origin` names the file in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"tokenizer file {origin!r} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and data.get("kind") == BYTE_TOKENIZER_KIND:
        return ByteTokenizer()
    try:
        return BPETokenizer(HFTokenizer.from_str(text))
    except Exception as exc:  # tokenizers raises its own exception type for malformed files
        raise UserError(f"tokenizer file {origin!r} cannot be loaded: {exc}") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer file {str(path)!r} does not exist")
    return tokenizer_from_json(path.read_text(encoding="utf-8"), str(path))


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Encode many documents at once (BPE batches them across threads)."""
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(text) for text in texts]

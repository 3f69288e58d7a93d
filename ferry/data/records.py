"""Datasets of whole records rather than a token stream: preference pairs (DPO) and prompts with
their answers (GRPO).

A record is never cut: a pair's prompt and both completions are scored as complete
sequences, a prompt is continued from its end. On disk, beside `manifest.json` and
`tokenizer.json`: `tokens.npy` (every field's ids, one stream), `spans.npy` (`[records,
fields, 2]` start and stop into the stream) and, for prompts, `answers.json`. The
loader walks the records through a seeded permutation per epoch, so which records a step
takes is a function of (seed, step, global batch), never of the world size.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.config import DataConfig
from ferry.data.cursor import DataCursor
from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, MANIFEST_NAME, record_kind
from ferry.data.verification import DataVerification, verify_files
from ferry.platform.digests import FAST

RECORD_FIELDS = {"preferences": ("prompt", "chosen", "rejected"), "prompts": ("prompt",)}
TOKENS_NAME = "tokens.npy"
SPANS_NAME = "spans.npy"
ANSWERS_NAME = "answers.json"


class RecordDataset:
    """The records of one prepared dataset of `kind`, memory-mapped, its files checked against the manifest's
    `verify` digest first."""

    def __init__(self, path: str | Path, label: str, kind: str, verify: DataVerification = FAST):
        self.path = Path(path)
        self.label = label
        manifest_path = self.path / MANIFEST_NAME
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(
                f"{label}: {str(self.path)!r} is not a prepared dataset (no {MANIFEST_NAME}); "
                f"create it with `ferry data prepare --{kind}`"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{label}: {str(manifest_path)!r} is unreadable: {exc}") from None
        if self.manifest.get("format") != DATASET_FORMAT or self.manifest.get("version") != DATASET_VERSION:
            raise UserError(f"{label}: {str(manifest_path)!r} is not a {DATASET_FORMAT} v{DATASET_VERSION} manifest")
        found = record_kind(self.manifest)
        if found != kind:
            what = f"{found}" if found else "a token stream"
            raise UserError(
                f"{label}: {str(self.path)!r} holds {what}; this run reads {kind} (ferry data prepare --{kind})"
            )
        self.verified = verify_files(self.path, self.manifest, label, verify)
        self.kind = kind
        self.fields = RECORD_FIELDS[kind]
        self.tokenizer = self.manifest["tokenizer"]
        self.tokens = self._load(TOKENS_NAME, ndim=1)
        self.spans = self._load(SPANS_NAME, ndim=3)
        if self.spans.shape[1:] != (len(self.fields), 2) or (len(self.spans) and self.spans.max() > len(self.tokens)):
            raise UserError(f"{label}: {SPANS_NAME} of {str(self.path)!r} does not fit its tokens")
        self.answers: list[str] = []
        if kind == "prompts":
            self.answers = json.loads((self.path / ANSWERS_NAME).read_text(encoding="utf-8"))
            if len(self.answers) != len(self.spans):
                raise UserError(f"{label}: {ANSWERS_NAME} holds {len(self.answers)} answers for {len(self)} prompts")
        if len(self) == 0:
            raise UserError(f"{label}: {str(self.path)!r} holds no records")

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def longest(self) -> int:
        """The longest sequence a record makes: a prompt with its longer completion."""
        lengths_NF = self.spans[:, :, 1] - self.spans[:, :, 0]
        completions_N = lengths_NF[:, 1:].max(axis=1) if lengths_NF.shape[1] > 1 else 0
        return int((lengths_NF[:, 0] + completions_N).max())

    def field(self, index: int, name: str) -> np.ndarray:
        start, stop = self.spans[index, self.fields.index(name)]
        return self.tokens[start:stop].astype(np.int64)

    def file_hashes(self) -> list[dict]:
        return self.manifest["records"]["files"]

    def _load(self, name: str, ndim: int) -> np.ndarray:
        path = self.path / name
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.label}: {str(path)!r} cannot be opened: {exc}") from None
        if array.ndim != ndim:
            raise UserError(f"{self.label}: {str(path)!r} has {array.ndim} dimensions, expected {ndim}")
        return array


@dataclass
class StepRecords:
    """This rank's record indices of one step, and how many records the whole global batch holds."""

    indices: list[int]
    global_count: int


class RecordLoader:
    """Global batches of `global_batch` records of one dataset; the same cursor as the token loader."""

    def __init__(self, config: DataConfig, seed: int, global_batch: int, kind: str):
        if len(config.sources) != 1:
            raise UserError(
                f"data.sources: a {kind} run reads one dataset, got {len(config.sources)}; prepare them as one"
            )
        source = config.sources[0]
        self.name = source.name
        self.dataset = RecordDataset(source.path, f"data.sources.0 ({source.name})", kind, verify=config.verify)
        self.datasets = [self.dataset]
        self.seed = seed
        self.global_batch = global_batch
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def tokenizer(self) -> dict:
        return self.dataset.tokenizer

    def mix_record(self) -> list[dict]:
        return [
            {
                "name": self.name,
                "path": str(self.dataset.path),
                "records": len(self.dataset),
                "kind": self.dataset.kind,
                "rows_per_step": self.global_batch,
                "tokenizer_sha256": self.tokenizer["sha256"],
                "verified": self.dataset.verified,
                "shards": self.dataset.file_hashes(),  # the record files, in the shape of a token dataset's shards
                "sources": self.dataset.manifest.get("source_hashes", []),
            }
        ]

    def new_cursor(self) -> DataCursor:
        return DataCursor(step=0, consumed={self.name: 0})

    def advance(self, cursor: DataCursor) -> DataCursor:
        consumed = cursor.consumed.get(self.name, 0) + self.global_batch
        return DataCursor(step=cursor.step + 1, consumed={self.name: consumed})

    def step_records(self, cursor: DataCursor, rank: int, world_size: int) -> StepRecords:
        """This rank's contiguous share of the step's records."""
        first = cursor.consumed.get(self.name, 0)
        every = [self._record_index(position) for position in range(first, first + self.global_batch)]
        per_rank = self.global_batch // world_size
        return StepRecords(every[rank * per_rank : (rank + 1) * per_rank], self.global_batch)

    def _record_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if epoch not in self._permutations:
            if len(self._permutations) > 2:
                self._permutations.clear()
            salt = zlib.crc32(self.name.encode("utf-8"))
            self._permutations[epoch] = np.random.default_rng([self.seed, salt, epoch]).permutation(len(self.dataset))
        return int(self._permutations[epoch][offset])

"""The deterministic, resumable loader over a weighted mix of datasets.

Which samples form the global batch of a step is a function of (seed, cursor,
global batch) alone: never of world size or micro-batch. Each step takes a fixed
number of windows from every source (its weight's share of the global batch,
by largest remainder), walks each source through a fresh seeded permutation per
epoch, and shuffles the batch's rows with a generator seeded by (seed, step).
Ranks then take contiguous slices of the same global batch, so changing the
world size changes only how the batch is split.

A source may have a budget (`tokens` or `epochs`): once its windows are read it
leaves the mix, and the step's rows are shared by weight among the sources left.
The rows of a step are a function of the cursor's consumed counts alone, so a
resumed run continues the same mix, and the counts say what each source gave.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferry.config.errors import UserError
from ferry.data.config import DataConfig, SourceConfig
from ferry.data.cursor import DataCursor
from ferry.data.dataset import TokenDataset
from ferry.data.targets import Batch, packing_padding, split_windows
from ferry.data.verification import named_files
from ferry.platform.digests import RECORDED

_ROW_SHUFFLE_STREAM = 0x5EED
_OPENING_COST_BYTES = 1 << 20  # a file counts as at least this many bytes against data.verify_upfront


@dataclass
class StepBatches:
    """A rank's micro-batches of one step, and how many targets the whole global batch trains: the
    loss is a mean over those, so every rank divides by the same count whatever its share."""

    micro: list[Batch]
    trained_targets: int


class MixedLoader:
    """Global batches of `global_batch` windows of `seq_len` tokens from the configured mix."""

    def __init__(self, config: DataConfig, seed: int, global_batch: int, steps: int | None = None):
        """`steps`: the run's last step, refused when the sources' budgets cannot fill that many global batches
        (None: checked only when a step asks for more than is left)."""
        self.seq_len = config.seq_len
        self.seed = seed
        self.global_batch = global_batch
        self.datasets = [
            TokenDataset(
                source.path, label=f"data.sources.{index} ({source.name})", verify=config.verify, upfront=False
            )
            for index, source in enumerate(config.sources)
        ]
        if sum(_verification_size(dataset.manifest) for dataset in self.datasets) <= config.verify_upfront:
            for dataset in self.datasets:
                dataset.check_all()
        self.names = [source.name for source in config.sources]
        self._check_tokenizers()
        for dataset in self.datasets:
            dataset.check_seq_len(self.seq_len, "data.seq_len")
        self.masked = any(dataset.has_loss_mask for dataset in self.datasets)
        for dataset in self.datasets:
            if dataset.num_windows(self.seq_len) < 1:
                raise UserError(
                    f"{dataset.label}: {dataset.num_tokens} tokens cannot fill one window of seq_len {self.seq_len}"
                )
        self.weights = [source.weight for source in config.sources]
        self.rows_per_source = _apportion(global_batch, self.weights)
        for dataset, rows in zip(self.datasets, self.rows_per_source):
            if rows == 0:
                raise UserError(
                    f"{dataset.label}: its weight gives it no row of a global batch of {global_batch}; "
                    "raise its weight or the global batch"
                )
        self.budgets = [self._budget(index, source) for index, source in enumerate(config.sources)]
        self.last_step = self._last_step()
        if steps is not None and self.last_step is not None and steps > self.last_step:
            raise UserError(
                f"train.steps is {steps}, but the budgets of data.sources (tokens, epochs) fill {self.last_step} "
                f"global batches of {global_batch} windows; lower train.steps to {self.last_step}, raise a budget, "
                "or add a source without one"
            )
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    def _budget(self, index: int, source: SourceConfig) -> int | None:
        """The windows `source` gives before it leaves the mix; None when it has no budget."""
        if source.tokens is None and source.epochs is None:
            return None
        windows = self.datasets[index].num_windows(self.seq_len)
        if source.tokens is not None:
            budget = source.tokens // self.seq_len
            problem = f"tokens: {source.tokens} is less than one window of data.seq_len {self.seq_len}"
        else:
            budget = math.floor(round(source.epochs * windows, 6))  # 0.29 x 100 is 28.999999999999996
            problem = f"epochs: {source.epochs} of {windows} windows is less than one window"
        if budget < 1:
            raise UserError(f"data.sources.{index}.{problem} ({source.name!r}); raise it")
        return budget

    def _last_step(self) -> int | None:
        """The number of steps the budgets fill, found a stretch of equal steps at a time (at most two stretches
        a source); None when a source without a budget keeps every step full."""
        if any(budget is None for budget in self.budgets):
            return None
        consumed, step = [0] * len(self.budgets), 0
        while (rows := self._rows_at(consumed)) is not None:
            left = [budget - used for budget, used in zip(self.budgets, consumed)]
            stretch = max(1, min(rest // count for rest, count in zip(left, rows) if count))
            consumed = [used + count * stretch for used, count in zip(consumed, rows)]
            step += stretch
        return step

    def _rows_at(self, consumed: list[int]) -> list[int] | None:
        """Each source's rows of the step that starts with `consumed` windows read from each: the global batch
        shared by weight (largest remainder) among the sources whose budget is not spent, a source left with
        fewer windows than its share giving what it has and the rest shared again; None when the budgets left
        cannot fill the step."""
        if all(budget is None for budget in self.budgets):
            return self.rows_per_source
        left = [None if budget is None else budget - used for budget, used in zip(self.budgets, consumed)]
        rows = [0] * len(self.budgets)
        active = [index for index, rest in enumerate(left) if rest is None or rest > 0]
        to_share = self.global_batch
        while active:
            shares = _apportion(to_share, [self.weights[index] for index in active])
            short = {index for index, share in zip(active, shares) if left[index] is not None and share > left[index]}
            if not short:
                for index, share in zip(active, shares):
                    rows[index] = share
                return rows
            for index in short:
                rows[index] = left[index]
                to_share -= left[index]
            active = [index for index in active if index not in short]
        return rows if to_share == 0 else None

    def rows_at(self, cursor: DataCursor) -> list[int]:
        """Each source's rows of the step at `cursor`."""
        rows = self._rows_at([cursor.consumed.get(name, 0) for name in self.names])
        if rows is None:
            raise UserError(
                f"step {cursor.step + 1} needs {self.global_batch} windows, and the budgets of data.sources "
                f"(tokens, epochs) are spent after step {self.last_step}; lower train.steps to {self.last_step}, "
                "raise a budget, or add a source without one"
            )
        return rows

    def realised(self, cursor: DataCursor) -> list[dict]:
        """What each source gave up to `cursor`: windows read, their tokens (windows x seq_len: the targets they
        hold) and the passes over the source that makes; for run.json at the end of a run."""
        return [
            {
                "name": name,
                "windows": cursor.consumed.get(name, 0),
                "tokens": cursor.consumed.get(name, 0) * self.seq_len,
                "epochs": round(cursor.consumed.get(name, 0) / dataset.num_windows(self.seq_len), 6),
            }
            for name, dataset in zip(self.names, self.datasets)
        ]

    @property
    def tokenizer(self) -> dict:
        return self.datasets[0].tokenizer

    def mix_record(self) -> list[dict]:
        """Sources, weights, rows per step (while every source is in the mix), token counts, budgets and hashes,
        for the run record."""
        return [
            {
                "name": name,
                "path": str(dataset.path),
                "rows_per_step": rows,
                "weight": rows / self.global_batch,
                "tokens": dataset.num_tokens,
                **({"budget": self._budget_record(dataset, budget)} if budget is not None else {}),
                "tokenizer_sha256": dataset.tokenizer["sha256"],
                "verified": dataset.verified,
                "verified_at": dataset.verified_at,
                "shards": [
                    {key: value for key, value in s.items() if key in ("file", *RECORDED)}
                    for s in dataset.manifest["shards"] + dataset.manifest.get("loss_mask", {}).get("shards", [])
                ],
                "sources": dataset.manifest.get("source_hashes", []),
            }
            for name, dataset, rows, budget in zip(self.names, self.datasets, self.rows_per_source, self.budgets)
        ]

    def _budget_record(self, dataset: TokenDataset, windows: int) -> dict:
        return {
            "windows": windows,
            "tokens": windows * self.seq_len,
            "epochs": round(windows / dataset.num_windows(self.seq_len), 6),
        }

    def new_cursor(self) -> DataCursor:
        return DataCursor(step=0, consumed={name: 0 for name in self.names})

    def global_batch_at(self, cursor: DataCursor) -> np.ndarray:
        """The [global_batch, seq_len + 1] windows of the step at `cursor`, rows shuffled."""
        return self._global_rows(cursor, with_masks=False)[0]

    def _global_rows(self, cursor: DataCursor, with_masks: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The step's windows and, when asked, which of their tokens are trained, in the same row order."""
        rows, masks = [], []
        for index, (name, dataset, count) in enumerate(zip(self.names, self.datasets, self.rows_at(cursor))):
            first = cursor.consumed.get(name, 0)
            for position in range(first, first + count):
                window = self._window_index(index, dataset, position)
                rows.append(dataset.window(window, self.seq_len))
                if with_masks:
                    masks.append(dataset.window_mask(window, self.seq_len))
        order = np.random.default_rng([self.seed, cursor.step, _ROW_SHUFFLE_STREAM]).permutation(len(rows))
        return np.stack(rows)[order], np.stack(masks)[order] if with_masks else None

    def advance(self, cursor: DataCursor) -> DataCursor:
        consumed = {name: cursor.consumed.get(name, 0) + rows for name, rows in zip(self.names, self.rows_at(cursor))}
        return DataCursor(step=cursor.step + 1, consumed=consumed)

    def micro_batches(self, cursor: DataCursor, rank: int, world_size: int, micro_batch: int) -> StepBatches:
        """This rank's contiguous share of the global batch, cut into micro-batches."""
        windows, masks = self._global_rows(cursor, with_masks=self.masked)
        per_rank = self.global_batch // world_size
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        windows_BS1 = torch.from_numpy(windows[mine])
        trained_BS1 = None if masks is None else torch.from_numpy(masks[mine])
        micro = []
        for start in range(0, per_rank, micro_batch):
            part = slice(start, start + micro_batch)
            packed = trained_BS1 is not None  # conversations packed into rows, their rest padded
            inputs_BS, targets_BS = split_windows(windows_BS1[part], trained_BS1[part] if packed else None)
            padding_BS = packing_padding(inputs_BS, self.tokenizer["eos_id"]) if packed else None
            micro.append(Batch(inputs_BS, targets_BS, padding_BS))
        trained = int(masks[:, 1:].sum()) if masks is not None else windows[:, 1:].size
        return StepBatches(micro, trained)

    def _window_index(self, source_index: int, dataset: TokenDataset, position: int) -> int:
        windows = dataset.num_windows(self.seq_len)
        epoch, offset = divmod(position, windows)
        key = (source_index, epoch)
        if key not in self._permutations:
            if len(self._permutations) > 2 * len(self.datasets):
                self._permutations.clear()
            salt = zlib.crc32(self.names[source_index].encode("utf-8"))
            self._permutations[key] = np.random.default_rng([self.seed, salt, epoch]).permutation(windows)
        return int(self._permutations[key][offset])

    def _check_tokenizers(self) -> None:
        first = self.datasets[0]
        for dataset in self.datasets[1:]:
            if dataset.tokenizer["sha256"] != first.tokenizer["sha256"]:
                raise UserError(
                    f"{dataset.label} was tokenized with another tokenizer than {first.label}; "
                    "prepare every source of a mix with the same tokenizer (--tokenizer PATH)"
                )


def _apportion(total: int, weights: list[float]) -> list[int]:
    """Split `total` rows in proportion to `weights` by largest remainder (ties to the earlier source)."""
    weight_sum = sum(weights)
    quotas = [total * weight / weight_sum for weight in weights]
    rows = [int(quota) for quota in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - rows[i]), i))
    for index in by_remainder[: total - sum(rows)]:
        rows[index] += 1
    return rows


def realised_counts(loader: Any, cursor: DataCursor) -> list[dict]:
    """What each source of `loader` gave up to `cursor`, for run.json: a token mix's windows and tokens
    (`MixedLoader.realised`), a record loader's records."""
    if isinstance(loader, MixedLoader):
        return loader.realised(cursor)
    return [{"name": name, "records": count} for name, count in cursor.consumed.items()]


def _verification_size(manifest: dict) -> int:
    """What checking every file of a dataset costs, in bytes read, as its manifest tells (a file that records
    no size, from before sizes were recorded, counted at 4 bytes a token), each file at least
    `_OPENING_COST_BYTES`."""
    return sum(
        max(entry.get("bytes") or 4 * entry.get("tokens", 0), _OPENING_COST_BYTES) for entry in named_files(manifest)
    )

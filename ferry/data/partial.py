"""Preparing a corpus on many machines: `ferry data prepare --task I --tasks N` tokenises the I-th of N
slices of the input parts into a partial dataset, and `ferry data merge` joins the N partial datasets into
the dataset one process would have written (the same shards, manifest and digests).

Any engine that runs N copies of a command with an index can run the tasks: a Slurm array
(`$SLURM_ARRAY_TASK_ID`), a Kubernetes indexed Job (`$JOB_COMPLETION_INDEX`), a Ray task per index, a
datatrove executor's rank. ferry schedules nothing.

The slices are contiguous runs of the parts (files, Parquet row groups) in input order, cut where the
bytes of the input files reach I/N of their total: every task, given the same inputs, computes the same
slices without talking to the others. Every task must tokenise with the same tokenizer, so task mode
takes a tokenizer file (`--tokenizer PATH`, or `byte`): a BPE tokenizer is trained once beforehand (by a
`ferry data prepare --tokenizer bpe` of the corpus or of a sample of it) and its `tokenizer.json` given
to every task.

A partial dataset holds `partial.json` (what it was prepared from, which parts it holds, their token and
document counts and sha256), `tokenizer.json`, and one `part-NNNNNN.tokens` file per part (raw ids in the
dataset's dtype). It has no `manifest.json`: nothing trains on it by mistake. Merging re-reads the part
files in input order (each checked against its sha256) and cuts the stream into shards, so its cost is
reading and writing the tokens once; no text is tokenised again.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.formats import Part, collect_files, parts
from ferry.data.manifest import MANIFEST_NAME, TOKENIZER_NAME, file_entry, sha256_file
from ferry.data.prepare import PrepareResult, PrepareSpec, check_parallel, check_spec, spec_settings
from ferry.data.shards import ShardWriter, token_dtype, token_manifest
from ferry.data.splitting import SPLIT_BYTES
from ferry.data.staging import claim_output, read_json, refuse_inputs_inside, write_json, write_staged
from ferry.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_json
from ferry.data.workers import PartTokens, read_part_file, source_entries, tokenize_parts

PARTIAL_NAME = "partial.json"
PARTIAL_FORMAT = "ferry-partial-dataset"
PARTIAL_VERSION = 1
_SAME = ("settings", "tasks", "parts", "parts_sha256", "dtype")  # what every task of one preparation shares


@dataclass
class PartialResult:
    output: Path
    partial: dict
    rebuilt: bool


def task_parts(every: list[Part], task: int, tasks: int) -> list[tuple[int, Part]]:
    """(index, part) of task `task`'s slice: the parts whose first byte lies in [task, task + 1) / `tasks`
    of the input bytes (a byte range weighs its bytes, and a file's bytes are shared evenly among its row
    groups)."""
    per_file = Counter(part.path for part in every)
    shared = {path: path.stat().st_size // count + 1 for path, count in per_file.items()}
    sizes = [part.weight + 1 if part.is_range else shared[part.path] for part in every]
    total = sum(sizes)
    mine, start = [], 0
    for index, part in enumerate(every):
        if min(start * tasks // total, tasks - 1) == task:
            mine.append((index, part))
        start += sizes[index]
    return mine


def parts_digest(every: list[Part]) -> str:
    """sha256 naming the list of parts: tasks and their merge must agree on it."""
    names = [[str(part.path), part.row_group] + ([part.start, part.end] if part.is_range else []) for part in every]
    return hashlib.sha256(json.dumps(names).encode("utf-8")).hexdigest()


def prepare_task(
    spec: PrepareSpec,
    output: str | Path,
    task: int,
    tasks: int,
    workers: int | None = None,
    overwrite: bool = False,
    split_bytes: int = SPLIT_BYTES,
) -> PartialResult:
    """Tokenise slice `task` of `tasks` of the inputs into the partial dataset `output`; a partial dataset
    already there from the same inputs, settings and slice is kept. A large JSON-lines file is parts of about
    `split_bytes` (`ferry.data.splitting`); every task must be given the same."""
    output = Path(output)
    check_task_spec(spec, workers)
    if not 0 <= task < tasks:
        raise UserError(f"--task must be in 0..{tasks - 1} for --tasks {tasks}, got {task}")
    every = [part for path in collect_files(spec.inputs) for part in parts(path, split_bytes)]
    mine = task_parts(every, task, tasks)
    tokenizer = ByteTokenizer() if spec.tokenizer == "byte" else load_tokenizer(spec.tokenizer)
    dtype = token_dtype(tokenizer)
    identity = {
        "format": PARTIAL_FORMAT,
        "version": PARTIAL_VERSION,
        "task": task,
        "tasks": tasks,
        "settings": spec_settings(spec),
        "parts": len(every),
        "parts_sha256": parts_digest(every),
        "dtype": np.dtype(dtype).name,
        "sources": {source: sha256_file(Path(source)) for source in dict.fromkeys(str(part.path) for _, part in mine)},
    }
    existing = _claim_partial(output, identity, overwrite, spec.inputs)
    if existing is not None:
        return PartialResult(output, existing, rebuilt=False)

    def build(staging: Path) -> dict:
        results = [
            result.as_record() for result in tokenize_parts(mine, tokenizer, spec.text_field, dtype, staging, workers)
        ]
        (staging / TOKENIZER_NAME).write_text(tokenizer.to_json(), encoding="utf-8")
        partial = {
            **identity,
            "tokenizer": file_entry(staging / TOKENIZER_NAME),
            "documents": sum(result["documents"] for result in results),
            "tokens": sum(result["tokens"] for result in results),
            "part_files": results,
        }
        write_json(staging / PARTIAL_NAME, partial)
        return partial

    return PartialResult(output, write_staged(output, build), rebuilt=True)


def check_task_flags(task: int | None, tasks: int | None, render: str | None) -> None:
    """`--task I --tasks N` go together; `--render DIR` writes the job of every task (`--tasks N`, no `--task`)."""
    if render is not None and (tasks is None or task is not None):
        raise UserError("--render DIR writes the job of every task: give --tasks N, without --task")
    if render is None and (task is None) != (tasks is None):
        raise UserError("--task I and --tasks N go together: this task's index and the number of tasks")
    if tasks is not None and tasks < 1:
        raise UserError(f"--tasks must be at least 1, got {tasks}")


def check_task_spec(spec: PrepareSpec, workers: int | None) -> None:
    """What every task of a preparation needs: text inputs, and a tokenizer file they all share."""
    check_spec(spec)
    check_parallel(spec, workers, flag="--task")
    if spec.tokenizer == "bpe":
        raise UserError(
            "--task: every task must tokenise with the same tokenizer, so tasks cannot each train one; train it "
            "once (ferry data prepare --tokenizer bpe on the corpus or a sample of it) and give every task its "
            "tokenizer.json with --tokenizer PATH"
        )


def merge_partials(directories: list[str | Path], output: str | Path, overwrite: bool = False) -> PrepareResult:
    """Join the partial datasets of every task into `output`: the dataset one process would have written."""
    output = Path(output)
    partials = [(Path(directory), _read_partial(Path(directory))) for directory in directories]
    first_dir, first = partials[0]
    for directory, partial in partials[1:]:
        for key in _SAME:
            if partial.get(key) != first.get(key):
                raise UserError(
                    f"{directory} and {first_dir} are not tasks of one preparation: their {key} differ "
                    "(the same inputs, settings and --tasks must be given to every task)"
                )
        if partial["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise UserError(f"{directory} and {first_dir} were tokenised with different tokenizers")
    tasks = first["tasks"]
    by_task: dict[int, Path] = {}
    for directory, partial in partials:
        if partial["task"] in by_task:
            raise UserError(f"task {partial['task']} is given twice: {by_task[partial['task']]} and {directory}")
        by_task[partial["task"]] = directory
    missing = [str(task) for task in range(tasks) if task not in by_task]
    if missing:
        raise UserError(
            f"task(s) {', '.join(missing)} of {tasks} missing: prepare them with --task I --tasks {tasks} "
            "and give every partial dataset"
        )
    results, file_sha256 = _part_results(partials)
    tokenizer_path = first_dir / TOKENIZER_NAME
    inputs = [str(path) for path, _ in partials]
    return write_joined(
        output,
        results,
        source_entries(results, file_sha256),
        first["settings"],
        tokenizer_path,
        first["dtype"],
        overwrite,
        inputs,
    )


def write_joined(
    output: Path,
    results: list[PartTokens],
    source_hashes: list[dict],
    settings: dict,
    tokenizer_path: Path,
    dtype: str,
    overwrite: bool,
    inputs: list[str],
) -> PrepareResult:
    """The dataset of the part files `results` appended in their order (each checked against its sha256) and
    cut into shards, at `output`; kept when already there from the same sources and settings. `inputs`: the
    directories read, which `output` may not lie inside."""

    def is_current(manifest: dict) -> bool:
        return manifest.get("source_hashes") == source_hashes

    current, repaired = claim_output(output, overwrite, settings, is_current, inputs)
    if current is not None:
        return PrepareResult(output, current, rebuilt=False)
    tokenizer = tokenizer_from_json(tokenizer_path.read_text(encoding="utf-8"), str(tokenizer_path))
    token_type = np.dtype(dtype)

    def build(staging: Path) -> dict:
        writer = ShardWriter(staging, token_type.type, settings["shard_tokens"])
        for result in results:
            for tokens in read_part_file(result.path, token_type, result.tokens, result.sha256):
                writer.add(tokens)
        writer.close()
        manifest = token_manifest(tokenizer, staging, writer, sum(result.documents for result in results))
        manifest["settings"] = settings
        manifest["source_hashes"] = source_hashes
        write_json(staging / MANIFEST_NAME, manifest)
        return manifest

    return PrepareResult(output, write_staged(output, build), rebuilt=True, repaired=repaired)


def _part_results(partials: list[tuple[Path, dict]]) -> tuple[list[PartTokens], dict[str, str]]:
    """Every part of every task, in input order, and the sha256 of every source; a source whose sha256
    differs between tasks changed while they ran."""
    results: list[PartTokens] = []
    file_sha256: dict[str, str] = {}
    for directory, partial in partials:
        for source, sha256 in partial["sources"].items():
            if file_sha256.setdefault(source, sha256) != sha256:
                raise UserError(f"{source} changed between the tasks that read it (its sha256 differs in {directory})")
        for record in partial["part_files"]:
            results.append(
                PartTokens(
                    record["index"],
                    record["source"],
                    record["row_group"],
                    directory / record["file"],
                    record["tokens"],
                    record["documents"],
                    record["bytes"],
                    record["sha256"],
                )
            )
    results.sort(key=lambda result: result.index)
    if [result.index for result in results] != list(range(partials[0][1]["parts"])):
        raise UserError("the partial datasets do not hold every part exactly once: were some written by other runs?")
    return results, file_sha256


def _read_partial(directory: Path) -> dict:
    path = directory / PARTIAL_NAME
    if not path.is_file():
        raise UserError(
            f"{str(directory)!r} is not a partial dataset (no {PARTIAL_NAME}); "
            "write one with ferry data prepare --task I --tasks N"
        )
    partial = read_json(path)
    if partial.get("format") != PARTIAL_FORMAT or partial.get("version") != PARTIAL_VERSION:
        raise UserError(f"{path} is not a {PARTIAL_FORMAT} v{PARTIAL_VERSION} record")
    return partial


def _claim_partial(output: Path, identity: dict, overwrite: bool, inputs: list[str]) -> dict | None:
    """The partial dataset at `output` when it was prepared from the same `identity` and its files are all
    there; None when `output` may be written."""
    existing = output / PARTIAL_NAME
    if existing.is_file():
        partial = read_json(existing)
        itemsize = np.dtype(identity["dtype"]).itemsize
        if {key: partial.get(key) for key in identity} == identity and all(
            _size(output / record["file"]) == record["tokens"] * itemsize for record in partial.get("part_files", [])
        ):
            return partial
        if not overwrite:
            raise UserError(
                f"output {str(output)!r} already holds a partial dataset of other inputs, settings or task; "
                "pass --overwrite to replace it"
            )
    elif output.exists() and not output.is_dir():
        raise UserError(f"output {str(output)!r} is a file, not a directory")
    elif output.exists() and any(output.iterdir()):
        raise UserError(f"output {str(output)!r} exists and is not a partial dataset; choose another directory")
    refuse_inputs_inside(output, inputs)
    return None


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None

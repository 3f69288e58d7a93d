"""`ferry data prepare`: text in, memory-mappable token shards plus a manifest out.

The inputs are text files, JSON lines (plain, gzip or zstd), Parquet, Arrow, or a `datasets`
`save_to_disk` directory (`ferry.data.formats`), each read as a stream. The output directory
holds `tokenizer.json`, `shard-NNNNN.npy` files (one token stream, every document followed by
end-of-text) and `manifest.json` with token counts and the sha256 of every source and shard. Conversations
(`--chat`) are rendered with the chat template, packed into rows of `seq_len` tokens, and get a
parallel `mask-NNNNN.npy` stream: 1 where a token is trained (assistant text). Preference pairs
(`--preferences`) and prompts with answers (`--prompts`) are kept as whole records
(`ferry.data.records`). With `workers`, text is tokenised by several processes into the same dataset
(`ferry.data.workers`), with a `RayEngine` by Ray tasks on a cluster (`ferry.data.ray_engine`);
`ferry.data.partial` splits it into tasks for many machines. Everything is
written to a temporary directory and renamed into place, so an interrupted prepare never leaves a
half-written dataset behind, and an up-to-date dataset (the same inputs and settings, every file still
matching its manifest) is not rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.chat import parse_messages
from ferry.data.chat_template import chat_encoder, chosen_template, keep_template, template_label
from ferry.data.conversations import EMBEDDED_CONVERSATIONS, embedded_conversations, read_conversations
from ferry.data.corpus import EMBEDDED_CORPORA, Document, embedded_documents, within_budget
from ferry.data.formats import collect_files, documentless, no_documents, parts, read_texts
from ferry.data.manifest import (
    DATASET_FORMAT,
    DATASET_VERSION,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    file_entry,
    sha256_file,
)
from ferry.data.packing import RowPacker
from ferry.data.ray_engine import RayEngine, tokenize_parts_on_ray
from ferry.data.record_sources import read_record_rows, write_records
from ferry.data.records import RECORD_FIELDS
from ferry.data.shards import ShardWriter, token_dtype, token_manifest, tokenizer_record
from ferry.data.splitting import SPLIT_BYTES
from ferry.data.staging import claim_output, write_json, write_staged
from ferry.data.tasks import EMBEDDED_TASKS, task_documents
from ferry.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, encode_documents, load_tokenizer
from ferry.data.workers import read_part_file, source_entries, tokenize_parts

_ENCODE_BATCH = 256


@dataclass(frozen=True)
class PrepareSpec:
    """What to prepare; also stored in the manifest to decide whether a dataset is up to date."""

    inputs: list[str] = field(default_factory=list)
    embedded: str | None = None
    embedded_max_bytes: int = 6_000_000
    embedded_skip_bytes: int = 0
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    text_field: str = "text"
    shard_tokens: int = 1 << 24
    chat: bool = False
    seq_len: int | None = None
    records: str | None = None
    chat_template: str | None = None  # a Jinja template (a file, a directory with one), chatml; None: --tokenizer's

    @classmethod
    def from_flags(
        cls,
        *,
        inputs: list[str],
        embedded: str | None,
        max_bytes: int | None,
        skip_bytes: int,
        tokenizer: str,
        vocab_size: int | None,
        text_field: str | None,
        shard_tokens: int | None,
        chat: bool,
        seq_len: int | None,
        records: str | None,
        chat_template: str | None = None,
    ) -> PrepareSpec:
        """The spec `ferry data prepare`'s flags describe (None: the flag was not given, its default holds); a
        flag the kind of dataset does not read is refused, naming it, rather than ignored."""
        if max_bytes is not None and not embedded:
            raise UserError("--max-bytes is the text budget of an embedded corpus; it needs --embedded NAME")
        if chat_template is not None and not (chat or records):
            raise UserError("--chat-template renders conversations: it needs --chat, --preferences or --prompts")
        if shard_tokens is not None and records:
            raise UserError(f"--shard-tokens: --{records} writes its records whole, in one file; leave it out")
        if chat or records:
            ignored = [
                flag
                for flag, value in (("--vocab-size", vocab_size), ("--text-field", text_field))
                if value is not None
            ]
            if ignored:
                flag = "--chat" if chat else f"--{records}"
                raise UserError(
                    f"{' and '.join(ignored)}: {flag} reads its fields with the --tokenizer given; leave it out"
                )
        defaults = cls()
        return cls(
            inputs=inputs,
            embedded=embedded,
            embedded_max_bytes=defaults.embedded_max_bytes if max_bytes is None else max_bytes,
            embedded_skip_bytes=skip_bytes,
            tokenizer=tokenizer,
            vocab_size=defaults.vocab_size if vocab_size is None else vocab_size,
            text_field=defaults.text_field if text_field is None else text_field,
            shard_tokens=defaults.shard_tokens if shard_tokens is None else shard_tokens,
            chat=chat,
            seq_len=seq_len,
            records=records,
            chat_template=chat_template,
        )


@dataclass
class PrepareResult:
    output: Path
    manifest: dict
    rebuilt: bool
    repaired: Path | None = None  # the file that no longer matched its manifest, why the same inputs were written again
    empty: list[Path] = field(default_factory=list)  # input files that gave no document (beside some that did)


def prepare_dataset(
    spec: PrepareSpec,
    output: str | Path,
    overwrite: bool = False,
    workers: int | None = None,
    ray: RayEngine | None = None,
    split_bytes: int = SPLIT_BYTES,
) -> PrepareResult:
    """Tokenize the inputs of `spec` into `output`; reuse it when already prepared from the same inputs.

    With `workers`, the parts of the input files are tokenised by that many processes
    (`ferry.data.workers`); with `ray`, by Ray tasks (`ferry.data.ray_engine`, its manifest saying where in
    `prepared_by`); either way a large JSON-lines file is shared in ranges of about `split_bytes`
    (`ferry.data.splitting`). The dataset is the one this process alone would write."""
    output = Path(output)
    check_spec(spec)
    if ray is not None:
        if workers is not None:
            raise UserError("--workers with --engine ray is the CPUs Ray uses; give it to the Ray engine, not both")
        ray.check()
        check_parallel(spec, 1, flag="--engine ray")
    else:
        check_parallel(spec, workers)
    shared_out = workers is not None or ray is not None
    settings = spec_settings(spec)
    files = collect_files(spec.inputs) if spec.inputs else []
    if not shared_out:
        documents = _document_source(spec)
        source_hashes = _hash_sources(documents(), files)
    else:  # the files' digests decide, not a pass over their documents, which would be one process's work
        file_sha256 = {str(path): sha256_file(path) for path in files}

    def is_current(manifest: dict) -> bool:
        if not shared_out:
            return manifest.get("source_hashes") == source_hashes
        return _same_files(manifest.get("source_hashes"), file_sha256, spec.text_field)

    current, repaired = claim_output(output, overwrite, settings, is_current, spec.inputs)
    if current is not None:
        return PrepareResult(output, current, rebuilt=False, empty=documentless(files, current["source_hashes"]))

    def build(staging: Path) -> dict:
        prepared_by: dict = {}
        if not shared_out:
            manifest, hashes = _write_dataset(spec, documents, staging), source_hashes
        else:
            manifest, hashes = _write_parts(spec, files, file_sha256, staging, workers, ray, prepared_by, split_bytes)
        manifest["settings"] = settings
        manifest["source_hashes"] = hashes
        if prepared_by:
            manifest["prepared_by"] = prepared_by
        write_json(staging / MANIFEST_NAME, manifest)
        return manifest

    manifest = write_staged(output, build)
    empty = documentless(files, manifest["source_hashes"])
    return PrepareResult(output, manifest, rebuilt=True, repaired=repaired, empty=empty)


def check_parallel(spec: PrepareSpec, workers: int | None, flag: str = "--workers") -> None:
    """--workers and --task (`flag`, for the messages) share out the parts of input files of text."""
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if workers is None and flag == "--workers":
        return
    if spec.embedded:
        raise UserError(f"{flag} shares out the parts of input files; --embedded {spec.embedded} is read in one piece")
    if spec.chat or spec.records:
        kind = "--chat" if spec.chat else f"--{spec.records}"
        raise UserError(
            f"{flag} tokenises text corpora; {kind} datasets are prepared by one process (leave {flag} out)"
        )


def check_spec(spec: PrepareSpec) -> None:
    if bool(spec.inputs) == bool(spec.embedded):
        raise UserError("give either input files/directories or --embedded NAME, not both or neither")
    if spec.tokenizer == "bpe" and not 258 <= spec.vocab_size <= 1 << 20:
        raise UserError(f"--vocab-size must be between 258 and {1 << 20} for BPE, got {spec.vocab_size}")
    if spec.embedded_skip_bytes and not spec.embedded:
        raise UserError("--skip-bytes passes over part of an embedded corpus; it needs --embedded NAME")
    if spec.embedded_skip_bytes < 0:
        raise UserError(f"--skip-bytes must be 0 or more, got {spec.embedded_skip_bytes}")
    if spec.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive, got {spec.shard_tokens}")
    if spec.tokenizer not in ("bpe", "byte") and not Path(spec.tokenizer).is_file():
        raise UserError(f"--tokenizer {spec.tokenizer!r}: no such file (bpe, byte, or a tokenizer.json path)")
    if spec.records is not None and spec.records not in RECORD_FIELDS:
        raise UserError(f"unknown record kind {spec.records!r}; kinds: {', '.join(RECORD_FIELDS)}")
    if spec.records is not None and spec.chat:
        raise UserError(f"--{spec.records} and --chat prepare different datasets; give one of them")
    if spec.embedded in EMBEDDED_TASKS and not (spec.chat or spec.records):
        raise UserError(f"--embedded {spec.embedded} is a task: add --chat --seq-len N, --preferences or --prompts")
    if spec.embedded and spec.embedded not in EMBEDDED_TASKS and spec.records:
        raise UserError(f"--embedded {spec.embedded} holds no {spec.records}; the embedded task is {EMBEDDED_TASKS[0]}")
    if spec.records is not None:
        if spec.tokenizer in ("bpe", "byte"):
            raise UserError(
                f"--{spec.records} tokenizes with the model's tokenizer and its chat template: give --tokenizer PATH "
                "(e.g. the SFT dataset's tokenizer.json)"
            )
        if spec.seq_len is not None:
            raise UserError(
                f"--seq-len sets the rows conversations are packed into; --{spec.records} keeps records whole"
            )
    if spec.embedded in EMBEDDED_CONVERSATIONS and not spec.chat:
        raise UserError(f"--embedded {spec.embedded} is a set of conversations: add --chat --seq-len N")
    if spec.embedded in EMBEDDED_CORPORA and spec.chat:
        raise UserError(f"--embedded {spec.embedded} is plain text, not conversations: leave out --chat")
    if spec.chat:
        if spec.seq_len is None or spec.seq_len < 2:
            raise UserError("--chat packs conversations into rows of data.seq_len tokens: give --seq-len N (2 or more)")
        if spec.tokenizer in ("bpe", "byte"):
            raise UserError(
                "--chat tokenizes with the model's tokenizer (the chat tokens are added to it): "
                "give --tokenizer PATH, e.g. the pre-training dataset's tokenizer.json"
            )
    elif spec.seq_len is not None:
        raise UserError("--seq-len sets the rows conversations are packed into; it needs --chat")


def _document_source(spec: PrepareSpec) -> Callable[[], Iterator[Document]]:
    """A function that yields the documents afresh (BPE training and encoding each need a pass)."""
    if spec.embedded in EMBEDDED_TASKS:
        view = spec.records or "chat"
        budget = (spec.embedded_max_bytes, spec.embedded_skip_bytes)
        return lambda: within_budget(task_documents(spec.embedded, view), *budget)
    if spec.embedded:
        embedded = embedded_conversations if spec.chat else embedded_documents
        return lambda: embedded(spec.embedded, spec.embedded_max_bytes, spec.embedded_skip_bytes)
    files = collect_files(spec.inputs)
    if spec.records:
        read = partial(read_record_rows, kind=spec.records)
    elif spec.chat:
        read = read_conversations
    else:
        read = partial(read_texts, field=spec.text_field)
    return lambda: (document for path in files for part in parts(path) for document in read(part))


def _hash_sources(documents: Iterator[Document], files: list[Path]) -> list[dict]:
    """sha256 of each source file's bytes (of each embedded document's text), with byte and document counts."""
    by_source: dict[str, dict] = {}
    hashers: dict[str, hashlib._Hash] = {}
    for document in documents:
        entry = by_source.setdefault(document.source, {"source": document.source, "bytes": 0, "documents": 0})
        data = document.text.encode("utf-8")
        hashers.setdefault(document.source, hashlib.sha256()).update(data)
        entry["bytes"] += len(data)
        entry["documents"] += 1
    for source, entry in by_source.items():
        is_file = not source.startswith("embedded:")
        entry["sha256"] = sha256_file(Path(source)) if is_file else hashers[source].hexdigest()
    if not by_source:
        raise UserError(no_documents(files))
    return list(by_source.values())


def spec_settings(spec: PrepareSpec) -> dict:
    settings = {
        "tokenizer": spec.tokenizer,
        "text_field": spec.text_field,
        "shard_tokens": spec.shard_tokens,
        "embedded": spec.embedded,
        "embedded_max_bytes": spec.embedded_max_bytes if spec.embedded else None,
    }
    if spec.embedded_skip_bytes:
        settings["embedded_skip_bytes"] = spec.embedded_skip_bytes
    if spec.chat or spec.records:
        template = chosen_template(spec.chat_template, spec.tokenizer)
        name = template_label(template)
        if spec.chat:
            settings["chat"] = {"template": name, "seq_len": spec.seq_len}
        else:
            settings["records"] = {"kind": spec.records, "template": name}
    if spec.tokenizer == "bpe":
        settings["vocab_size"] = spec.vocab_size
    elif spec.tokenizer != "byte":
        settings["tokenizer_sha256"] = sha256_file(Path(spec.tokenizer))
    return settings


def _make_tokenizer(spec: PrepareSpec, documents: Callable[[], Iterator[Document]]) -> Tokenizer:
    if spec.tokenizer == "byte":
        return ByteTokenizer()
    if spec.tokenizer == "bpe":
        return BPETokenizer.train((doc.text for doc in documents()), spec.vocab_size)
    return load_tokenizer(spec.tokenizer)


def _write_dataset(spec: PrepareSpec, documents: Callable[[], Iterator[Document]], staging: Path) -> dict:
    if spec.records:
        return _write_record_dataset(spec, documents, staging)
    if spec.chat:
        return _write_conversations(spec, documents, staging)
    tokenizer = _make_tokenizer(spec, documents)
    writer = ShardWriter(staging, token_dtype(tokenizer), spec.shard_tokens)
    document_count = 0
    batch: list[str] = []
    for document in documents():
        batch.append(document.text)
        if len(batch) == _ENCODE_BATCH:
            document_count += _write_batch(tokenizer, batch, writer)
            batch = []
    document_count += _write_batch(tokenizer, batch, writer)
    writer.close()
    return token_manifest(tokenizer, staging, writer, document_count)


def _write_parts(
    spec: PrepareSpec,
    files: list[Path],
    file_sha256: dict[str, str],
    staging: Path,
    workers: int | None,
    ray: RayEngine | None,
    prepared_by: dict,
    split_bytes: int,
) -> tuple[dict, list[dict]]:
    """The dataset and its `source_hashes`, the parts of `files` tokenised by `workers` processes (or Ray
    tasks, which describe their cluster in `prepared_by`) and their part files appended to the shards in input
    order. A BPE tokenizer is trained first, here, on every document, as one process would."""
    tokenizer = _make_tokenizer(spec, _document_source(spec))
    dtype = token_dtype(tokenizer)
    writer = ShardWriter(staging, dtype, spec.shard_tokens)
    every = list(enumerate(part for path in files for part in parts(path, split_bytes)))
    spill = staging / ".parts"
    spill.mkdir()
    results = []
    if ray is None:
        tokenized = tokenize_parts(every, tokenizer, spec.text_field, dtype, spill, workers)
    else:
        tokenized = tokenize_parts_on_ray(every, tokenizer, spec.text_field, dtype, spill, ray, prepared_by)
    for result in tokenized:
        for tokens in read_part_file(result.path, dtype, result.tokens, result.sha256):
            writer.add(tokens)
        result.path.unlink()
        results.append(result)
    spill.rmdir()
    writer.close()
    manifest = token_manifest(tokenizer, staging, writer, sum(result.documents for result in results))
    return manifest, source_entries(results, file_sha256)


def _same_files(recorded: object, file_sha256: dict[str, str], text_field: str) -> bool:
    """Whether `source_hashes` a manifest recorded are what these files give, without tokenising them: every
    recorded source has its sha256 still, in the same order, and a file it does not name (one that held no
    document) still holds none."""
    if not isinstance(recorded, list) or not all(isinstance(entry, dict) for entry in recorded):
        return False
    recorded_sha256 = {entry.get("source"): entry.get("sha256") for entry in recorded}
    order = []
    for source, sha256 in file_sha256.items():
        if source in recorded_sha256:
            if recorded_sha256[source] != sha256:
                return False
            order.append(source)
        elif any(True for part in parts(Path(source)) for _ in read_texts(part, text_field)):
            return False
    return order == [entry.get("source") for entry in recorded]


def _write_conversations(spec: PrepareSpec, documents: Callable[[], Iterator[Document]], staging: Path) -> dict:
    """Conversations rendered with the chat template, packed whole into rows of `seq_len`, with the mask
    stream beside the tokens. One end-of-text closes the stream so the last row also makes a window."""
    encoder = chat_encoder(load_tokenizer(spec.tokenizer), chosen_template(spec.chat_template, spec.tokenizer))
    tokenizer = encoder.tokenizer
    packer = RowPacker(spec.seq_len, tokenizer.eos_id)
    writer = ShardWriter(staging, token_dtype(tokenizer), spec.shard_tokens)
    mask_writer = ShardWriter(staging, np.uint8, spec.shard_tokens, prefix="mask")

    def write(rows: list[tuple[np.ndarray, np.ndarray] | None]) -> None:
        for row in rows:
            if row is not None:
                writer.add(row[0])
                mask_writer.add(row[1])

    batch: list[list] = []
    for document in documents():
        batch.append(parse_messages(json.loads(document.text), document.where))
        if len(batch) == _ENCODE_BATCH:
            write([packer.add(conversation) for conversation in encoder.render_many(batch)])
            batch = []
    write([packer.add(conversation) for conversation in encoder.render_many(batch)])
    write(packer.finish())
    write([(np.asarray([tokenizer.eos_id]), np.zeros(1, dtype=bool))])
    if packer.stats.trained_tokens == 0:
        raise UserError(
            f"no conversation keeps an assistant token within rows of {spec.seq_len} tokens; raise --seq-len"
        )
    writer.close()
    mask_writer.close()
    manifest = token_manifest(tokenizer, staging, writer, packer.stats.conversations)
    template = keep_template(encoder, staging)
    manifest["chat"] = {"template": template, "seq_len": spec.seq_len, **packer.stats.as_record()}
    manifest["loss_mask"] = {"shards": mask_writer.shards}
    return manifest


def _write_record_dataset(spec: PrepareSpec, documents: Callable[[], Iterator[Document]], staging: Path) -> dict:
    """Preference pairs or prompts, each kept whole, tokenized with the chat template."""
    encoder = chat_encoder(load_tokenizer(spec.tokenizer), chosen_template(spec.chat_template, spec.tokenizer))
    tokenizer = encoder.tokenizer
    records = write_records(documents(), spec.records, encoder, staging)
    records["template"] = keep_template(encoder, staging)
    (staging / TOKENIZER_NAME).write_text(tokenizer.to_json(), encoding="utf-8")
    records["files"] = [file_entry(staging / name) for name in records["files"]]
    return {
        "format": DATASET_FORMAT,
        "version": DATASET_VERSION,
        "tokenizer": tokenizer_record(tokenizer, staging),
        "documents": records["count"],
        "total_tokens": records.pop("tokens"),
        "shards": [],
        "records": records,
    }


def _write_batch(tokenizer: Tokenizer, texts: list[str], writer: ShardWriter) -> int:
    for ids in encode_documents(tokenizer, texts):
        writer.add(ids)
        writer.add(np.asarray([tokenizer.eos_id]))
    return len(texts)

"""The file formats `ferry data prepare` reads, each as a stream of rows with memory bounded by a row group.

    .txt                        one document per file
    .jsonl                      one JSON object per line
    .jsonl.gz / .json.gz        the same, gzip-compressed (Dolma's files are .json.gz JSON lines)
    .jsonl.zst / .json.zst      the same, zstd-compressed (one frame or several)
    .parquet                    a table (FineWeb and most hub datasets), read a row group at a time
    .arrow                      an Arrow IPC stream or file, read a record batch at a time
    a `save_to_disk` directory  Hugging Face `datasets`' layout: `data-*.arrow` IPC streams named in
                                `state.json`, beside `dataset_info.json` (read with pyarrow alone)

The unit of reading is a `Part`: a whole file, one row group of a Parquet file, or, when parts are asked
for a pool of workers, a byte range of a large JSON-lines file (whole lines, or whole frames of a zstd
file: `ferry.data.splitting`). Parts are independent (each opens its own file and knows where it begins),
so they are what a pool of workers shares out; reading the parts in order gives the documents in input order.

A failure names the file and the line (counted from 1, as editors do) or the row (counted from 0,
as pyarrow and `datasets` index them).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from ferry.config.errors import UserError
from ferry.data.corpus import Document
from ferry.data.splitting import frame_ranges, line_ranges

# longest suffix first: `.jsonl.gz` must not be taken for a bare `.gz`
_SUFFIXES = {
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".json.zst": "jsonl.zst",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
RECORD_FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")
_ROWS_DESCRIBED = ".jsonl, .jsonl.gz, .json.gz, .jsonl.zst, .json.zst, .parquet, .arrow, or a save_to_disk directory"
DESCRIBED = f".txt, {_ROWS_DESCRIBED}"
ARROW_STATE = "state.json"
DATASET_DICT = "dataset_dict.json"
_BATCH_ROWS = 1024
_ZSTD_READ = 1 << 16


@dataclass(frozen=True)
class Part:
    """A unit of reading: a whole file, row group `row_group` of a Parquet file (its rows counted from
    `first_row`), or bytes [`start`, `end`) of a JSON-lines file (compressed bytes for zstd)."""

    path: Path
    format: str
    row_group: int | None = None
    first_row: int = 0
    start: int = 0
    end: int | None = None

    @property
    def is_range(self) -> bool:
        return self.end is not None

    @property
    def weight(self) -> int | None:
        """Its bytes, when it is a byte range (else its file's bytes are shared among its file's parts)."""
        return self.end - self.start if self.end is not None else None


def file_format(path: Path) -> str | None:
    """The format a file's name says it holds; None for a file prepare does not read."""
    return next((kind for suffix, kind in _SUFFIXES.items() if path.name.endswith(suffix)), None)


def is_arrow_dataset(directory: Path) -> bool:
    """Whether `directory` is a dataset `datasets.Dataset.save_to_disk` wrote."""
    return (directory / ARROW_STATE).is_file() and any(directory.glob("data-*.arrow"))


def collect_files(inputs: Iterable[str]) -> list[Path]:
    """The files the inputs name, in order: a directory gives its readable files sorted by path, a
    `save_to_disk` directory (or one inside a directory) its Arrow files in the order `state.json` lists."""
    files: list[Path] = []
    for text in inputs:
        path = Path(text)
        if (path / DATASET_DICT).is_file():
            splits = sorted(child.name for child in path.iterdir() if is_arrow_dataset(child))
            raise UserError(
                f"input {text!r} is a DatasetDict of splits {', '.join(splits) or '(none)'}: give the directory of "
                f"the split to prepare, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
            )
        if path.is_dir():
            found = _directory_files(path)
            if not found:
                raise UserError(f"input directory {text!r} holds nothing prepare reads ({DESCRIBED})")
            files.extend(found)
        elif path.is_file():
            if file_format(path) is None:
                raise UserError(f"input {text!r} is none of {DESCRIBED}")
            files.append(path)
        else:
            raise UserError(f"input {text!r} does not exist")
    return files


def no_documents(files: list[Path]) -> str:
    """The refusal of inputs that gave not one document, naming the files (an empty table or file is easily
    passed by mistake: the message should say which)."""
    if not files:
        return "the inputs hold no documents"
    named = ", ".join(str(path) for path in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return f"the inputs hold no documents: {named} {'holds' if len(files) == 1 else 'hold'} no rows or text"


def documentless(files: list[Path], sources: list[dict]) -> list[Path]:
    """The input files no document came from, beside those `sources` (a manifest's `source_hashes`) name."""
    named = {entry.get("source") for entry in sources}
    return [path for path in files if str(path) not in named]


def parts(path: Path, split_bytes: int | None = None) -> list[Part]:
    """The parts of one input file: its row groups for Parquet; with `split_bytes`, byte ranges of about that
    size of a large `.jsonl` (whole lines) or multi-frame `.jsonl.zst` (whole frames); the whole file otherwise."""
    kind = file_format(path)
    if split_bytes is not None and kind in ("jsonl", "jsonl.zst"):
        ranges = line_ranges(path, split_bytes) if kind == "jsonl" else frame_ranges(path, split_bytes)
        if len(ranges) > 1:
            return [Part(path, kind, start=start, end=end) for start, end in ranges]
    if kind != "parquet":
        return [Part(path, kind)]
    with _parquet(path) as table:
        metadata = table.metadata
    found, first = [], 0
    for index in range(metadata.num_row_groups):
        found.append(Part(path, kind, index, first))
        first += metadata.row_group(index).num_rows
    return found


def read_texts(part: Part, field: str) -> Iterator[Document]:
    """The documents of a part: a `.txt` file whole, else the string `field` of every row."""
    if part.format == "text":
        try:
            yield Document(str(part.path), part.path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise UserError(f"input {str(part.path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return
    if part.format in ("parquet", "arrow"):
        for first, batch in _batches(part, [field], "--text-field names the column of text"):
            for row, text in enumerate(batch.column(0).to_pylist(), start=first):
                if not isinstance(text, str):
                    raise UserError(f"{part.path} row {row}: {field!r} is {_kind(text)}, not text")
                yield Document(str(part.path), text, row=row)
        return
    numbering = _Numbering(part)
    for number, record in json_lines(part, numbering):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise UserError(f"{part.path}:{numbering.line(number)}: expected an object with a string field {field!r}")
        yield Document(str(part.path), record[field], line=None if part.is_range else number)


def read_records(part: Part, fields: list[str], what: str) -> Iterator[tuple[int | None, int | None, object]]:
    """(line, row, record) of every row of a part: a parsed JSON line, or a table's row read for `fields`
    only (a table without one of them is refused, naming its columns). `what` names the rows in errors:
    conversation, preferences, prompts."""
    if part.format not in RECORD_FORMATS:
        raise UserError(f"{what} input {str(part.path)!r} is not a file of rows ({_ROWS_DESCRIBED})")
    if part.format in ("parquet", "arrow"):
        for first, batch in _batches(part, fields, f"{what} rows need {', '.join(fields)}"):
            for row, record in enumerate(batch.to_pylist(), start=first):
                yield None, row, record
        return
    for number, record in json_lines(part):
        yield number, None, record


def json_lines(part: Part, numbering: _Numbering | None = None) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-empty line of a JSON-lines part, plain or compressed; the number
    counts from the part's first line (the file's, unless the part is a byte range: `numbering` tells the file's
    line, which errors name)."""
    numbering = numbering or _Numbering(part)
    for number, line in _lines(part, numbering):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            reason = f"{exc.reason} at byte {exc.start} of the line"
            raise UserError(f"{part.path}:{numbering.line(number)}: not UTF-8 text ({reason})") from None
        if not text.strip():
            continue
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{part.path}:{numbering.line(number)}: not valid JSON ({exc.msg})") from None


class _Numbering:
    """The file's line number of a part's line: a byte range counts the lines before it only when an error
    needs the number (a pass over the bytes before it, decompressed for zstd), so reading pays nothing."""

    def __init__(self, part: Part):
        self._part = part
        self._before: int | None = 0 if part.start == 0 else None

    def line(self, number: int) -> int:
        if self._before is None:
            self._before = _lines_before(self._part)
        return self._before + number


def _lines_before(part: Part) -> int:
    with part.path.open("rb") as handle:
        if part.format == "jsonl":
            return sum(chunk.count(b"\n") for chunk in _read_range(handle, 0, part.start))
        return sum(chunk.count(b"\n") for chunk in _zstd_chunks(_RangeReader(handle, 0, part.start)))


def _lines(part: Part, numbering: _Numbering) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each line; a compressed stream cut short or corrupt is refused naming the line
    it stopped before."""
    number = 0
    codec = "gzip" if part.format == "jsonl.gz" else "zstd"
    if part.format != "jsonl" and part.path.stat().st_size == 0:
        raise UserError(
            f"input {str(part.path)!r} is empty (0 bytes), which is no {codec} stream (one holds at least one "
            f"{'member' if codec == 'gzip' else 'frame'}): write it again, or leave it out of the inputs"
        )
    try:
        if part.format == "jsonl":
            with part.path.open("rb") as handle:
                lines = _split_lines(_read_range(handle, part.start, part.end)) if part.is_range else handle
                for number, line in enumerate(lines, start=1):
                    yield number, line
        elif part.format == "jsonl.gz":
            with gzip.open(part.path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    yield number, line
        else:
            with part.path.open("rb") as handle:
                source = _RangeReader(handle, part.start, part.end) if part.is_range else handle
                for number, line in enumerate(_split_lines(_zstd_chunks(source)), start=1):
                    yield number, line
    except (EOFError, OSError, zlib.error, zstandard.ZstdError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile):
            raise UserError(f"input {str(part.path)!r} cannot be read: {exc}") from None
        raise UserError(
            f"{part.path}:{numbering.line(number + 1)}: the {codec} stream is corrupt or cut short before this line "
            f"({exc})"
        ) from None


def _read_range(handle, start: int, end: int | None) -> Iterator[bytes]:
    """The bytes [start, end) of an open file, in chunks."""
    reader = _RangeReader(handle, start, end)
    while chunk := reader.read(_ZSTD_READ):
        yield chunk


class _RangeReader:
    """`read` of the bytes [start, end) of an open file only (to its end when `end` is None)."""

    def __init__(self, handle, start: int, end: int | None):
        handle.seek(start)
        self._handle = handle
        self._left = end - start if end is not None else None

    def read(self, size: int) -> bytes:
        if self._left is None:
            return self._handle.read(size)
        data = self._handle.read(min(size, self._left))
        self._left -= len(data)
        return data


def _zstd_chunks(handle) -> Iterator[bytes]:
    """Decompressed bytes of every zstd frame in `handle`; a last frame without its end is an error
    (zstandard's stream reader would end quietly there)."""
    decompressor = zstandard.ZstdDecompressor()
    next_frame = partial(decompressor.decompressobj, read_across_frames=False)  # frame ends are seen here
    frame = next_frame()
    in_frame = False
    while compressed := handle.read(_ZSTD_READ):
        while compressed:
            in_frame = True
            if out := frame.decompress(compressed):
                yield out
            if not frame.eof:
                break
            compressed = frame.unused_data
            frame = next_frame()
            in_frame = False
    if in_frame:
        raise zstandard.ZstdError("the file ends inside a frame: it is truncated")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    pending: list[bytes] = []
    for chunk in chunks:
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            pending.append(chunk)
            continue
        yield b"".join([*pending, lines[0]]) + b"\n"
        for line in lines[1:-1]:
            yield line + b"\n"
        pending = [lines[-1]] if lines[-1] else []
    if pending:
        yield b"".join(pending)


def _batches(part: Part, fields: list[str], why: str) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(number of its first row, batch of the columns `fields`) of a Parquet row group or an Arrow file;
    `why` the columns are needed, for the message refusing a table that lacks one."""
    try:
        with ExitStack() as opened:
            if part.format == "parquet":
                table = opened.enter_context(_parquet(part.path))
                _check_columns(part.path, table.schema_arrow, fields, why)
                batches = table.iter_batches(batch_size=_BATCH_ROWS, row_groups=[part.row_group], columns=fields)
            else:
                schema, batches = _arrow_batches(opened.enter_context(pa.memory_map(str(part.path))))
                _check_columns(part.path, schema, fields, why)
                batches = (batch.select(fields) for batch in batches)
            row = part.first_row
            for batch in batches:
                yield row, batch
                row += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"input {str(part.path)!r} cannot be read as {part.format}: {exc}") from None


def _check_columns(path: Path, schema: pa.Schema, fields: list[str], why: str) -> None:
    missing = [name for name in fields if name not in schema.names]
    if missing:
        raise UserError(
            f"{path}: no column {', '.join(repr(name) for name in missing)} ({why}); "
            f"its columns: {', '.join(schema.names) or 'none'}"
        )


def _parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"input {str(path)!r} cannot be read as Parquet: {exc}") from None


def _arrow_batches(source: pa.MemoryMappedFile) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and record batches of an Arrow IPC stream (what `datasets` writes) or file; memory-mapped,
    a batch is paged in when it is read."""
    try:
        stream = pa.ipc.open_stream(source)
        return stream.schema, iter(stream)
    except pa.ArrowInvalid:
        source.seek(0)
        file = pa.ipc.open_file(source)
        return file.schema, (file.get_batch(index) for index in range(file.num_record_batches))


def _directory_files(directory: Path) -> list[Path]:
    if is_arrow_dataset(directory):
        return _arrow_dataset_files(directory)
    saved = {state.parent for state in directory.rglob(ARROW_STATE) if is_arrow_dataset(state.parent)}
    files: list[Path] = []
    for path in sorted(directory.rglob("*")):
        if saved.intersection(path.parents):
            continue
        if path in saved:
            files.extend(_arrow_dataset_files(path))
        elif path.is_file() and file_format(path) is not None:
            files.append(path)
    return files


def _arrow_dataset_files(directory: Path) -> list[Path]:
    """The data files of a `save_to_disk` directory in the order its `state.json` lists them."""
    state_path = directory / ARROW_STATE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(
            f"{state_path} does not list the dataset's files as save_to_disk writes them ({exc!r})"
        ) from None
    files = [directory / name for name in names]
    absent = [str(path) for path in files if not path.is_file()]
    if absent:
        raise UserError(f"{state_path} lists {absent[0]}, which does not exist")
    return files


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__

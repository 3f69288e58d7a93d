"""Corpora of text in every format `ferry data prepare` reads, built in the tests that prepare them in parallel
(worker processes, tasks, Ray, datatrove): several JSON-lines files, a gzip one, a Parquet file of several row
groups and an empty file, with non-ASCII text and the end-of-text marker inside documents."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def text_rows(start: int, count: int) -> list[dict]:
    words = ("ferry", "expert", "router", "tëxt", "шард", "日本", "token", "batch", "loss", "<|endoftext|>")
    return [
        {"text": f"doc {index}: " + " ".join(words[(index * 7 + k) % len(words)] for k in range(2 + index % 17))}
        for index in range(start, start + count)
    ]


def json_lines(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_mixed_corpus(directory: Path) -> Path:
    """a0-a2.jsonl, b.jsonl.gz, c.parquet (7 row groups) and an empty d.jsonl: 970 documents."""
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(3):
        (directory / f"a{index}.jsonl").write_text(json_lines(text_rows(index * 150, 150)), encoding="utf-8")
    (directory / "b.jsonl.gz").write_bytes(gzip.compress(json_lines(text_rows(450, 120)).encode("utf-8")))
    pq.write_table(pa.Table.from_pylist(text_rows(570, 400)), directory / "c.parquet", row_group_size=60)
    (directory / "d.jsonl").write_text("", encoding="utf-8")
    return directory


def directory_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}

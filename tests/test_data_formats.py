"""`ferry data prepare` reads the formats corpora ship in: the same rows as JSON lines (plain, gzip, zstd),
Parquet or a `datasets` save_to_disk directory make the same dataset, and a malformed file exits 2 naming
the file and the line or row, leaving nothing behind. Every file is built here, with pyarrow and the stdlib."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from ferry.cli.main import main
from ferry.data.formats import collect_files, parts, read_texts

TEXT_FORMATS = ("jsonl", "jsonl.gz", "json.gz", "jsonl.zst", "parquet", "arrow-dir")


def _documents(count: int = 240) -> list[dict]:
    """Rows with text worth tokenizing: several lines, non-ASCII letters, an id column beside the text."""
    words = ("ferry", "expert", "router", "tëxt", "шард", "日本", "token", "batch", "loss", '{"json": 1}')
    return [
        {
            "id": index,
            "text": " ".join(words[(index * 7 + k) % len(words)] for k in range(3 + index % 11))
            + ("\nsecond line" if index % 5 == 0 else ""),
        }
        for index in range(count)
    ]


def _json_lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n" for row in rows)


def _save_to_disk(directory: Path, table: pa.Table, files: int) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC streams `data-0000i-of-0000n.arrow`,
    `state.json` listing them, and `dataset_info.json`."""
    directory.mkdir(parents=True)
    names = [f"data-{index:05d}-of-{files:05d}.arrow" for index in range(files)]
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for name, start, stop in zip(names, bounds[:-1], bounds[1:]):
        with pa.ipc.new_stream(directory / name, table.schema) as writer:
            writer.write_table(table.slice(start, stop - start), max_chunksize=50)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return directory


def _write(directory: Path, rows: list[dict], kind: str) -> Path:
    """`rows` in format `kind`: JSON lines plain or compressed (zstd in two frames), Parquet in row groups
    of 50 rows, or a save_to_disk directory of three files."""
    lines = _json_lines(rows)
    path = directory / f"rows.{kind}"
    if kind == "jsonl":
        path.write_bytes(lines)
    elif kind in ("jsonl.gz", "json.gz"):
        path.write_bytes(gzip.compress(lines))
    elif kind == "jsonl.zst":
        half = lines.index(b"\n", len(lines) // 2) + 1
        compressor = zstandard.ZstdCompressor()
        path.write_bytes(compressor.compress(lines[:half]) + compressor.compress(lines[half:]))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=50)
    else:
        return _save_to_disk(directory / "saved", pa.Table.from_pylist(rows), files=3)
    return path


def _prepare(inputs: list[Path], output: Path, *flags: str) -> int:
    return main(["data", "prepare", *map(str, inputs), "--output", str(output), *flags])


def _dataset_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.name != "manifest.json"}


def _manifest_without_sources(directory: Path) -> tuple[dict, dict]:
    """The manifest less `source_hashes` (which names each input file and its sha256), and the totals
    of bytes and documents those entries count, which do not depend on the format."""
    manifest = json.loads((directory / "manifest.json").read_text())
    sources = manifest.pop("source_hashes")
    totals = {key: sum(entry[key] for entry in sources) for key in ("bytes", "documents")}
    return manifest, totals


def test_every_format_of_the_same_texts_makes_the_same_dataset(tmp_path, capsys):
    rows = _documents()
    flags = ("--tokenizer", "bpe", "--vocab-size", "320", "--shard-tokens", "700")
    datasets = {}
    for kind in TEXT_FORMATS:
        (tmp_path / kind).mkdir()
        source = _write(tmp_path / kind, rows, kind)
        assert _prepare([source], tmp_path / f"out-{kind}", *flags) == 0, capsys.readouterr().err
        datasets[kind] = tmp_path / f"out-{kind}"
    reference = datasets["jsonl"]
    assert len([name for name in _dataset_files(reference) if name.startswith("shard-")]) > 3
    for kind, directory in datasets.items():
        assert _dataset_files(directory) == _dataset_files(reference), kind
        assert _manifest_without_sources(directory) == _manifest_without_sources(reference), kind
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["documents"] == len(rows)
    saved = json.loads((datasets["arrow-dir"] / "manifest.json").read_text())["source_hashes"]
    assert [Path(entry["source"]).name for entry in saved] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]


def test_a_directory_of_mixed_formats_reads_its_files_in_path_order(tmp_path, capsys):
    rows = _documents(60)
    (tmp_path / "mixed" / "a").mkdir(parents=True)
    (tmp_path / "mixed" / "b").mkdir()
    _write(tmp_path / "mixed" / "a", rows[:20], "parquet")
    _save_to_disk(tmp_path / "mixed" / "b" / "saved", pa.Table.from_pylist(rows[20:40]), files=2)
    (tmp_path / "mixed" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_json_lines(rows[40:])))
    (tmp_path / "mixed" / "notes.md").write_text("not an input")
    files = collect_files([str(tmp_path / "mixed")])
    texts = [document.text for path in files for part in parts(path) for document in read_texts(part, "text")]
    assert texts == [row["text"] for row in rows]
    (tmp_path / "flat").mkdir()
    assert _prepare([tmp_path / "mixed"], tmp_path / "out", "--tokenizer", "byte") == 0
    assert _prepare([_write(tmp_path / "flat", rows, "jsonl")], tmp_path / "flat-out", "--tokenizer", "byte") == 0
    assert _dataset_files(tmp_path / "out") == _dataset_files(tmp_path / "flat-out")


def test_parquet_is_read_a_row_group_at_a_time(tmp_path):
    """Each row group is a part that reads alone (the unit a pool of workers would share), and the
    memory Arrow holds while reading stays near one row group, far below the file's size."""
    path = tmp_path / "big.parquet"
    numbers = np.random.default_rng(0).integers(0, 1 << 62, size=(4000, 64)).astype(str)
    texts = [" ".join(row) for row in numbers]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=250, compression="none")
    assert path.stat().st_size > 4_000_000
    found = parts(path)
    assert [part.first_row for part in found] == list(range(0, 4000, 250))
    alone = [document for part in reversed(found) for document in read_texts(part, "text")]
    assert sorted(document.row for document in alone) == list(range(4000))
    del alone
    before = pa.total_allocated_bytes()
    held = 0
    for part in found:
        for document in read_texts(part, "text"):
            held = max(held, pa.total_allocated_bytes() - before)
            assert document.text == texts[document.row]
    assert held < path.stat().st_size / 4  # a few of its 16 row groups, never the whole file


def _tokenizer(tmp_path: Path) -> Path:
    source = _write(tmp_path, _documents(), "jsonl")
    assert _prepare([source], tmp_path / "base", "--vocab-size", "300") == 0
    return tmp_path / "base" / "tokenizer.json"


def test_conversations_preferences_and_prompts_come_from_every_format(tmp_path, capsys):
    tokenizer = _tokenizer(tmp_path)
    conversations = [
        {
            "messages": [
                {"role": "user", "content": f"what is {i} + {i}?"},
                {"role": "assistant", "content": f"{i} + {i} is {2 * i}."},
            ]
        }
        for i in range(30)
    ]
    preferences = [{"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(30)]
    prompts = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(30)]
    cases = (
        (conversations, ("--chat", "--seq-len", "32")),
        (preferences, ("--preferences",)),
        (prompts, ("--prompts",)),
    )
    for index, (rows, flags) in enumerate(cases):
        written = {}
        for kind in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow-dir"):
            directory = tmp_path / f"{index}-{kind}"
            directory.mkdir()
            output = directory / "out"
            code = _prepare([_write(directory, rows, kind)], output, "--tokenizer", str(tokenizer), *flags)
            assert code == 0, capsys.readouterr().err
            written[kind] = output
        for kind, output in written.items():
            assert _dataset_files(output) == _dataset_files(written["jsonl"]), (flags, kind)
            assert _manifest_without_sources(output) == _manifest_without_sources(written["jsonl"]), (flags, kind)


def _zstd_frames_then_garbage(path: Path) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(_json_lines(_documents(5))) + b"not a zstd frame at all")


def _truncated(path: Path, data: bytes, compress) -> None:
    whole = compress(data)
    path.write_bytes(whole[: len(whole) * 2 // 3])


MALFORMED = {
    # name: (file name, writer, what the message names besides the file)
    "parquet without the text column": (
        "rows.parquet",
        lambda p: pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), p),
        ["no column 'text'", "its columns: id, body"],
    ),
    "a null text in a parquet row": (
        "rows.parquet",
        lambda p: pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), p, row_group_size=2),
        [" row 2: 'text' is null"],
    ),
    "a truncated gzip": (
        "rows.jsonl.gz",
        lambda p: _truncated(p, _json_lines(_documents(400)), gzip.compress),
        ["gzip stream is corrupt or cut short before this line", "ended before the end-of-stream"],
    ),
    "a zstd frame error": ("rows.jsonl.zst", _zstd_frames_then_garbage, [":6: the zstd stream", "Unknown frame"]),
    "a truncated zstd": (
        "rows.jsonl.zst",
        lambda p: _truncated(p, _json_lines(_documents(400)), zstandard.ZstdCompressor().compress),
        [":1: the zstd stream is corrupt or cut short", "it is truncated"],
    ),
    "a non-UTF-8 line": (
        "rows.jsonl.gz",
        lambda p: p.write_bytes(gzip.compress(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')),
        [":3: not UTF-8 text"],
    ),
    "a JSON line that does not parse": (
        "rows.jsonl.zst",
        lambda p: p.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "ok"}\n{"text": \n')),
        [":2: not valid JSON"],
    ),
    "a save_to_disk state naming a missing file": (
        "saved",
        lambda p: (_save_to_disk(p, pa.table({"text": ["a", "b"]}), 2), (p / "data-00001-of-00002.arrow").unlink()),
        ["state.json lists", "data-00001-of-00002.arrow, which does not exist"],
    ),
    "a DatasetDict rather than one split": (
        "splits",
        lambda p: (
            _save_to_disk(p / "train", pa.table({"text": ["a"]}), 1),
            (p / "dataset_dict.json").write_text('{"splits": ["train"]}'),
        ),
        ["is a DatasetDict of splits train: give the directory of the split to prepare"],
    ),
    "an empty zstd file": ("rows.jsonl.zst", lambda p: p.write_bytes(b""), ["is empty (0 bytes), which is no zstd"]),
    "an empty gzip file": ("rows.jsonl.gz", lambda p: p.write_bytes(b""), ["is empty (0 bytes), which is no gzip"]),
    "a parquet table without rows": (
        "rows.parquet",
        lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p),
        ["the inputs hold no documents: ", "rows.parquet holds no rows or text"],
    ),
    "a parquet file that is not one": (
        "rows.parquet",
        lambda p: p.write_bytes(b"PAR1 but nothing else"),
        ["cannot be read as Parquet"],
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_inputs_exit_2_naming_the_file_and_line_and_leave_nothing_behind(case, tmp_path, capsys):
    name, write, expected = MALFORMED[case]
    path = tmp_path / "in" / name
    path.parent.mkdir()
    write(path)
    code = _prepare([path], tmp_path / "out", "--tokenizer", "byte")
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ferry: error:") and "Traceback" not in err
    assert str(path) in err
    for part in expected:
        assert part in err, (part, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "a failed prepare must leave nothing behind"


def test_a_failed_prepare_keeps_the_dataset_it_would_have_replaced(tmp_path, capsys):
    good = _write(tmp_path, _documents(50), "parquet")
    output = tmp_path / "out"
    assert _prepare([good], output, "--tokenizer", "byte") == 0
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    bad = tmp_path / "bad.jsonl.gz"
    _truncated(bad, _json_lines(_documents(400)), gzip.compress)
    assert _prepare([bad], output, "--tokenizer", "byte", "--overwrite") == 2
    assert str(bad) in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl.gz", "out", "rows.parquet"]


def test_chat_rows_in_a_table_without_messages_are_refused_naming_the_columns(tmp_path, capsys):
    tokenizer = _tokenizer(tmp_path)
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"conversation": ["hi"]}), path)
    code = _prepare([path], tmp_path / "out", "--tokenizer", str(tokenizer), "--chat", "--seq-len", "32")
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}: no column 'messages' (conversation rows need messages); its columns: conversation" in err
    text = tmp_path / "chat.txt"
    text.write_text("plain text")
    assert _prepare([text], tmp_path / "out", "--tokenizer", str(tokenizer), "--chat", "--seq-len", "32") == 2
    assert "is not a file of rows" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_empty_file_beside_good_ones_is_refused_when_compressed_and_noted_when_a_table(tmp_path, capsys):
    """A 0-byte `.jsonl.zst` is no zstd stream (a stream holds at least one frame): refused, naming it, even beside
    good files. A Parquet table with no rows is valid: beside good files, a note names it."""
    good = _write(tmp_path, _documents(50), "jsonl")
    empty_zst = tmp_path / "empty.jsonl.zst"
    empty_zst.write_bytes(b"")
    assert _prepare([good, empty_zst], tmp_path / "refused", "--tokenizer", "byte") == 2
    assert f"input {str(empty_zst)!r} is empty (0 bytes)" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    no_rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), no_rows)
    for workers in ((), ("--workers", "2")):
        output = tmp_path / f"out{len(workers)}"
        assert _prepare([good, no_rows], output, "--tokenizer", "byte", *workers) == 0
        out = capsys.readouterr().out
        assert f"ferry: note: {no_rows} holds no rows or text: no document of the dataset comes from it" in out
        assert "50 documents" in out

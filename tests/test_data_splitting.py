"""One large file shared among workers: a `.jsonl` in ranges of whole lines, a `.jsonl.zst` of several frames in
ranges of whole frames (found from the frame and block headers), a one-frame `.zst` and a `.gz` whole. The ranges'
documents, read in order, are the file's; an error in a later range names the file's line; and the datasets that
workers, tasks and their merge write from split files are the one a single process writes, byte for byte."""

import json
from pathlib import Path

import pytest
import zstandard
from text_corpora import directory_files, json_lines, text_rows

from ferry.config import UserError
from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.formats import parts, read_texts
from ferry.data.partial import merge_partials, prepare_task
from ferry.data.splitting import zstd_frames

SPLIT = 4096


def _frames(text: str, lines_per_frame: int) -> bytes:
    """Independent zstd frames of `lines_per_frame` lines each, concatenated, as pzstd writes them."""
    lines = text.splitlines(keepends=True)
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
    return b"".join(
        compressor.compress("".join(lines[at : at + lines_per_frame]).encode("utf-8"))
        for at in range(0, len(lines), lines_per_frame)
    )


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("big")
    text = json_lines(text_rows(0, 1500))
    (directory / "a.jsonl").write_text(text, encoding="utf-8")
    (directory / "b.jsonl.zst").write_bytes(_frames(text, 40))
    (directory / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode("utf-8")))
    return directory


def _texts(pieces) -> list[str]:
    return [document.text for part in pieces for document in read_texts(part, "text")]


def test_a_large_jsonl_is_ranges_of_whole_lines_that_read_as_the_file(big):
    path = big / "a.jsonl"
    pieces = parts(path, SPLIT)
    size = path.stat().st_size
    assert len(pieces) >= size // SPLIT - 1 >= 20
    assert pieces[0].start == 0 and pieces[-1].end == size
    data = path.read_bytes()
    for before, after in zip(pieces, pieces[1:]):
        assert before.end == after.start and data[after.start - 1 : after.start] == b"\n"
    assert _texts(pieces) == _texts(parts(path)) and len(_texts(pieces)) == 1500
    assert parts(path, size) == parts(path)  # under twice the range size: whole


def test_a_multi_frame_zst_is_ranges_of_whole_frames_and_one_frame_or_gzip_stay_whole(big, tmp_path):
    path = big / "b.jsonl.zst"
    frames = zstd_frames(path)
    ends = [end for end, _ in frames]
    assert len(ends) == 38 and ends[-1] == path.stat().st_size
    assert sum(content for _, content in frames) == (big / "a.jsonl").stat().st_size
    pieces = parts(path, SPLIT // 4)
    assert len(pieces) > 3 and {piece.end for piece in pieces} <= set(ends)
    assert _texts(pieces) == _texts(parts(big / "a.jsonl"))
    assert parts(big / "c.jsonl.zst", SPLIT // 4) == parts(big / "c.jsonl.zst")  # one frame
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(__import__("gzip").compress((big / "a.jsonl").read_bytes()))
    assert len(parts(gz, SPLIT)) == 1

    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(path.read_bytes()[:-700])
    with pytest.raises(UserError, match="runs past the file's end: it is truncated"):
        zstd_frames(cut)


@pytest.mark.parametrize("name", ["a.jsonl", "b.jsonl.zst"])
def test_an_error_in_a_later_range_names_the_files_line(big, tmp_path, name):
    lines = json_lines(text_rows(0, 1500)).splitlines(keepends=True)
    lines[1203] = '{"text": "cut short\n'
    text = "".join(lines)
    path = tmp_path / name
    if name.endswith(".zst"):
        path.write_bytes(_frames(text, 40))
    else:
        path.write_text(text, encoding="utf-8")
    pieces = parts(path, SPLIT // 4)
    later = next(piece for piece in pieces if piece.start > 0 and _holds_line(piece, pieces, 1204))
    with pytest.raises(UserError, match=rf"{path}:1204: not valid JSON"):
        list(read_texts(later, "text"))


def _holds_line(piece, pieces, line: int) -> bool:
    try:
        list(read_texts(piece, "text"))
    except UserError as exc:
        return f":{line}:" in str(exc)
    return False


def test_workers_tasks_and_their_merge_write_the_one_process_dataset_from_split_files(big, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name in ("a.jsonl", "b.jsonl.zst", "c.jsonl.zst"):
        (inputs / name).write_bytes((big / name).read_bytes())
    spec = PrepareSpec(inputs=[str(inputs)], tokenizer="byte", shard_tokens=5000)
    prepare_dataset(spec, tmp_path / "alone")
    prepare_dataset(spec, tmp_path / "workers", workers=2, split_bytes=SPLIT)
    alone = directory_files(tmp_path / "alone")
    assert directory_files(tmp_path / "workers") == alone
    partials = []
    for task in range(2):
        result = prepare_task(spec, tmp_path / f"task{task}", task, 2, workers=2, split_bytes=SPLIT)
        partials.append(result.output)
        assert 0 < len(result.partial["part_files"]) < result.partial["parts"]
        assert result.partial["parts"] > 20  # the two large files are shared, not one part each
    merge_partials(partials, tmp_path / "merged")
    assert directory_files(tmp_path / "merged") == alone
    manifest = json.loads(alone["manifest.json"])
    assert [entry["documents"] for entry in manifest["source_hashes"]] == [1500, 1500, 1500]

"""ferry's datatrove steps run by datatrove's own local executor, in a process of its own
(`datatrove_pipeline.py`): its JSON-lines reader and a filter choose the documents, `TokenPartsWriter` tokenises
them in 2 tasks, and `DatasetJoiner` (an executor depending on the first) joins them into the dataset `ferry data
prepare` writes from the same documents in the same order: the same shards and tokenizer, byte for byte. A rank
missing from the join is refused naming it, and the up-to-date dataset is kept when the pipeline runs again."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datatrove_pipeline import keeps
from text_corpora import json_lines, write_mixed_corpus

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data.datatrove_step import join_ranked_parts

_PIPELINE = Path(__file__).with_name("datatrove_pipeline.py")


def _run_pipeline(corpus: Path, work: Path, output: Path, tokenizer: str) -> None:
    """datatrove's executors, in a process of their own (`datatrove_pipeline.py` says why)."""
    ran = subprocess.run(
        [sys.executable, str(_PIPELINE), str(corpus), str(work), str(output), tokenizer],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]


def _texts(path: Path) -> list[str]:
    opened = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with opened as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_datatrove_pipeline_writes_the_dataset_prepare_writes_from_the_same_documents(tmp_path, tokenizer, capsys):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    if tokenizer == "bpe":
        assert main(["data", "prepare", str(corpus), "--output", str(tmp_path / "bpe"), "--vocab-size", "300"]) == 0
        tokenizer = str(tmp_path / "bpe" / "tokenizer.json")
    _run_pipeline(corpus, tmp_path / "work", tmp_path / "joined", tokenizer)

    kept = tmp_path / "kept"  # the documents the filter kept, file by file, for `ferry data prepare`
    kept.mkdir()
    for name in ("a0.jsonl", "a1.jsonl", "a2.jsonl", "b.jsonl.gz"):
        rows = [{"text": text} for text in _texts(corpus / name) if keeps(text)]
        (kept / name.replace(".gz", "")).write_text(json_lines(rows), encoding="utf-8")
    flags = ["--tokenizer", tokenizer, "--shard-tokens", "700"]
    assert main(["data", "prepare", str(kept), "--output", str(tmp_path / "prepared"), *flags]) == 0

    joined = {path.name: path.read_bytes() for path in sorted((tmp_path / "joined").iterdir())}
    prepared = {path.name: path.read_bytes() for path in sorted((tmp_path / "prepared").iterdir())}
    assert len([name for name in joined if name.startswith("shard-")]) > 5
    joined_manifest = json.loads(joined.pop("manifest.json"))
    prepared_manifest = json.loads(prepared.pop("manifest.json"))
    assert joined == prepared  # every shard and the tokenizer
    for key in ("shards", "total_tokens", "documents", "tokenizer", "dtype"):
        assert joined_manifest[key] == prepared_manifest[key], key
    sources = joined_manifest["source_hashes"]
    assert [Path(entry["source"]).name for entry in sources] == ["a0.jsonl", "a1.jsonl", "a2.jsonl", "b.jsonl.gz"]
    assert [entry["documents"] for entry in sources] == [e["documents"] for e in prepared_manifest["source_hashes"]]
    assert joined_manifest["settings"]["engine"] == "datatrove"

    stamp = os.stat(tmp_path / "joined" / "manifest.json").st_mtime_ns
    join_ranked_parts(tmp_path / "work" / "parts", tmp_path / "joined")
    assert os.stat(tmp_path / "joined" / "manifest.json").st_mtime_ns == stamp  # up to date: kept


def test_the_join_refuses_a_rank_that_wrote_nothing(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    _run_pipeline(corpus, tmp_path / "work", tmp_path / "joined", "byte")
    for path in (tmp_path / "work" / "parts" / "rank-00001").iterdir():
        path.unlink()
    (tmp_path / "work" / "parts" / "rank-00001").rmdir()
    with pytest.raises(UserError, match=r"rank\(s\) 1 of 2 wrote nothing to .*the tokenising executor has not"):
        join_ranked_parts(tmp_path / "work" / "parts", tmp_path / "again")
    assert not (tmp_path / "again").exists()

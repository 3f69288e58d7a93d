"""Data pipeline: prepare, manifest, mixes, and an order that depends on (seed, step, batch) only."""

import hashlib
import json

import numpy as np
import pytest

from ferry.config import UserError
from ferry.data import DataConfig, DataCursor, MixedLoader, PrepareSpec, TokenDataset, prepare_dataset
from ferry.data.loader import _apportion
from ferry.data.tokenizer import load_tokenizer


@pytest.fixture
def text_sources(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("The quick brown fox jumps over the lazy dog.\n" * 50)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"record {i}: " + "lorem ipsum " * 10}) for i in range(40)))
    return txt, jsonl


def test_prepare_writes_shards_and_a_manifest_with_hashes(text_sources, tmp_path):
    txt, jsonl = text_sources
    result = prepare_dataset(
        PrepareSpec(inputs=[str(txt), str(jsonl)], tokenizer="byte", shard_tokens=1000), tmp_path / "ds"
    )
    manifest = result.manifest
    assert manifest["documents"] == 41
    sources = {entry["source"]: entry for entry in manifest["source_hashes"]}
    for path in (txt, jsonl):
        assert sources[str(path)]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(manifest["shards"]) > 1
    shards = [np.load(tmp_path / "ds" / shard["file"], mmap_mode="r") for shard in manifest["shards"]]
    assert sum(len(shard) for shard in shards) == manifest["total_tokens"]
    stream = np.concatenate(shards)
    assert stream.dtype == np.uint16
    assert (stream == 256).sum() == 41, "every document ends with end-of-text"
    assert bytes(stream[: txt.stat().st_size].astype(np.uint8)) == txt.read_bytes()


def test_prepare_is_idempotent_and_never_overwrites_silently(text_sources, tmp_path):
    txt, jsonl = text_sources
    spec = PrepareSpec(inputs=[str(txt)], tokenizer="byte")
    assert prepare_dataset(spec, tmp_path / "ds").rebuilt
    assert not prepare_dataset(spec, tmp_path / "ds").rebuilt
    other = PrepareSpec(inputs=[str(jsonl)], tokenizer="byte")
    with pytest.raises(UserError, match="--overwrite"):
        prepare_dataset(other, tmp_path / "ds")
    assert prepare_dataset(other, tmp_path / "ds", overwrite=True).manifest["documents"] == 40


def test_overwrite_replaces_a_dataset_and_nothing_else(text_sources, tmp_path):
    """Not a run directory, not the directory of the inputs, not a file."""
    txt, _ = text_sources
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(txt.read_text())
    (tmp_path / "file").write_text("kept")
    cases = {
        run: (PrepareSpec(inputs=[str(txt)], tokenizer="byte"), "is not a ferry dataset"),
        corpus: (PrepareSpec(inputs=[str(corpus)], tokenizer="byte"), "is not a ferry dataset"),
        tmp_path / "file": (PrepareSpec(inputs=[str(txt)], tokenizer="byte"), "is a file"),
    }
    for output, (spec, message) in cases.items():
        with pytest.raises(UserError, match=message):
            prepare_dataset(spec, output, overwrite=True)
    assert (run / "checkpoints" / "step-00000001").is_dir() and (corpus / "a.txt").is_file()
    assert (tmp_path / "file").read_text() == "kept"
    inside = PrepareSpec(inputs=[str(tmp_path / "ds" / "more.txt")], tokenizer="byte")
    prepare_dataset(PrepareSpec(inputs=[str(txt)], tokenizer="byte"), tmp_path / "ds")
    (tmp_path / "ds" / "more.txt").write_text("more text\n" * 20)
    with pytest.raises(UserError, match="holds the input"):
        prepare_dataset(inside, tmp_path / "ds", overwrite=True)
    assert (tmp_path / "ds" / "more.txt").is_file()


def test_bpe_is_trained_locally_and_round_trips_text(text_sources, tmp_path):
    txt, _ = text_sources
    result = prepare_dataset(PrepareSpec(inputs=[str(txt)], tokenizer="bpe", vocab_size=300), tmp_path / "ds")
    tokenizer = load_tokenizer(tmp_path / "ds" / "tokenizer.json")
    assert tokenizer.vocab_size == result.manifest["tokenizer"]["vocab_size"] <= 300
    text = "The quick brown fox"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text.encode()), "BPE merges bytes"


def test_embedded_corpus_prepares_offline(stdlib_dataset):
    dataset = TokenDataset(stdlib_dataset, "stdlib")
    assert dataset.num_tokens > 50_000
    assert all(entry["source"].startswith("embedded:stdlib/") for entry in dataset.manifest["source_hashes"])


def test_a_held_out_slice_of_the_embedded_corpus_shares_no_document_with_the_training_budget(stdlib_dataset, tmp_path):
    trained = {entry["source"] for entry in TokenDataset(stdlib_dataset, "trained").manifest["source_hashes"]}
    spec = PrepareSpec(
        embedded="stdlib",
        embedded_max_bytes=100_000,
        embedded_skip_bytes=400_000,
        tokenizer=str(stdlib_dataset / "tokenizer.json"),
    )
    held_out = TokenDataset(prepare_dataset(spec, tmp_path / "held-out").output, "held out")
    sources = [entry["source"] for entry in held_out.manifest["source_hashes"]]
    assert sources and not trained.intersection(sources)
    assert held_out.tokenizer["sha256"] == TokenDataset(stdlib_dataset, "trained").tokenizer["sha256"]
    with pytest.raises(UserError, match="--skip-bytes"):
        prepare_dataset(PrepareSpec(inputs=[str(stdlib_dataset)], embedded_skip_bytes=10), tmp_path / "x")


def test_windows_read_across_shard_borders(text_sources, tmp_path):
    txt, _ = text_sources
    prepare_dataset(PrepareSpec(inputs=[str(txt)], tokenizer="byte", shard_tokens=100), tmp_path / "ds")
    dataset = TokenDataset(tmp_path / "ds", "ds")
    stream = np.concatenate([dataset.window(i, 10)[:-1] for i in range(dataset.num_windows(10))])
    whole = np.concatenate([np.load(tmp_path / "ds" / s["file"]) for s in dataset.manifest["shards"]])
    assert np.array_equal(stream, whole[: len(stream)])
    assert dataset.window(9, 10)[-1] == dataset.window(10, 10)[0]


def _mix(stdlib_dataset, tmp_path, text_sources, weights=(3.0, 1.0)):
    txt, _ = text_sources
    second = tmp_path / "second"
    tokenizer = stdlib_dataset / "tokenizer.json"
    prepare_dataset(PrepareSpec(inputs=[str(txt)], tokenizer=str(tokenizer)), second)
    return DataConfig.model_validate(
        {
            "sources": [
                {"name": "code", "path": str(stdlib_dataset), "weight": weights[0]},
                {"name": "prose", "path": str(second), "weight": weights[1]},
            ],
            "seq_len": 16,
        }
    )


def test_the_order_does_not_depend_on_world_size_or_micro_batch(stdlib_dataset, tmp_path, text_sources):
    loader = MixedLoader(_mix(stdlib_dataset, tmp_path, text_sources), seed=7, global_batch=8)
    cursor = loader.advance(loader.new_cursor())
    whole = loader.global_batch_at(cursor)
    for world_size, micro_batch in [(1, 8), (1, 2), (2, 4), (4, 1), (8, 1)]:
        rows = [
            batch.inputs_BS
            for rank in range(world_size)
            for batch in loader.micro_batches(cursor, rank, world_size, micro_batch).micro
        ]
        assert np.array_equal(np.concatenate([r.numpy() for r in rows]), whole[:, :-1])


def test_the_order_is_a_function_of_seed_and_cursor(stdlib_dataset, tmp_path, text_sources):
    config = _mix(stdlib_dataset, tmp_path, text_sources)
    first = MixedLoader(config, seed=7, global_batch=8)
    cursor = first.new_cursor()
    batches = []
    for _ in range(5):
        batches.append(first.global_batch_at(cursor))
        cursor = first.advance(cursor)
    restored = DataCursor.from_dict(json.loads(json.dumps(first.advance(first.advance(first.new_cursor())).to_dict())))
    fresh = MixedLoader(config, seed=7, global_batch=8)
    assert np.array_equal(fresh.global_batch_at(restored), batches[2])
    other_seed = MixedLoader(config, seed=8, global_batch=8)
    assert not np.array_equal(other_seed.global_batch_at(other_seed.new_cursor()), batches[0])


def test_weights_set_each_sources_rows_per_step(stdlib_dataset, tmp_path, text_sources):
    loader = MixedLoader(_mix(stdlib_dataset, tmp_path, text_sources, weights=(3.0, 1.0)), seed=0, global_batch=8)
    assert loader.rows_per_source == [6, 2]
    cursor = loader.advance(loader.advance(loader.new_cursor()))
    assert cursor.consumed == {"code": 12, "prose": 4}
    assert _apportion(10, [1, 1, 1]) == [4, 3, 3]


def test_epochs_wrap_with_a_new_permutation(stdlib_dataset, tmp_path, text_sources):
    config = _mix(stdlib_dataset, tmp_path, text_sources, weights=(1.0, 1.0))
    loader = MixedLoader(config, seed=0, global_batch=8)
    prose = loader.datasets[1]
    windows = prose.num_windows(16)
    first_epoch = [loader._window_index(1, prose, i) for i in range(windows)]
    second_epoch = [loader._window_index(1, prose, windows + i) for i in range(windows)]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(windows))
    assert first_epoch != second_epoch


def test_a_mix_needs_one_tokenizer(stdlib_dataset, tmp_path, text_sources):
    txt, _ = text_sources
    prepare_dataset(PrepareSpec(inputs=[str(txt)], tokenizer="byte"), tmp_path / "bytes")
    config = DataConfig.model_validate(
        {"sources": [{"name": "a", "path": str(stdlib_dataset)}, {"name": "b", "path": str(tmp_path / "bytes")}]}
    )
    with pytest.raises(UserError, match="data.sources.1 .b. was tokenized with another tokenizer"):
        MixedLoader(config, seed=0, global_batch=4)

"""Data at pre-training scale: a sampled `ferry data verify`, a run over 10,000 shards that starts without
reading them, and a mix of sources with token and epoch budgets whose realised counts the run records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY_RUN

from ferry.cli.main import main
from ferry.config import UserError
from ferry.config.loader import apply_overrides, validate
from ferry.data import DataConfig, DataCursor, MixedLoader, TokenDataset
from ferry.data.manifest import MANIFEST_NAME
from ferry.data.synthetic import write_synthetic_dataset
from ferry.data.verification import DatasetMismatch, named_files, sampled, verify_files
from ferry.train import RunConfig, train

VOCAB = 512
SHARED_TOKENIZER = "0" * 64  # synthetic sources of one vocabulary, mixed as if tokenized alike


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _synthetic(path: Path, tokens: int, seed: int = 0, shard_tokens: int | None = None) -> Path:
    write_synthetic_dataset(path, seed, VOCAB, tokens, 1.1, shard_tokens=shard_tokens)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["tokenizer"]["sha256"] = SHARED_TOKENIZER
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> Path:
    """10,000 shards of 64 tokens: the stream of a one-shard set of 640,000 tokens, cut small."""
    return _synthetic(tmp_path_factory.mktemp("scale") / "many", 10_000 * 64, shard_tokens=64)


# --- ferry data verify --sample ------------------------------------------------------------------------------


def test_a_sample_finds_a_changed_shard_it_draws_and_names_it_with_the_seed(tmp_path, capsys):
    dataset = _synthetic(tmp_path / "set", 200 * 64, shard_tokens=64)
    entries = named_files(json.loads((dataset / MANIFEST_NAME).read_text()))
    drawn = sampled(entries, 5, seed=11)
    assert drawn == sampled(entries, 5, seed=11) != sampled(entries, 5, seed=12)
    assert sampled(entries, 0.025, seed=11) == drawn  # a fraction rounds up to the same count
    changed = dataset / drawn[2]["file"]
    _flip_a_bit(changed)  # the same size: only its digest tells
    assert main(["data", "verify", str(dataset), "--sample", "5", "--seed", "11"]) == 1
    out = capsys.readouterr().out
    assert f"{changed.name}' is not the file its manifest names" in out and "--seed 11" in out
    missed = next(seed for seed in range(100) if changed.name not in {e["file"] for e in sampled(entries, 5, seed)})
    assert main(["data", "verify", str(dataset), "--sample", "5", "--seed", str(missed)]) == 0
    assert "valid in the sample — 5 of 200 data files" in capsys.readouterr().out
    assert main(["data", "verify", str(dataset)]) == 1  # the whole check finds it whatever the seed


def test_a_drawn_seed_is_printed_and_repeats_the_sample_and_a_cut_shard_is_found_by_any(tmp_path, capsys):
    dataset = _synthetic(tmp_path / "set", 300 * 64, shard_tokens=64)
    assert main(["data", "verify", str(dataset), "--sample", "0.01"]) == 0
    line = capsys.readouterr().out
    seed = line.split("(seed ")[1].split(";")[0]
    assert f"`--sample 3 --seed {seed}` checks the same ones" in line and "every file present, of the size" in line
    assert main(["data", "verify", str(dataset), "--sample", "3", "--seed", seed]) == 0
    assert capsys.readouterr().out == line
    cut = dataset / "shard-00123.npy"
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:-2])
    assert main(["data", "verify", str(dataset), "--sample", "1"]) == 1
    assert f"shard-00123.npy' holds {size - 2} bytes, its manifest records {size}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--sample", "0"], "--sample 0"),
        (["--sample", "1.5"], "--sample 1.5"),
        (["--sample", "some"], "--sample some"),
        (["--seed", "3"], "--seed chooses the files of --sample K"),
    ],
)
def test_a_bad_sample_exits_2(argv, culprit, tmp_path, capsys):
    dataset = _synthetic(tmp_path / "set", 4 * 64, shard_tokens=64)
    assert main(["data", "verify", str(dataset), *argv]) == 2
    assert culprit in capsys.readouterr().err
    assert main(["data", "verify", str(tmp_path), "--sample", "2"]) == 2


# --- a run over 10,000 shards --------------------------------------------------------------------------------


_OPENED: list[str] | None = None  # the paths opened while a test records them (`_opened_during`)


def _record_opens(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_record_opens)  # every open of the process, by Python or numpy, raises the "open" audit event


def _opened_during(work) -> list[str]:
    global _OPENED
    _OPENED = []
    try:
        work()
        return _OPENED
    finally:
        _OPENED = None


def test_a_loader_over_10000_shards_opens_none_of_them_to_start_and_a_whole_set_read_opens_each(many_shards):
    """Counted, not timed: the loader's start reads the manifest and opens no shard (each is verified when first
    read), where a whole-set read opens every one. Before, the loader hashed and opened every shard at start: 1.6x
    the whole-set read, and at the common limit of 1,024 open files it failed."""
    config = DataConfig.model_validate({"sources": [{"name": "many", "path": str(many_shards)}], "seq_len": 32})
    manifest = json.loads((many_shards / MANIFEST_NAME).read_text())
    shards = {str(many_shards / entry["file"]) for entry in named_files(manifest)}
    assert len(shards) >= 10_000
    whole = _opened_during(lambda: verify_files(many_shards, manifest, "whole", "xxh3_128"))
    assert shards <= set(whole)
    starting = _opened_during(lambda: MixedLoader(config, seed=0, global_batch=64))
    assert not shards & set(starting), sorted(shards & set(starting))[:5]
    loader = MixedLoader(config, seed=0, global_batch=64)
    assert loader.datasets[0].verified_at == "first read" and loader.mix_record()[0]["verified_at"] == "first read"


def test_the_shards_read_as_one_stream_and_a_changed_one_is_refused_when_first_read(many_shards, tmp_path):
    whole = _synthetic(tmp_path / "whole", 10_000 * 64)
    mix = {"seq_len": 32}
    cut = MixedLoader(DataConfig.model_validate({**mix, "sources": [{"name": "s", "path": str(many_shards)}]}), 3, 16)
    one = MixedLoader(DataConfig.model_validate({**mix, "sources": [{"name": "s", "path": str(whole)}]}), 3, 16)
    cursor = cut.new_cursor()
    for _ in range(3):
        assert np.array_equal(cut.global_batch_at(cursor), one.global_batch_at(cursor))
        cursor = cut.advance(cursor)
    changed = tmp_path / "changed"
    changed.mkdir()
    for entry in named_files(json.loads((many_shards / MANIFEST_NAME).read_text())):
        (changed / entry["file"]).symlink_to(many_shards / entry["file"])
    (changed / MANIFEST_NAME).write_bytes((many_shards / MANIFEST_NAME).read_bytes())
    (changed / "shard-04000.npy").unlink()
    (changed / "shard-04000.npy").write_bytes((many_shards / "shard-04000.npy").read_bytes())
    _flip_a_bit(changed / "shard-04000.npy")
    dataset = TokenDataset(changed, "changed", upfront=False)  # starts: the manifest alone is read
    assert np.array_equal(dataset.window(0, 32), one.datasets[0].window(0, 32))
    with pytest.raises(DatasetMismatch, match=r"shard-04000\.npy' is not the file its manifest names \(xxh3_128 "):
        dataset.window(4000 * 2, 32)  # window 8000 starts in shard 4000 (64 tokens a shard, 32 a window)
    with pytest.raises(DatasetMismatch, match=r"shard-04000\.npy' is not the file"):
        TokenDataset(changed, "checked whole")  # a small set, or upfront: refused before anything else


# --- budgets ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {
        "web": _synthetic(root / "web", 64 * 32 + 1, seed=1),  # 64 windows of 32
        "code": _synthetic(root / "code", 20 * 32 + 1, seed=2),  # 20 windows
        "books": _synthetic(root / "books", 50 * 32 + 1, seed=3),  # 50 windows
    }


def _budgeted(sources: dict[str, Path], **budgets) -> DataConfig:
    weights = {"web": 2.0, "code": 1.0, "books": 1.0}
    return DataConfig.model_validate(
        {
            "seq_len": 32,
            "sources": [
                {"name": name, "path": str(path), "weight": weights[name], **budgets.get(name, {})}
                for name, path in sources.items()
            ],
        }
    )


def test_budgets_are_taken_exactly_and_their_rows_go_to_the_others(three_sources):
    config = _budgeted(three_sources, web={"tokens": 50 * 32 + 7}, code={"epochs": 2})
    loader = MixedLoader(config, seed=5, global_batch=8)
    assert loader.rows_per_source == [4, 2, 2] and loader.last_step is None  # books has no budget
    cursor, rows = loader.new_cursor(), []
    for _ in range(40):
        rows.append(loader.rows_at(cursor))
        cursor = loader.advance(cursor)
    assert all(sum(step) == 8 for step in rows)
    assert cursor.consumed == {"web": 50, "code": 40, "books": 40 * 8 - 90}
    assert rows[12] == [2, 3, 3]  # web read 48 of 50 and takes its last 2; its other 2 rows by weight
    assert rows[13] == [0, 4, 4] and rows[20] == [0, 0, 8] and rows[-1] == [0, 0, 8]
    realised = {entry["name"]: entry for entry in loader.realised(cursor)}
    assert realised["web"] == {"name": "web", "windows": 50, "tokens": 50 * 32, "epochs": round(50 / 64, 6)}
    assert realised["code"]["epochs"] == 2.0 and realised["books"]["tokens"] == 230 * 32
    record = {entry["name"]: entry for entry in loader.mix_record()}
    assert record["web"]["budget"] == {"windows": 50, "tokens": 1600, "epochs": round(50 / 64, 6)}
    assert record["code"]["budget"]["epochs"] == 2.0 and "budget" not in record["books"]
    assert MixedLoader(_budgeted(three_sources, books={"epochs": 0.58}), 0, 8).budgets[2] == 29  # not 28.99999...


def test_every_window_of_a_source_read_twice_is_read_exactly_twice(three_sources):
    loader = MixedLoader(_budgeted(three_sources, code={"epochs": 2}), seed=5, global_batch=8)
    code = loader.datasets[1]
    read = [loader._window_index(1, code, position) for position in range(loader.budgets[1])]
    assert sorted(read) == sorted(list(range(20)) * 2) and read[:20] != read[20:]


def test_a_resumed_cursor_continues_the_same_budgeted_mix(three_sources):
    config = _budgeted(three_sources, web={"tokens": 30 * 32}, code={"epochs": 1.5})
    loader = MixedLoader(config, seed=9, global_batch=8)
    cursor, batches = loader.new_cursor(), []
    for _ in range(12):
        batches.append(loader.global_batch_at(cursor))
        cursor = loader.advance(cursor)
    restored = DataCursor(step=0, consumed={name: 0 for name in loader.names})
    for _ in range(6):
        restored = loader.advance(restored)
    restored = DataCursor.from_dict(json.loads(json.dumps(restored.to_dict())))
    fresh = MixedLoader(config, seed=9, global_batch=8)
    for step in range(6, 12):
        assert np.array_equal(fresh.global_batch_at(restored), batches[step])
        restored = fresh.advance(restored)
    assert restored == cursor


def test_a_mix_of_budgets_alone_ends_where_they_are_spent(three_sources):
    config = _budgeted(three_sources, web={"epochs": 1}, code={"epochs": 1}, books={"tokens": 36 * 32})
    loader = MixedLoader(config, seed=0, global_batch=8)
    assert loader.last_step == (64 + 20 + 36) // 8
    cursor = loader.new_cursor()
    for _ in range(loader.last_step):
        cursor = loader.advance(cursor)
    assert cursor.consumed == {"web": 64, "code": 20, "books": 36}
    with pytest.raises(UserError, match="step 16 needs 8 windows, and the budgets of data.sources"):
        loader.rows_at(cursor)
    with pytest.raises(UserError, match="train.steps is 16, but the budgets .* fill 15 global batches"):
        MixedLoader(config, seed=0, global_batch=8, steps=16)


def _config_file(tmp_path: Path, sources: dict[str, Path]) -> str:
    raw = json.loads(json.dumps(TINY_RUN))
    raw["data"]["sources"] = [{"name": name, "path": str(path)} for name, path in sources.items()]
    raw["run"]["dir"] = str(tmp_path / "run")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        (["data.sources.1.tokens=-5"], "data.sources.1.tokens"),
        (["data.sources.0.epochs=0"], "data.sources.0.epochs"),
        (["data.sources.2.tokens=many"], "data.sources.2.tokens"),
        (["data.sources.1.tokens=640", "data.sources.1.epochs=2"], "sets both tokens (640) and epochs (2"),
        (["data.sources.1.tokens=31"], "data.sources.1.tokens: 31 is less than one window of data.seq_len 32"),
        (["data.sources.0.epochs=0.01"], "data.sources.0.epochs: 0.01 of 64 windows is less than one window"),
        (
            ["data.sources.0.epochs=1", "data.sources.1.epochs=1", "data.sources.2.epochs=1", "train.steps=30"],
            "train.steps is 30, but the budgets of data.sources (tokens, epochs) fill 16 global batches",
        ),
    ],
)
def test_an_invalid_budget_exits_2_naming_the_key(overrides, culprit, three_sources, tmp_path, capsys):
    assert main(["train", _config_file(tmp_path, three_sources), *overrides]) == 2
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_realised_counts_reach_run_json_and_a_resumed_run_continues_the_mix(three_sources, tmp_path):
    raw = apply_overrides(TINY_RUN, [f"run.dir={tmp_path / 'run'}", "train.steps=4"])
    raw["data"] = json.loads(_budgeted(three_sources, web={"tokens": 320}, code={"epochs": 0.5}).model_dump_json())

    def run(*overrides: str) -> dict:
        train(validate(RunConfig, apply_overrides(raw, list(overrides))))
        return json.loads((tmp_path / "run" / "run.json").read_text())

    stopped = run("train.stop_at=2")
    assert stopped["status"] == "stopped"
    assert stopped["data_realised"][0] == {"name": "web", "windows": 8, "tokens": 256, "epochs": 0.125}
    resumed = run("resume=latest")
    assert resumed["status"] == "completed"
    loader = MixedLoader(DataConfig.model_validate(raw["data"]), seed=0, global_batch=8)
    cursor = loader.new_cursor()
    for _ in range(4):
        cursor = loader.advance(cursor)
    assert cursor.consumed == {"web": 10, "code": 10, "books": 12}  # web and code spent at steps 3 and 4
    assert resumed["data_realised"] == loader.realised(cursor)
    assert resumed["data_mix"][0]["budget"] == {"windows": 10, "tokens": 320, "epochs": 0.15625}

"""A prepared dataset's files are checked against its manifest before anything reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data import PrepareSpec, TokenDataset, prepare_dataset
from ferry.data.manifest import MANIFEST_NAME
from ferry.train import train


def _flip_a_bit(path: Path) -> None:
    """One bit of the file's last byte, where a token id lies (past the .npy header)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def dataset(stdlib_dataset, tmp_path) -> Path:
    """A copy of the session's dataset, this test's to damage."""
    return Path(shutil.copytree(stdlib_dataset, tmp_path / "stdlib"))


def test_every_file_the_manifest_names_records_both_digests(dataset):
    manifest = json.loads((dataset / MANIFEST_NAME).read_text())
    for entry in [*manifest["shards"], manifest["tokenizer"]]:
        assert len(entry["sha256"]) == 64 and len(entry["xxh3_128"]) == 32


def test_a_run_refuses_a_shard_that_changed_and_reads_it_with_verify_none(dataset, tmp_path):
    from conftest import tiny_config

    _flip_a_bit(dataset / "shard-00000.npy")
    with pytest.raises(UserError, match=r"shard-00000\.npy' is not the file its manifest names \(xxh3_128 "):
        train(tiny_config(dataset, tmp_path / "refused", "train.steps=1"))
    assert not (tmp_path / "refused").exists()  # refused before the run directory was touched
    train(tiny_config(dataset, tmp_path / "unchecked", "train.steps=1", "data.verify=none"))
    mix = json.loads((tmp_path / "unchecked" / "run.json").read_text())["data_mix"]
    assert mix[0]["verified"] is None and len(mix[0]["shards"][0]["xxh3_128"]) == 32


def test_a_changed_tokenizer_is_refused_and_sha256_is_checked_when_asked(dataset):
    assert TokenDataset(dataset, "intact", verify="sha256").verified == "sha256"
    tokenizer = dataset / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")  # the same vocabulary: only its digest tells
    with pytest.raises(UserError, match=r"tokenizer\.json' is not the file .* \(sha256 "):
        TokenDataset(dataset, "changed", verify="sha256")


def test_a_dataset_from_before_xxh3_is_checked_by_its_sha256(dataset, make_config, tmp_path):
    manifest = json.loads((dataset / MANIFEST_NAME).read_text())
    for entry in [*manifest["shards"], manifest["tokenizer"]]:
        del entry["xxh3_128"]
    (dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert TokenDataset(dataset, "older").verified == "sha256"
    _flip_a_bit(dataset / "shard-00000.npy")
    with pytest.raises(UserError, match=r"\(sha256 [0-9a-f]{64}, the manifest records"):
        TokenDataset(dataset, "older")


def test_data_verify_checks_every_digest_and_names_the_changed_file(dataset, tmp_path, capsys):
    assert main(["data", "verify", str(dataset)]) == 0
    assert "every file's sha256 and xxh3_128 match" in capsys.readouterr().out
    _flip_a_bit(dataset / "shard-00000.npy")
    assert main(["data", "verify", str(dataset)]) == 1
    out = capsys.readouterr().out
    assert "ferry: invalid dataset" in out and "shard-00000.npy' is not the file its manifest names" in out
    (tmp_path / "empty").mkdir()
    assert main(["data", "verify", str(tmp_path / "empty")]) == 2
    assert "is not a prepared dataset" in capsys.readouterr().err


def test_preparing_the_same_inputs_again_rewrites_a_dataset_whose_file_changed(dataset):
    spec = PrepareSpec(embedded="stdlib", embedded_max_bytes=400_000, vocab_size=512)
    assert not prepare_dataset(spec, dataset).rebuilt  # intact: up to date
    _flip_a_bit(dataset / "shard-00000.npy")
    result = prepare_dataset(spec, dataset)
    assert result.rebuilt and result.repaired == dataset / "shard-00000.npy"
    assert TokenDataset(dataset, "rewritten").verified == "xxh3_128"

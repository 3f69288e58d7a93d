"""File digests: every manifest records sha256 and xxh3-128; a resume checks the configured one, `ckpt verify` both."""

import hashlib
import json

import pytest
import torch
import xxhash
from conftest import rewrite_manifest

from ferry.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    Layout,
    SharedVerification,
    TensorPiece,
    find_resume_point,
    save_checkpoint,
    verify_checkpoint,
)
from ferry.checkpoint.digests import RECORDED
from ferry.checkpoint.report import verify_lines
from ferry.train import Trainer


def _save(tmp_path):
    pieces = {
        "model.w": TensorPiece.whole(torch.randn(64, 32)),
        "optim.exp_avg.w": TensorPiece.whole(torch.randn(64, 32)),
    }
    meta = CheckpointMeta(1, 10, Layout(world_size=1, ep_degree=1, mode="single"), {}, {}, {}, {})
    return save_checkpoint(tmp_path, pieces, meta)


def _other_digest(value: str) -> str:
    """The same-length digest that differs in its first character."""
    return ("1" if value[0] == "0" else "0") + value[1:]


def _misstate_every(digest: str):
    def misstate(manifest):
        for record in manifest["files"].values():
            record[digest] = _other_digest(record[digest])

    return misstate


def _to_version(version: int):
    def older(manifest):
        manifest["format_version"] = version
        del manifest["manifest_sha256"]

    return older


def _to_version_1(manifest):
    _to_version(1)(manifest)
    for record in manifest["files"].values():
        del record["xxh3_128"]


def test_every_file_records_the_sha256_and_xxh3_of_its_bytes_on_disk(tmp_path):
    path = _save(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    for file, record in manifest["files"].items():
        data = (path / file).read_bytes()
        assert record == {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        }
    assert verify_lines(path)[0].endswith("every file's sha256 and xxh3_128 match")


def test_the_manifest_records_the_sha256_of_its_canonical_content(tmp_path):
    manifest = json.loads((_save(tmp_path) / "manifest.json").read_text())
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert manifest["manifest_sha256"] == hashlib.sha256(canonical).hexdigest()


@pytest.mark.parametrize(
    "where",
    ["the data cursor", "the step", "a file's digest", "a version 3 manifest without its digest"],
)
def test_an_edited_manifest_is_refused_by_verify_and_by_a_resume(make_config, tmp_path, capsys, where):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).fit()
    newest = run_dir / "checkpoints" / "step-00000004"
    path = newest / "manifest.json"
    manifest = json.loads(path.read_text())
    if where == "the data cursor":
        manifest["train_state"]["data_cursor"]["step"] += 1
    elif where == "the step":
        manifest["step"], manifest["tokens_seen"] = 3, manifest["tokens_seen"] * 3 // 4
    elif where == "a file's digest":
        record = manifest["files"]["model-rank00000-part0000.safetensors"]
        record["sha256"] = _other_digest(record["sha256"])
    else:
        del manifest["manifest_sha256"]
    path.write_text(json.dumps(manifest, indent=1))
    expected = "has no manifest_sha256" if where.startswith("a version 3") else "does not match its manifest_sha256"
    with pytest.raises(CheckpointError, match=expected):
        verify_checkpoint(newest)
    capsys.readouterr()
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", "resume=latest", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest}" in out and expected in out
    assert "step-00000002 at step 2" in out


def test_a_checkpoint_under_the_name_of_another_step_is_refused(tmp_path):
    path = _save(tmp_path)
    renamed = path.rename(tmp_path / "step-00000009")
    with pytest.raises(CheckpointError, match="holds the checkpoint of step 1, not of step 9"):
        verify_checkpoint(renamed)
    copy = renamed.rename(tmp_path / "mine")  # any other name is the user's choice, and holds what it holds
    assert verify_checkpoint(copy).step == 1


def test_a_version_1_manifest_has_only_sha256_and_is_checked_by_it(tmp_path):
    path = _save(tmp_path)
    rewrite_manifest(path, _to_version_1)
    verify_checkpoint(path)
    assert verify_lines(path)[0].endswith("every file's sha256 match")
    file = path / "model-rank00000-part0000.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        verify_checkpoint(path)


def test_a_version_1_manifest_where_only_some_files_record_xxh3_is_checked_by_sha256_throughout(tmp_path):
    path = _save(tmp_path)
    model_file = "model-rank00000-part0000.safetensors"

    def mixed(manifest):
        _to_version(1)(manifest)
        del manifest["files"]["optim-rank00000-part0000.safetensors"]["xxh3_128"]
        manifest["files"][model_file]["sha256"] = _other_digest(manifest["files"][model_file]["sha256"])

    rewrite_manifest(path, mixed)
    with pytest.raises(CheckpointError, match=f"{model_file} does not match its sha256"):
        verify_checkpoint(path)


@pytest.mark.parametrize("version", [2, 3])
def test_a_version_2_or_later_manifest_without_an_xxh3_is_refused_naming_the_file(tmp_path, version):
    path = _save(tmp_path)

    def without_xxh3(manifest):
        if version == 2:
            _to_version(2)(manifest)
        manifest["files"]["optim-rank00000-part0000.safetensors"].pop("xxh3_128")

    rewrite_manifest(path, without_xxh3)
    with pytest.raises(CheckpointError, match="optim-rank00000-part0000.safetensors has no xxh3_128"):
        verify_checkpoint(path)


@pytest.mark.parametrize("digest", RECORDED)
def test_a_resume_checks_the_digest_it_is_given_and_ckpt_verify_checks_every_one(tmp_path, digest):
    path = _save(tmp_path)
    file = "model-rank00000-part0000.safetensors"

    def misstate(manifest):
        manifest["files"][file][digest] = _other_digest(manifest["files"][file][digest])

    rewrite_manifest(path, misstate)
    other = next(name for name in RECORDED if name != digest)
    verify_checkpoint(path, digests=(other,))
    with pytest.raises(CheckpointError, match=f"{file} does not match its {digest}"):
        verify_checkpoint(path, digests=(digest,))
    with pytest.raises(CheckpointError, match=f"does not match its {digest}"):
        verify_lines(path)


def _one_rank_of_two(rank: int) -> SharedVerification:
    """A rank of a 2-rank job whose other rank finds the checkpoint valid."""
    return SharedVerification(rank, 2, lambda payload: [payload, (payload[0], ("valid", ""))][:: 1 - 2 * rank])


def test_every_route_to_a_checkpoint_checks_the_digest_it_is_given(tmp_path):
    path = _save(tmp_path / "checkpoints")
    rewrite_manifest(path, _misstate_every("sha256"))
    routes = {
        "latest": lambda digests: find_resume_point("latest", tmp_path / "checkpoints", digests=digests),
        "path": lambda digests: find_resume_point(str(path), tmp_path, digests=digests),
        "rank 0 of 2": lambda digests: verify_checkpoint(path, share=_one_rank_of_two(0), digests=digests),
        "rank 1 of 2": lambda digests: verify_checkpoint(path, share=_one_rank_of_two(1), digests=digests),
    }
    for route, open_checkpoint in routes.items():
        open_checkpoint(("xxh3_128",))
        with pytest.raises(CheckpointError, match="sha256"):
            open_checkpoint(("sha256",))
            pytest.fail(f"{route}: the sha256 was not checked")


def test_a_resume_checks_xxh3_unless_checkpoint_verify_says_sha256(make_config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    saving = ("train.steps=4", "checkpoint.interval=2")
    Trainer(make_config(*saving, run_dir=run_dir)).fit(stop_at=4)
    newest = run_dir / "checkpoints" / "step-00000004"
    rewrite_manifest(newest, _misstate_every("sha256"))
    capsys.readouterr()

    Trainer(make_config(*saving, "resume=latest", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert "skipping" not in out and "step-00000004 at step 4" in out

    rewrite_manifest(newest, _misstate_every("sha256"))  # whether or not the run saved step 4 again
    Trainer(make_config(*saving, "resume=latest", "checkpoint.verify=sha256", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest}" in out and "does not match its sha256" in out
    assert "step-00000002 at step 2" in out


def test_a_run_resumes_from_a_version_1_checkpoint(make_config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).fit(stop_at=4)
    rewrite_manifest(run_dir / "checkpoints" / "step-00000004", _to_version_1)
    capsys.readouterr()

    Trainer(make_config("train.steps=6", "checkpoint.interval=2", "resume=latest", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert "skipping" not in out and "step-00000004 at step 4" in out


def test_an_unknown_digest_name_is_refused_before_any_file_is_read(tmp_path):
    path = _save(tmp_path)
    with pytest.raises(ValueError, match=r"'xxh3-128'\]: each must be one of sha256, xxh3_128"):
        verify_checkpoint(path, digests=("xxh3-128",))

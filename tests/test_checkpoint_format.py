"""The checkpoint format on its own: pieces from several ranks, resharded reads, tiling, atomicity, no pickle."""

import hashlib
import pickle
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import REPO, rewrite_manifest

import ferry.checkpoint.writer as writer
from ferry.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    Layout,
    TensorPiece,
    begin_save,
    build_manifest,
    config_differences,
    publish,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
    write_rank_files,
)


def _meta(step: int, world_size: int = 1, ep_degree: int = 1) -> CheckpointMeta:
    layout = Layout(world_size=world_size, ep_degree=ep_degree, mode="ep" if ep_degree > 1 else "single")
    return CheckpointMeta(step, step * 10, layout, {"dim": 4}, {"model": {"dim": 4}}, {}, {"note": "test"})


def test_experts_saved_by_two_ranks_read_back_as_one_tensor_in_any_split(tmp_path):
    """How expert parallelism will save: each rank writes its experts as a piece of one global tensor."""
    experts_EFD = torch.randn(4, 3, 2)
    dense = torch.randn(5, 4, dtype=torch.bfloat16)
    step = torch.tensor(7.0)
    ranks = [
        {
            "model.experts.w_EFD": TensorPiece(experts_EFD[:2].clone(), (0, 0, 0), (4, 3, 2)),
            "model.dense.weight": TensorPiece.whole(dense),
            "optim.step.dense.weight": TensorPiece.whole(step),
        },
        {"model.experts.w_EFD": TensorPiece(experts_EFD[2:].clone(), (2, 0, 0), (4, 3, 2))},
    ]
    staging = begin_save(tmp_path, 3)
    records = [write_rank_files(staging, rank, pieces) for rank, pieces in enumerate(ranks)]
    write_manifest(staging, build_manifest(records, _meta(3, world_size=2, ep_degree=2)))
    path = publish(staging, tmp_path / "step-00000003")

    checkpoint = verify_checkpoint(path)
    assert checkpoint.manifest.layout.ep_degree == 2
    assert len(checkpoint.record("model.experts.w_EFD").pieces) == 2
    assert torch.equal(checkpoint.read("model.experts.w_EFD"), experts_EFD)
    assert torch.equal(checkpoint.read("model.dense.weight"), dense)
    assert checkpoint.read("optim.step.dense.weight").item() == 7.0
    straddling = torch.empty(2, 3, 2)
    checkpoint.read_into("model.experts.w_EFD", straddling, offset=(1, 0, 0))
    assert torch.equal(straddling, experts_EFD[1:3])
    for rank_of_four in range(4):
        mine = torch.empty(1, 3, 2)
        checkpoint.read_into("model.experts.w_EFD", mine, offset=(rank_of_four, 0, 0))
        assert torch.equal(mine[0], experts_EFD[rank_of_four])


def test_pieces_must_cover_each_tensor_exactly_once(tmp_path):
    whole = torch.zeros(4, 2)
    staging = begin_save(tmp_path, 1)
    gap = write_rank_files(staging, 0, {"model.w": TensorPiece(whole[:2], (0, 0), (4, 2))})
    with pytest.raises(ValueError, match="cover 4 of 8"):
        build_manifest([gap], _meta(1))
    overlap = write_rank_files(staging, 1, {"model.w": TensorPiece(whole[:3], (1, 0), (4, 2))})
    with pytest.raises(ValueError, match="overlap"):
        build_manifest([gap, overlap], _meta(1))


def test_a_manifest_whose_pieces_leave_a_gap_is_invalid(tmp_path):
    path = save_checkpoint(tmp_path, {"model.w": TensorPiece.whole(torch.zeros(4, 2))}, _meta(1))
    rewrite_manifest(path, lambda manifest: manifest["tensors"]["model.w"].update(shape=[5, 2]))
    with pytest.raises(CheckpointError, match="cover 8 of 10"):
        verify_checkpoint(path)


def test_a_failed_save_leaves_no_checkpoint_and_the_previous_one_intact(tmp_path, monkeypatch):
    pieces = {"model.w": TensorPiece.whole(torch.ones(3)), "optim.exp_avg.w": TensorPiece.whole(torch.ones(3))}
    save_checkpoint(tmp_path, pieces, _meta(1))

    def disk_full(path, tensors, *how):
        if "optim" in Path(path).name:
            raise OSError(28, "No space left on device")
        return write_file(path, tensors, *how)

    write_file = writer.write_tensor_file
    monkeypatch.setattr(writer, "write_tensor_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, pieces, _meta(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000002.partial", "step-00000001"]
    verify_checkpoint(tmp_path / "step-00000001")


def test_tied_weights_are_stored_under_both_names(tmp_path):
    embedding = torch.randn(6, 4)
    pieces = {name: TensorPiece.whole(embedding) for name in ("model.tok_embeddings.weight", "model.output.weight")}
    checkpoint = verify_checkpoint(save_checkpoint(tmp_path, pieces, _meta(1)))
    assert torch.equal(checkpoint.read("model.output.weight"), embedding)


class _Plant:
    """A pickle that writes a marker file the moment anything unpickles it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pickle code ran')",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Plant(control)))
    assert control.exists(), "the planted payload must really run when unpickled"

    marker = tmp_path / "marker"
    payload = pickle.dumps(_Plant(marker))
    pieces = {"model.w": TensorPiece.whole(torch.ones(3)), "optim.exp_avg.w": TensorPiece.whole(torch.ones(3))}
    extra = save_checkpoint(tmp_path / "a", pieces, _meta(1))
    (extra / "optimizer.pt").write_bytes(payload)
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        verify_checkpoint(extra)

    swapped = save_checkpoint(tmp_path / "b", pieces, _meta(1))
    (swapped / "optim-rank00000-part0000.safetensors").write_bytes(payload)
    record = {
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "xxh3_128": xxhash.xxh3_128(payload).hexdigest(),
    }
    rewrite_manifest(
        swapped, lambda manifest: manifest["files"].update({"optim-rank00000-part0000.safetensors": record})
    )
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        verify_checkpoint(swapped)
    assert not marker.exists()


def test_the_checkpoint_code_has_no_way_to_unpickle():
    for path in [*(REPO / "ferry" / "checkpoint").glob("*.py"), REPO / "ferry" / "train" / "checkpointing.py"]:
        source = path.read_text()
        for forbidden in ("import pickle", "torch.load", "allow_pickle=True", "weights_only"):
            assert forbidden not in source, f"{path.name} uses {forbidden}"


def test_config_differences_name_dotted_fields():
    saved = {"model": {"dim": 32, "moe": {"num_experts": 4}}, "data": {"sources": [{"path": "a"}]}}
    current = {"model": {"dim": 64, "moe": {"num_experts": 4}}, "data": {"sources": [{"path": "b"}]}}
    assert [str(d) for d in config_differences(saved, current)] == [
        "model.dim: checkpoint 32, this run 64",
        "data.sources.0.path: checkpoint 'a', this run 'b'",
    ]


def test_a_tensor_file_written_from_memory_is_what_safetensors_reads_and_its_digests_are_the_files(tmp_path):
    """ferry writes tensor files itself (one pass, no copy); the safetensors library reads them back as written."""
    from safetensors.torch import load_file

    from ferry.checkpoint.byte_writes import write_tensor_file
    from ferry.platform.digests import RECORDED, digest_file

    tensors = {
        "w": torch.randn(5, 3).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(9, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }
    record = write_tensor_file(tmp_path / "x.safetensors", tensors)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[name], tensors[name]) for name in tensors)
    assert record.bytes == (tmp_path / "x.safetensors").stat().st_size
    assert record.model_dump(exclude={"bytes"}) == digest_file(tmp_path / "x.safetensors", RECORDED)

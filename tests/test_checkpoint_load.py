"""How a checkpoint is read: bounded files, direct reads, and moments read while their files are hashed."""

import hashlib
import json
import os
import struct

import distributed_cases
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
    newest_valid,
    reader,
    save_checkpoint,
    verify_checkpoint,
)
from ferry.checkpoint.byte_reads import HASHED_READ_BYTES, hash_and_fill
from ferry.comm import DistContext
from ferry.comm.spawn import run_on_ranks
from ferry.model import ModelConfig, MoEConfig, Transformer
from ferry.parallel import ParallelConfig, build_plan
from ferry.parallel.optimizers import AdamWKind, adamw_recipe
from ferry.train.checkpointing import (
    optimizer_prefetch,
    optimizer_record,
    restore_model,
    restore_optimizer,
    resume_prefetch,
    train_state_pieces,
)
from ferry.train.optimizer import decayed_parameter_names


def _meta(step: int = 1, train_state: dict | None = None) -> CheckpointMeta:
    layout = Layout(world_size=1, ep_degree=1, mode="single")
    return CheckpointMeta(step, 0, layout, {}, {}, {}, train_state or {})


def _pieces() -> dict[str, TensorPiece]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.a": TensorPiece.whole(torch.randn(10, 10, generator=generator)),  # 400 bytes
        "model.b": TensorPiece.whole(torch.randn(100, generator=generator)),  # 400 bytes
        "model.c": TensorPiece.whole(torch.randn(10, 10, generator=generator)),  # 400 bytes
        "model.big": TensorPiece.whole(torch.randn(600, generator=generator)),  # 2400 bytes
        "model.half": TensorPiece.whole(torch.randn(7, generator=generator).to(torch.bfloat16)),
        "optim.exp_avg.a": TensorPiece.whole(torch.randn(10, 10, generator=generator)),
    }


def test_a_group_is_split_into_parts_of_bounded_size_that_read_back_whole(tmp_path):
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=1000)
    checkpoint = verify_checkpoint(path)
    files = {name: record.pieces[0].file for name, record in checkpoint.manifest.tensors.items()}
    assert files["model.a"] == files["model.b"] == "model-rank00000-part0000.safetensors"
    assert files["model.c"] == "model-rank00000-part0001.safetensors"
    assert files["model.big"] == "model-rank00000-part0002.safetensors"  # larger than the bound: a file alone
    assert files["model.half"] == "model-rank00000-part0003.safetensors"
    assert files["optim.exp_avg.a"] == "optim-rank00000-part0000.safetensors"
    for name, piece in pieces.items():
        assert torch.equal(checkpoint.read(name), piece.local)


def _rename_files(path, renames: dict[str, str]) -> None:
    def renamed(manifest):
        for old, new in renames.items():
            (path / old).rename(path / new)
            manifest["files"][new] = manifest["files"].pop(old)
            for record in manifest["tensors"].values():
                for piece in record["pieces"]:
                    piece["file"] = new if piece["file"] == old else piece["file"]

    rewrite_manifest(path, renamed)


def test_checkpoints_named_before_parts_still_verify_and_read(tmp_path):
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta())
    groups = ("model", "optim")
    _rename_files(path, {f"{g}-rank00000-part0000.safetensors": f"{g}-rank00000.safetensors" for g in groups})
    checkpoint = verify_checkpoint(path)
    assert torch.equal(checkpoint.read("model.big"), pieces["model.big"].local)


def test_part_and_rank_numbers_past_four_and_five_digits_verify(tmp_path):
    """A 10 GB group at checkpoint.file_mb=1 has 10,000+ parts; a job of 100,000+ ranks, six-digit ranks."""
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta())
    _rename_files(path, {"model-rank00000-part0000.safetensors": "model-rank123456-part10000.safetensors"})
    checkpoint = verify_checkpoint(path)
    assert torch.equal(checkpoint.read("model.big"), pieces["model.big"].local)


def _open_files_under(directory):
    """Files under `directory` this process holds open: counting all descriptors would also see
    unrelated ones closed by the garbage collector meanwhile."""
    opened = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            opened.append(target)
    return opened


def test_direct_reads_and_library_reads_give_the_same_tensors(tmp_path):
    """Whole pieces into plain CPU memory take `preadv`; casts and strided targets take safetensors."""
    pieces = _pieces()
    checkpoint = verify_checkpoint(save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=1000))
    direct = {name: torch.empty_like(piece.local) for name, piece in pieces.items()}
    checkpoint.read_many([(name, out, None) for name, out in direct.items()])
    assert _open_files_under(tmp_path) == []  # no checkpoint file stays open between reads
    cast = torch.empty(600, dtype=torch.float64)
    checkpoint.read_into("model.big", cast)
    strided = torch.empty(10, 10).t()
    checkpoint.read_into("model.a", strided)
    for name, piece in pieces.items():
        assert torch.equal(direct[name], piece.local)
    assert torch.equal(cast, pieces["model.big"].local.double())
    assert torch.equal(strided, pieces["model.a"].local)
    assert len(checkpoint._files) == 5  # the direct path really ran, once per file


def test_prefetch_fills_only_tensors_that_fit_and_hands_them_out_after_verification(tmp_path):
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=1000)
    asked = {
        "model.b": torch.empty(100),
        "optim.exp_avg.a": torch.empty(10, 10),
        "model.c": torch.empty(100),  # wrong shape
        "model.half": torch.empty(7),  # wrong dtype
        "model.nothing": torch.empty(3),  # not in the checkpoint
    }
    checkpoint = verify_checkpoint(path, lambda manifest: asked)
    assert checkpoint.prefetched("model.b") is asked["model.b"]
    assert checkpoint.prefetched("optim.exp_avg.a") is asked["optim.exp_avg.a"]
    assert torch.equal(asked["model.b"], pieces["model.b"].local)
    assert torch.equal(asked["optim.exp_avg.a"], pieces["optim.exp_avg.a"].local)
    for name in ("model.c", "model.half", "model.nothing", "model.a"):
        assert checkpoint.prefetched(name) is None


@pytest.mark.parametrize("digest", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("victim", ["model.a", "model.b"])
def test_a_corrupt_byte_fails_verification_with_a_prefetch_whether_or_not_it_was_prefetched(tmp_path, victim, digest):
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=1000)
    file = path / "model-rank00000-part0000.safetensors"
    data = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length + json.loads(data[8 : 8 + length])[victim]["data_offsets"][0]
    data[start + 5] ^= 0x40
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"does not match its {digest}"):
        verify_checkpoint(path, lambda manifest: {"model.b": torch.empty(100)}, digests=(digest,))


def _safetensors_file(path, header: dict, payload: bytes):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + payload)


def test_hash_and_fill_gives_the_file_digests_and_refuses_ranges_that_skip_or_repeat_bytes(tmp_path):
    good = tmp_path / "good.safetensors"
    values = torch.arange(6, dtype=torch.float32)
    header = {
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    _safetensors_file(good, header, values.numpy().tobytes())
    target = torch.empty(4)
    assert hash_and_fill(good, {"y": target}, ("sha256", "xxh3_128")) == {
        "sha256": hashlib.sha256(good.read_bytes()).hexdigest(),
        "xxh3_128": xxhash.xxh3_128(good.read_bytes()).hexdigest(),
    }
    assert torch.equal(target, values[2:])

    overlapping = tmp_path / "overlapping.safetensors"
    header["y"]["data_offsets"] = [4, 20]
    _safetensors_file(overlapping, header, values.numpy().tobytes())
    with pytest.raises(CheckpointError, match="not possible"):
        hash_and_fill(overlapping, {"x": torch.empty(2), "y": torch.empty(4)}, ("xxh3_128",))

    large = tmp_path / "large.safetensors"  # a tensor read and hashed in pieces: 2.5 of them
    pieces = torch.arange(5 * HASHED_READ_BYTES // 8, dtype=torch.float32)
    header_large = {"z": {"dtype": "F32", "shape": [pieces.numel()], "data_offsets": [0, pieces.nbytes]}}
    _safetensors_file(large, header_large, pieces.numpy().tobytes())
    filled = torch.empty_like(pieces)
    expected = xxhash.xxh3_128(large.read_bytes()).hexdigest()
    assert hash_and_fill(large, {"z": filled}, ("xxh3_128",)) == {"xxh3_128": expected}
    assert torch.equal(filled, pieces)

    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        hash_and_fill(huge, {"x": torch.empty(2)}, ("xxh3_128",))


def _trained_and_saved(tmp_path):
    """A tiny MoE after one optimizer step, saved, then its weights zeroed: (model, plan, a fresh optimizer's
    maker, the optimizer that stepped, the weights as saved, the checkpoint)."""
    model_config = ModelConfig(
        vocab_size=64,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        max_seq_len=8,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8),
    )
    torch.manual_seed(0)
    model = Transformer(model_config)
    plan = build_plan(ParallelConfig(), DistContext(rank=0, world_size=1, local_rank=0, backend=None), model, "cpu")

    def fresh():
        return plan.build_optimizer(adamw_recipe(decayed_parameter_names(model), 0.1, lr=1e-2))

    optimizer = fresh()
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    pieces = train_state_pieces(model, optimizer, plan, torch.device("cpu"))
    path = save_checkpoint(
        tmp_path, pieces, _meta(train_state={"optimizer": optimizer_record(model, optimizer, AdamWKind())})
    )
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model, plan, fresh, optimizer, saved, path


def test_a_resume_adopts_the_prefetched_moments_and_restores_exactly(tmp_path):
    model, plan, fresh, optimizer, saved, path = _trained_and_saved(tmp_path)
    resumed = fresh()
    with verify_checkpoint(path, optimizer_prefetch(model, resumed, plan)) as checkpoint:
        restore_model(checkpoint, model, plan)
        restore_optimizer(checkpoint, model, resumed, plan, AdamWKind())
        names = {param: name for name, param in model.named_parameters()}
        adopted = 0
        for param, state in resumed.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                prefetched = checkpoint.prefetched(f"optim.{key}.{names[param]}")
                assert prefetched is not None
                adopted += state[key] is prefetched
    assert adopted == 2 * len(resumed.state) > 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(resumed.state[param][key], value)


def _shared(rank: int, heard: list, other=lambda subject, details: (subject, ("valid", ""))):
    """A SharedVerification for `rank` of 2; `other` makes the other rank's payload from this rank's."""

    def agree(payload):
        heard.append(payload)
        theirs = other(*payload)
        return [payload, theirs] if rank == 0 else [theirs, payload]

    return SharedVerification(rank, 2, agree)


def test_ranks_split_the_hashing_and_agree_on_the_verdict(tmp_path):
    pieces = _pieces()
    path = save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=1000)
    of_rank_1 = _second_largest(path)  # largest first, dealt in turn: the second-largest file is rank 1's to hash
    data = bytearray((path / of_rank_1).read_bytes())
    data[-1] ^= 0x01
    (path / of_rank_1).write_bytes(bytes(data))
    heard = []
    verify_checkpoint(path, share=_shared(0, heard))  # rank 0 does not hash rank 1's file
    assert heard == [(("verify", str(path)), ("valid", ""))]
    with pytest.raises(CheckpointError, match=rf"{of_rank_1} does not match its xxh3_128"):
        verify_checkpoint(path, share=_shared(1, heard))
    (_, (kind, message)) = heard[-1]  # rank 1 told the others before raising
    assert kind == "invalid" and "does not match its xxh3_128" in message
    with pytest.raises(CheckpointError, match=r"found by rank 1"):
        verify_checkpoint(path, share=_shared(0, heard, other=lambda subject, _: (subject, ("invalid", message))))


def test_an_unexpected_failure_on_one_rank_stops_every_rank_at_the_same_exchange(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, _pieces(), _meta(step))
    heard = []
    with monkeypatch.context() as patch:
        patch.setattr(reader, "hash_and_fill", lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            newest_valid(tmp_path, share=_shared(0, heard))
    assert [subject[0] for subject, _ in heard] == ["list", "verify"] and heard[-1][1][0] == "defect"
    heard.clear()

    def defect_elsewhere(subject, details):
        return subject, ("defect", "ZeroDivisionError") if subject[0] == "verify" else details

    with pytest.raises(RuntimeError, match="rank 1 failed verifying"):  # not a CheckpointError: no older one is tried
        newest_valid(tmp_path, share=_shared(0, heard, other=defect_elsewhere))
    assert len(heard) == 2


def test_ranks_that_see_different_checkpoints_all_stop_at_the_first_exchange(tmp_path):
    save_checkpoint(tmp_path, _pieces(), _meta(1))
    heard = []

    def sees_another(subject, details):
        return ("list", subject[1], "step-00000002", "step-00000001"), details

    with pytest.raises(RuntimeError, match="disagree on the checkpoints"):
        newest_valid(tmp_path, share=_shared(0, heard, other=sees_another))
    assert len(heard) == 1


def _second_largest(path) -> str:
    files = json.loads((path / "manifest.json").read_text())["files"]
    return sorted(files, key=lambda file: (-files[file]["bytes"], file))[1]


def test_two_ranks_skip_a_checkpoint_only_one_of_them_finds_corrupt(tmp_path):
    pieces = _pieces()
    for step in (1, 2):
        save_checkpoint(tmp_path, pieces, _meta(step), max_file_bytes=1000)
    newest = tmp_path / "step-00000002"
    victim = newest / _second_largest(newest)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    results = run_on_ranks(distributed_cases.resume_point_with_shared_verification, 2, str(tmp_path))
    for step, skipped in results:
        assert step == 1
        assert len(skipped) == 1 and victim.name in skipped[0]
    assert "found by rank 1" in results[0][1][0] and "found by rank" not in results[1][1][0]


def test_a_resume_reads_the_models_weights_in_place_while_it_verifies(tmp_path):
    """With `resume_prefetch`, checking the files fills the live weights (and the moments): every byte is read
    from the disk once, and `restore_model` has nothing left to read for the weights held whole here."""
    model, plan, fresh, optimizer, saved, path = _trained_and_saved(tmp_path)
    resumed = fresh()
    live = model.state_dict()
    with verify_checkpoint(path, resume_prefetch(model, resumed, plan)) as checkpoint:
        for name, value in live.items():
            assert checkpoint.prefetched(f"model.{name}").data_ptr() == value.data_ptr(), name
            assert torch.equal(value, saved[name]), name  # filled by the verification alone
        marker = live["norm.weight"]
        marker.add_(1.0)  # restore_model reads no weight again: the mark stays
        restore_model(checkpoint, model, plan)
        restore_optimizer(checkpoint, model, resumed, plan, AdamWKind())
        assert torch.equal(marker, saved["norm.weight"] + 1.0)
        marker.sub_(1.0)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(resumed.state[param][key], value)

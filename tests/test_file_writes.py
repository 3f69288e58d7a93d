"""Files written past the page cache (`ferry.platform.file_writes`): the same bytes and digests as through it, at
every length around the block and the piece, and every refusal or failure of the storage surfaced, never hidden."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os

import pytest
import torch

import ferry.platform.file_writes as file_writes
from ferry.checkpoint import CheckpointMeta, Layout, TensorPiece, save_checkpoint
from ferry.platform.digests import RECORDED, Digests
from ferry.platform.file_writes import HashedFileWriter

PIECE = 16 << 10  # a small piece, so that many pieces and a padded last one are cheap to write


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(file_writes, "PIECE_BYTES", PIECE)


def _write(path, chunks, direct=True):
    """The file written; whether it went past the page cache, by the writer's word and by its descriptor's flags
    before the fsync; its size; its digests."""
    digests = Digests(RECORDED)
    with HashedFileWriter(path, digests, direct) as out:
        for chunk in chunks:
            out.write(chunk)
        flagged = bool(fcntl.fcntl(out._descriptor, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        size = out.finish()
    assert out.direct == flagged
    return out.direct, size, digests.hexdigests()


def _chunks(total: int, seed: int) -> list[bytes]:
    """`total` random bytes in chunks of uneven sizes, some larger than a piece."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    cuts = sorted(torch.randint(0, total + 1, (5,), generator=generator).tolist()) if total else []
    return [data[start:end] for start, end in zip([0, *cuts], [*cuts, total])]


@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 4097, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345])
def test_past_the_page_cache_the_file_and_its_digests_are_those_written_through_it(tmp_path, total):
    chunks = _chunks(total, seed=total)
    direct, direct_size, direct_digests = _write(tmp_path / "direct", chunks)
    cached, cached_size, cached_digests = _write(tmp_path / "cached", chunks, direct=False)
    expected = b"".join(chunks)
    assert not cached
    assert direct == hasattr(os, "O_DIRECT")  # this suite's filesystem takes O_DIRECT where the OS has it
    for name in ("direct", "cached"):
        assert (tmp_path / name).read_bytes() == expected
    assert direct_size == cached_size == len(expected)
    assert direct_digests == cached_digests
    assert direct_digests["sha256"] == hashlib.sha256(expected).hexdigest()


def test_a_filesystem_that_refuses_direct_writes_at_open_is_written_through_the_page_cache(tmp_path, monkeypatch):
    opened = os.open

    def no_direct(path, flags, *mode):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return opened(path, flags, *mode)

    monkeypatch.setattr(file_writes.os, "open", no_direct)
    chunks = _chunks(2 * PIECE + 7, seed=1)
    direct, size, _ = _write(tmp_path / "file", chunks)
    assert not direct
    assert (tmp_path / "file").read_bytes() == b"".join(chunks) and size == 2 * PIECE + 7


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is a Linux flag")
def test_a_filesystem_that_refuses_the_first_direct_write_gets_the_file_through_the_page_cache(tmp_path, monkeypatch):
    written = os.pwrite

    def refuse_direct(descriptor, data, offset):
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return written(descriptor, data, offset)

    monkeypatch.setattr(file_writes.os, "pwrite", refuse_direct)
    chunks = _chunks(3 * PIECE + 5, seed=2)
    direct, size, digests = _write(tmp_path / "file", chunks)
    assert not direct
    assert (tmp_path / "file").read_bytes() == b"".join(chunks) and size == 3 * PIECE + 5
    assert digests["sha256"] == hashlib.sha256(b"".join(chunks)).hexdigest()


@pytest.mark.parametrize("direct", [True, False])
def test_a_write_the_storage_refuses_mid_file_raises_its_error_and_closes_the_file(tmp_path, monkeypatch, direct):
    written = file_writes._write_all

    def full_after_one_piece(descriptor, data, offset):
        if offset >= PIECE:
            raise OSError(errno.ENOSPC, "No space left on device")
        written(descriptor, data, offset)

    monkeypatch.setattr(file_writes, "_write_all", full_after_one_piece)
    with pytest.raises(OSError) as raised:
        _write(tmp_path / "file", _chunks(4 * PIECE, seed=3), direct)
    assert raised.value.errno == errno.ENOSPC
    assert not [name for name in os.listdir(f"/proc/{os.getpid()}/fd") if _points_at(name, tmp_path / "file")]


def _points_at(descriptor: str, path) -> bool:
    try:
        return os.readlink(f"/proc/{os.getpid()}/fd/{descriptor}") == str(path)
    except OSError:
        return False


def test_a_checkpoint_saved_past_the_page_cache_is_the_one_saved_through_it(tmp_path):
    torch.manual_seed(0)
    pieces = {
        "model.w": TensorPiece.whole(torch.randn(300, 70)),
        "model.b": TensorPiece.whole(torch.randn(3).to(torch.bfloat16)),
        "optim.exp_avg.w": TensorPiece.whole(torch.randn(300, 70)),
    }
    meta = CheckpointMeta(
        step=1,
        tokens_seen=0,
        layout=Layout(world_size=1, ep_degree=1, mode="single"),
        model_config={},
        run_config={},
        environment={},
        train_state={},
    )
    direct = save_checkpoint(tmp_path / "direct", pieces, meta, direct=True)
    cached = save_checkpoint(tmp_path / "cached", pieces, meta, direct=False)
    files = sorted(path.name for path in direct.iterdir() if path.suffix == ".safetensors")
    assert files == sorted(path.name for path in cached.iterdir() if path.suffix == ".safetensors")
    assert len(files) == 2
    for name in files:
        assert (direct / name).read_bytes() == (cached / name).read_bytes()

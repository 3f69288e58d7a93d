"""A rank writes and hashes its checkpoint files on its share of the host's cores, not on all of them."""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ferry.checkpoint import CheckpointMeta, Layout, reader, save_checkpoint, verify_checkpoint, writer
from ferry.checkpoint.format import TensorPiece
from ferry.platform import io_threads as io


@pytest.fixture
def host(monkeypatch):
    """A host of `cores` usable cores running `ranks` ranks of one job."""

    def make(cores: int, ranks: int | None) -> None:
        monkeypatch.setattr(io, "usable_cores", lambda: cores)
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))

    return make


@pytest.mark.parametrize(
    ("cores", "ranks", "tasks", "threads"),
    [
        (96, 8, 100, 12),  # each of 8 ranks an eighth of the node
        (96, None, 100, 96),  # one process: every core
        (96, 8, 5, 5),  # no more threads than files
        (2, 2, 10, 2),  # never fewer than two
        (16, 64, 10, 2),
        (16, 8, 1, 1),
        (16, 8, 0, 1),
    ],
)
def test_a_rank_takes_its_share_of_the_cores(host, cores, ranks, tasks, threads):
    host(cores, ranks)
    assert io.io_threads(tasks) == threads


def test_a_launcher_count_that_is_no_number_counts_as_one_rank(host, monkeypatch):
    host(24, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert io.io_threads(100) == 24


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity masks are Linux's")
def test_usable_cores_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(io.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert io.usable_cores() == 3


def test_the_writer_uses_the_share_and_no_more(host, monkeypatch, tmp_path):
    """Ten files on a 64-core host with 16 ranks: four writer threads, each file written once."""
    host(64, 16)
    seen: dict[str, str] = {}
    lock = threading.Lock()
    all_busy = four_at_once()

    def held_write(path, tensors, direct):
        with lock:
            seen[path.name] = threading.current_thread().name
        all_busy()
        return writer.FileRecord(bytes=1, sha256="0" * 64, xxh3_128="0" * 32)

    monkeypatch.setattr(writer, "_write_file", held_write)
    sizes = pool_sizes(monkeypatch, writer)
    pieces = {f"model.w{i}": TensorPiece.whole(torch.ones(4)) for i in range(10)}
    record = writer.write_rank_files(tmp_path, 0, pieces, max_file_bytes=16)
    assert len(record.files) == 10 and set(seen) == set(record.files)
    threads = set(seen.values())
    assert sizes == [4] and len(threads) == 4  # a pool of four, its four threads writing at once
    assert all(name.startswith(writer.WRITER_THREADS) for name in threads)


def test_a_verification_hashes_on_the_share_and_no_more(host, monkeypatch, tmp_path):
    """A checkpoint of ten files, verified by a rank of 16 on a 64-core host: four hashing threads."""
    pieces = {f"model.w{i}": TensorPiece.whole(torch.full((4,), float(i))) for i in range(10)}
    save_checkpoint(tmp_path, pieces, _meta(), max_file_bytes=16)
    host(64, 16)
    seen: set[str] = set()
    lock = threading.Lock()
    real = reader.hash_and_fill
    all_busy = four_at_once()

    def held_hash(path, targets, names):
        with lock:
            seen.add(threading.current_thread().name)
        all_busy()
        return real(path, targets, names)

    monkeypatch.setattr(reader, "hash_and_fill", held_hash)
    sizes = pool_sizes(monkeypatch, reader)
    with verify_checkpoint(tmp_path / "step-00000001") as checkpoint:
        assert torch.equal(checkpoint.read("model.w7"), torch.full((4,), 7.0))
    assert sizes and max(sizes) == 4 and len(seen) == 4  # no pool above the share, four threads hashing at once


def pool_sizes(monkeypatch, module) -> list[int]:
    """The threads each pool `module` makes asks for, in order."""
    sizes: list[int] = []

    class Recorded(ThreadPoolExecutor):
        def __init__(self, max_workers=None, *args, **kwargs):
            sizes.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(module, "ThreadPoolExecutor", Recorded)
    return sizes


def four_at_once():
    """A wait for the first four tasks to run at once: none of them returns until four threads hold one, so a
    pool of fewer threads fails (the barrier breaks) and one of more gives a fifth task to a fifth thread while
    they wait; the later tasks pass."""
    barrier = threading.Barrier(4)
    calls = itertools.count()

    def wait() -> None:
        if next(calls) < 4:
            barrier.wait(timeout=60)  # a guard against a hang: four threads meet at once or never

    return wait


def _meta() -> CheckpointMeta:
    return CheckpointMeta(
        step=1,
        tokens_seen=0,
        layout=Layout(world_size=1, ep_degree=1, mode="single"),
        model_config={},
        run_config={},
        environment={},
        train_state={},
    )

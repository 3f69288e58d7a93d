"""Checkpoint I/O against the disk it runs on: a ~1 GB train state vs raw numpy I/O of the same bytes.

    python benchmarks/checkpoint_io.py [--dir DIR] [--repeats 3]

The train state is a real MoE model (84M parameters) with its AdamW moments after one
step: 1.0 GB of tensors. Save is `save_checkpoint` (safetensors files written past the page
cache, fsync, sha256 and xxh3-128, manifest, rename); `save_page_cache` is the same save through
the page cache (`checkpoint.direct_io: false`), measured after the reads in pairs with a raw
write of its own. Load is what a resume does (check every file's digest, by default xxh3-128,
reading the live model's weights and a fresh optimizer's moments, which it allocates afresh as
`np.fromfile` does its arrays, in place as each file hashes: `resume_prefetch`).
`load_sha256` is the same load checking sha256 instead (`checkpoint.verify: sha256`). The
baseline writes the same tensors' bytes to one file with `ndarray.tofile` and an fsync, and
reads them back with `np.fromfile`.

Each round writes both sides' files (both fsync), evicts them from the page cache
(`posix_fadvise(DONTNEED)` on each file: no root needed, unlike dropping the whole cache), then
reads them cold, as a restart after a failure does: one side first, then, once the first one's
pages are evicted too, the other. The sides take turns going first, `--repeats` rounds each, the
side read first having been written first, and `load_ratio` compares the two first reads. On a
virtual machine both orders matter: the read that comes second ran up to twice as slow as the
same read first (whichever side it was; the raw read most, whose fresh arrays `np.fromfile`
advises into huge pages), and files written last were sometimes read at half speed (their
host's writeback still going on), so a fixed order measured the order as much as the load.
The second reads give `load_ratio_second`. The same reads are then repeated
with the files cached (`*_cached`): there the baseline is a memory copy, and the load's digest
of every byte weighs more.

The last line printed is one JSON object with the medians: save_gbps, load_gbps,
raw_write_gbps, raw_read_gbps, save_ratio (and save_ratio_page_cache), load_ratio (and
load_ratio_second), the share of the load spent verifying (the digest of every file), the sha256
load, and the cached figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from scratch import DIR_HELP, scratch_dir

from ferry.checkpoint import CheckpointMeta, Layout, save_checkpoint, verify_checkpoint
from ferry.checkpoint.digests import FAST
from ferry.comm import DistContext
from ferry.model import ModelConfig, MoEConfig, Transformer
from ferry.parallel import ParallelConfig, build_plan
from ferry.parallel.optimizers import AdamWKind, adamw_recipe
from ferry.train.checkpointing import (
    optimizer_record,
    restore_model,
    restore_optimizer,
    resume_prefetch,
    train_state_pieces,
)
from ferry.train.optimizer import decayed_parameter_names

CPU = torch.device("cpu")

# 84M parameters: with both AdamW moments, 1.0 GB of float32 tensors.
MODEL = ModelConfig(
    vocab_size=16384,
    dim=1024,
    n_layers=3,
    n_heads=8,
    n_kv_heads=8,
    max_seq_len=256,
    moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=512),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help=DIR_HELP)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with scratch_dir(args.dir, "checkpoint-io-") as work:
        figures = run(work, args.repeats)
    print(json.dumps(figures))


def run(work: Path, repeats: int) -> dict:
    torch.manual_seed(0)
    model = Transformer(MODEL)
    plan = build_plan(ParallelConfig(), DistContext(rank=0, world_size=1, local_rank=0, backend=None), model, CPU)

    def fresh():
        """An optimizer without state, as a resuming process has before it loads."""
        return plan.build_optimizer(adamw_recipe(decayed_parameter_names(model), 0.1, lr=3e-3))

    optimizer = fresh()
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    pieces = train_state_pieces(model, optimizer, plan, CPU)
    arrays = [piece.local.numpy() for piece in pieces.values()]
    nbytes = sum(array.nbytes for array in arrays)
    meta = CheckpointMeta(
        step=1,
        tokens_seen=0,
        layout=Layout(world_size=1, ep_degree=1, mode="single"),
        model_config=MODEL.model_dump(mode="json"),
        run_config={},
        environment={},
        train_state={"optimizer": optimizer_record(model, optimizer, AdamWKind())},
    )
    print(f"train state: {len(pieces)} tensors, {nbytes / 1e9:.3f} GB, in {work}")

    timings: dict[str, list[float]] = {
        "raw_write": [],
        "save": [],
        "raw_read": [],
        "load": [],
        "raw_read_second": [],
        "load_second": [],
        "load_sha256": [],
        "raw_read_cached": [],
        "load_cached": [],
        "raw_write_page_cache": [],
        "save_page_cache": [],
    }
    verify_s: list[float] = []
    for round_ in range(2 * repeats):  # `repeats` rounds in each order
        raw = work / "raw.bin"
        root = work / "checkpoints"
        checkpoint = root / "step-00000001"
        writes = [
            ("raw_write", lambda: _raw_write(raw, arrays)),
            ("save", lambda: save_checkpoint(root, pieces, meta)),
        ]
        raw_first = round_ % 2 == 0
        for name, write in writes if raw_first else writes[::-1]:  # the side read first was written first
            timings[name].append(_timed(write))
        _evict([raw, *checkpoint.iterdir()])
        reads = [
            ("raw_read", lambda first: _raw_read(raw, arrays), [raw]),
            (
                "load",
                lambda first: _load(checkpoint, model, fresh(), plan, verify_s if first else []),
                list(checkpoint.iterdir()),
            ),
        ]
        order = reads if raw_first else reads[::-1]
        for position, (name, read, files) in enumerate(order):
            first = position == 0
            timings[name if first else f"{name}_second"].append(_timed(lambda: read(first)))
            _evict(files)  # the read after it starts as the 1 GB this one cached is released
        timings["load_sha256"].append(_timed(lambda: _load(checkpoint, model, fresh(), plan, [], "sha256")))
        _raw_read(raw, arrays)
        timings["raw_read_cached"].append(_timed(lambda: _raw_read(raw, arrays)))
        timings["load_cached"].append(_timed(lambda: _load(checkpoint, model, fresh(), plan, [])))
        shown = ("raw_write", "save", order[0][0], f"{order[1][0]}_second", "load_sha256", "load_cached")
        figures = "  ".join(f"{name} {nbytes / timings[name][-1] / 1e9:.3f} GB/s" for name in shown)
        print(f"{order[0][0]} first: {figures}")
        raw.unlink()
        shutil.rmtree(root)
    for _ in range(repeats):  # after the reads, so that the main loop's memory is what a save alone leaves
        timings["raw_write_page_cache"].append(_timed(lambda: _raw_write(raw, arrays)))
        timings["save_page_cache"].append(_timed(lambda: save_checkpoint(root, pieces, meta, direct=False)))
        raw.unlink()
        shutil.rmtree(root)
    gbps = {name: nbytes / statistics.median(values) / 1e9 for name, values in timings.items()}
    return {
        "bytes": nbytes,
        "repeats": repeats,
        "save_gbps": round(gbps["save"], 3),
        "load_gbps": round(gbps["load"], 3),
        "raw_write_gbps": round(gbps["raw_write"], 3),
        "raw_read_gbps": round(gbps["raw_read"], 3),
        "save_ratio": round(gbps["save"] / gbps["raw_write"], 3),
        "save_ratio_page_cache": round(gbps["save_page_cache"] / gbps["raw_write_page_cache"], 3),
        "load_ratio": round(gbps["load"] / gbps["raw_read"], 3),
        "load_ratio_second": round(gbps["load_second"] / gbps["raw_read_second"], 3),
        "load_verify_share": round(statistics.median(verify_s) / statistics.median(timings["load"]), 3),
        "load_gbps_sha256": round(gbps["load_sha256"], 3),
        "load_ratio_sha256": round(gbps["load_sha256"] / gbps["raw_read"], 3),
        "load_gbps_cached": round(gbps["load_cached"], 3),
        "raw_read_gbps_cached": round(gbps["raw_read_cached"], 3),
        "load_ratio_cached": round(gbps["load_cached"] / gbps["raw_read_cached"], 3),
    }


def _raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as handle:
        for array in arrays:
            array.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _raw_read(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "rb") as handle:
        for array in arrays:
            np.fromfile(handle, dtype=array.dtype, count=array.size)


def _load(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan, split: list[float], digest: str = FAST
) -> None:
    """Verify by `digest`, then restore into `model` and the stateless `optimizer`, as a resume does; appends
    the verification time (which includes reading the moments into the fresh optimizer state) to `split`."""
    started = time.perf_counter()
    with verify_checkpoint(path, resume_prefetch(model, optimizer, plan), digests=(digest,)) as checkpoint:
        split.append(time.perf_counter() - started)
        restore_model(checkpoint, model, plan)
        restore_optimizer(checkpoint, model, optimizer, plan, AdamWKind())


def _evict(paths: list[Path]) -> None:
    """Drop these (fsynced, hence clean) files from the page cache so the next read goes to the disk."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()

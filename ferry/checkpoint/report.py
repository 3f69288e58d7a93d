"""Human-readable summaries of a checkpoint, for `ferry ckpt inspect` and `ferry ckpt verify`."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ferry.checkpoint.digests import RECORDED
from ferry.checkpoint.format import Manifest, TensorRecord, optimizer_kind
from ferry.checkpoint.reader import read_manifest, recorded_digests, verify_checkpoint


def inspect_lines(path: Path) -> list[str]:
    """Step, layout, provenance, files, and every tensor with dtype, shape, size and piece count.

    Reads the manifest only; `verify_lines` is the one that checks the bytes.
    """
    manifest = read_manifest(Path(path))
    layout = manifest.layout
    environment = manifest.environment
    lines = [
        f"checkpoint {path}",
        f"  format      {manifest.format} v{manifest.format_version}, saved {manifest.created_at}",
        f"  step        {manifest.step:,} ({manifest.tokens_seen:,} tokens seen)",
        f"  layout      {layout.describe()}",
        f"  saved on    {environment.get('device_type')} ({environment.get('device_name')}), "
        f"torch {environment.get('torch')}, ferry {environment.get('code', {}).get('ferry')}",
        *_optimizer_line(manifest),
        f"  files       {len(manifest.files)}, {_size(sum(f.bytes for f in manifest.files.values()))}",
    ]
    file_width = max((len(name) for name in manifest.files), default=0)
    for name, record in manifest.files.items():
        lines.append(f"    {name:<{file_width}}  {_size(record.bytes):>10}  sha256 {record.sha256[:16]}")
    lines.append(f"  tensors     {len(manifest.tensors)}, {_size(_tensor_bytes(manifest))}")
    width = max((len(name) for name in manifest.tensors), default=0)
    for name, record in manifest.tensors.items():
        shape = "[" + ", ".join(str(n) for n in record.shape) + "]"
        size = _size(_nbytes(record))
        pieces = f"  in {len(record.pieces)} pieces" if len(record.pieces) > 1 else ""
        lines.append(f"    {name:<{width}}  {record.dtype:<8}  {shape:<18}  {size:>10}{pieces}")
    return lines


def _optimizer_line(manifest: Manifest) -> list[str]:
    """Which optimizer's state the checkpoint holds and for how many parameters (none for weights alone)."""
    kind = optimizer_kind(manifest.train_state)
    if kind is None:
        return []
    states: dict[str, int] = {}
    for name in manifest.tensors:
        if name.startswith("optim."):
            key = name.removeprefix("optim.").partition(".")[0]
            states[key] = states.get(key, 0) + 1
    held = ", ".join(f"{key} of {count} parameters" for key, count in states.items())
    return [f"  optimizer   {kind}: {held or 'no state saved'}"]


def verify_lines(path: Path) -> list[str]:
    """One line saying the checkpoint is valid; raises `CheckpointError` with the reason when it is not.

    Every digest the manifest records is checked, not only the one a resume checks.
    """
    checkpoint = verify_checkpoint(Path(path), digests=RECORDED)
    checked = recorded_digests(checkpoint.manifest, RECORDED)
    manifest = checkpoint.manifest
    total = sum(record.bytes for record in manifest.files.values())
    return [
        f"ferry: checkpoint {path} is valid — step {manifest.step:,}, {len(manifest.tensors)} tensors "
        f"in {len(manifest.files)} files ({_size(total)}), every file's {' and '.join(checked)} match"
    ]


def _tensor_bytes(manifest: Manifest) -> int:
    return sum(_nbytes(record) for record in manifest.tensors.values())


def _nbytes(record: TensorRecord) -> int:
    return math.prod(record.shape) * getattr(torch, record.dtype).itemsize


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"

"""Reading a checkpoint: verify everything before trusting anything, then read any box of a tensor.

Nothing here unpickles. Tensors come from safetensors files (a JSON header and raw
bytes, parsed by the safetensors library, never executed) and the rest from JSON.
A file in the directory that the manifest does not list (say a planted `.pt`) makes
the checkpoint invalid rather than being looked at.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ferry.checkpoint.byte_reads import TensorFile, hash_and_fill, is_plain_cpu
from ferry.checkpoint.config import RUN_CHECKPOINTS
from ferry.checkpoint.digests import DIGESTS, FAST
from ferry.checkpoint.format import (
    MANIFEST_NAME,
    SAFETENSORS_DTYPES,
    CheckpointError,
    Manifest,
    TensorRecord,
    parse_step,
)
from ferry.config.errors import UserError
from ferry.platform.io_threads import io_threads

# Given a checkpoint's manifest, fresh CPU tensors (by logical name) that the verification fills with
# whole stored tensors as it hashes their files, so that those bytes are read once, not twice.
Prefetch = Callable[[Manifest], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class SharedVerification:
    """How the ranks of a job split a checkpoint's verification instead of each hashing every file.

    This rank hashes every `world_size`-th file (largest first); `agree` exchanges a
    payload with every other rank (an all-gather: each rank gets every rank's payload),
    first the list of checkpoints each rank sees, then each rank's verdict on the
    checkpoint looked at, so that all ranks accept or refuse the same one. Every payload
    names what it is about, so ranks that disagree (they see other checkpoints, or one
    failed unexpectedly) all stop with the same error at the same exchange: none is left
    waiting at an exchange the others never reach.
    """

    rank: int
    world_size: int
    agree: Callable[[tuple], list[tuple]]

    def same_everywhere(self, subject: tuple, details: tuple = ()) -> list[tuple]:
        """Every rank's `details`; an error on every rank when their `subject`s differ."""
        payloads = self.agree((subject, details))
        if len({other_subject for other_subject, _ in payloads}) > 1:
            raise RuntimeError(
                "the ranks disagree on the checkpoints they look at (do they all see the same directory?): "
                + "; ".join(f"rank {rank}: {other}" for rank, (other, _) in enumerate(payloads))
            )
        return [other_details for _, other_details in payloads]


class _DefectElsewhere(RuntimeError):
    """Another rank failed with an error that is not about the checkpoint: every rank stops."""


class Checkpoint:
    """A verified checkpoint directory: its manifest, and reads of any box of a logical tensor.

    A read assembles the box from whichever pieces overlap it, so a reader in one
    layout can load what another layout wrote (resharding is a choice of boxes).
    A whole piece going into contiguous CPU memory of its own dtype is read from the
    file straight into that memory, with no intermediate copy; everything else (a
    slice, a cast, another device) goes through the safetensors library.
    """

    def __init__(self, path: Path, manifest: Manifest, prefetched: dict[str, torch.Tensor] | None = None):
        self.path = path
        self.manifest = manifest
        self._prefetched = prefetched or {}
        self._handles: dict = {}
        self._files: dict[str, TensorFile] = {}
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.manifest.step

    def names(self, prefix: str = "") -> list[str]:
        return [name for name in self.manifest.tensors if name.startswith(prefix)]

    def record(self, name: str) -> TensorRecord:
        record = self.manifest.tensors.get(name)
        if record is None:
            raise CheckpointError(f"{self.path} holds no tensor {name!r}")
        return record

    def prefetched(self, name: str) -> torch.Tensor | None:
        """The whole tensor `name` as the verification read it (a tensor the `Prefetch` asked for), else None."""
        return self._prefetched.get(name)

    def read(self, name: str) -> torch.Tensor:
        """The whole logical tensor `name`, in its stored dtype, on the CPU."""
        record = self.record(name)
        out = torch.empty(record.shape, dtype=getattr(torch, record.dtype))
        self.read_into(name, out)
        return out

    def read_many(self, boxes: list[tuple[str, torch.Tensor, tuple[int, ...] | None]]) -> None:
        """`read_into` for each (name, out, offset); an empty `out` reads nothing.

        Boxes that go into plain CPU memory are read on this rank's share of the cores
        (`io_threads`) at once, largest first: reads release the GIL, and filling fresh
        memory is mostly the kernel's page faults, which one core alone takes twice as
        long to serve as two. The others (casts, other devices) take a whole host copy
        each and go one at a time.
        """
        direct: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
        copied: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
        for box in boxes:
            if box[1].numel():
                (direct if is_plain_cpu(box[1], self.record(box[0]).dtype) else copied).append(box)
        ordered = sorted(direct, key=lambda box: box[1].nbytes, reverse=True)
        with ThreadPoolExecutor(max_workers=io_threads(len(ordered))) as pool:
            for done in [pool.submit(self.read_into, *box) for box in ordered]:
                done.result()
        for box in copied:
            self.read_into(*box)

    def read_into(self, name: str, out: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        """Fill `out` with the box of `name` that starts at `offset` (default: the origin); casts to `out`'s dtype."""
        record = self.record(name)
        offset = list(offset) if offset is not None else [0] * len(record.shape)
        size = list(out.shape)
        if len(offset) != len(record.shape) or any(o < 0 or o + s > g for o, s, g in zip(offset, size, record.shape)):
            raise CheckpointError(f"{name}: a box of {size} at {offset} does not fit the stored shape {record.shape}")
        for piece in record.pieces:
            low = [max(p, o) for p, o in zip(piece.offset, offset)]
            high = [min(p + n, o + s) for p, n, o, s in zip(piece.offset, piece.shape, offset, size)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            target = out[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, offset))]
            whole = low == piece.offset and high == [p + n for p, n in zip(piece.offset, piece.shape)]
            if whole and is_plain_cpu(target, record.dtype):
                self._tensor_file(piece.file).read_into(name, target)
                continue
            handle = self._handle(piece.file)
            if whole:
                data = handle.get_tensor(name)
            else:
                within = tuple(slice(lo - p, hi - p) for lo, hi, p in zip(low, high, piece.offset))
                data = handle.get_slice(name)[within]
            target.copy_(data)

    def close(self) -> None:
        self._handles.clear()
        self._prefetched = {}
        self._files.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, file: str):
        with self._lock:
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            return self._handles[file]

    def _tensor_file(self, file: str) -> TensorFile:
        with self._lock:
            if file not in self._files:
                self._files[file] = TensorFile(self.path / file)
            return self._files[file]


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of the checkpoint at `path`; fast, checks no tensor bytes."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        inside = list_checkpoints(path)
        hint = f"; it holds the checkpoints {', '.join(p.name for p in inside)}: pass one of them" if inside else ""
        raise CheckpointError(
            f"{path} has no {MANIFEST_NAME}: its save never finished, or it is not a checkpoint{hint}"
        )
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} cannot be read: {exc}") from None
    manifest = Manifest.parse(text, manifest_path)
    named = parse_step(path)
    if named is not None and named != manifest.step:
        raise CheckpointError(
            f"{path} holds the checkpoint of step {manifest.step}, not of step {named} as its name says "
            "(a renamed directory: `resume=latest` orders checkpoints by that name)"
        )
    return manifest


def verify_checkpoint(
    path: Path,
    prefetch: Prefetch | None = None,
    share: SharedVerification | None = None,
    digests: tuple[str, ...] = (FAST,),
) -> Checkpoint:
    """Open a checkpoint only if it is complete and intact: listed files only, sizes, digests, headers.

    `digests` are the file digests checked (ferry/checkpoint/digests.py); a manifest that lacks
    them (format version 1) is checked by its sha256. With `prefetch`, the tensors it asks for
    are read as their files are hashed; the `Checkpoint` hands them out (`prefetched`) only once
    every file has verified. With `share`, this rank hashes only its share of the files and the
    ranks agree on the verdict.
    """
    unknown = sorted(set(digests) - set(DIGESTS))
    if unknown or not digests:
        raise ValueError(f"digests {list(digests)}: each must be one of {', '.join(DIGESTS)}")
    if share is None:
        return _verify(Path(path), prefetch, digests, 0, 1)
    try:
        checkpoint, error = _verify(Path(path), prefetch, digests, share.rank, share.world_size), None
    except Exception as exc:  # every rank must reach the exchange, or the others wait for it forever
        checkpoint, error = None, exc
    kind = "valid" if error is None else "invalid" if isinstance(error, (UserError, OSError)) else "defect"
    message = "" if error is None else str(error) or repr(error)
    verdicts = share.same_everywhere(("verify", str(path)), (kind, message))
    if kind == "defect":
        raise error  # not about the checkpoint: with its traceback, after the others heard of it
    defects = [(rank, message) for rank, (other, message) in enumerate(verdicts) if other == "defect"]
    if defects:
        raise _DefectElsewhere(f"rank {defects[0][0]} failed verifying {path}: {defects[0][1]}")
    failed = [(rank, message) for rank, (other, message) in enumerate(verdicts) if other == "invalid"]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(message if rank == share.rank else f"{message} (found by rank {rank})")
    return checkpoint


def _verify(path: Path, prefetch: Prefetch | None, digests: tuple[str, ...], rank: int, world_size: int) -> Checkpoint:
    """`verify_checkpoint`, hashing files rank, rank + world_size, ... of the files sorted largest first."""
    manifest = read_manifest(path)
    unexpected = sorted({entry.name for entry in path.iterdir()} - set(manifest.files) - {MANIFEST_NAME})
    if unexpected:
        raise CheckpointError(
            f"{path} holds files its manifest does not list: {', '.join(unexpected)}; "
            f"a ferry checkpoint is only {MANIFEST_NAME} and the safetensors files it lists"
        )
    for file, expected in manifest.files.items():
        file_path = path / file
        if not file_path.is_file():
            raise CheckpointError(f"{file_path} is missing")
        size = file_path.stat().st_size
        if size != expected.bytes:
            raise CheckpointError(f"{file_path} has {size:,} bytes where the manifest says {expected.bytes:,}")
    # hashlib, xxhash and reads release the GIL: a rank's files hash on its share of the cores at once, largest first.
    files = sorted(manifest.files, key=lambda file: (-manifest.files[file].bytes, file))[rank::world_size]
    mine = set(files)
    targets = _prefetch_targets(manifest, prefetch(manifest) if prefetch else {})
    targets = {name: tensor for name, tensor in targets.items() if manifest.tensors[name].pieces[0].file in mine}
    by_file: dict[str, dict[str, torch.Tensor]] = {file: {} for file in files}
    for name, tensor in targets.items():
        by_file[manifest.tensors[name].pieces[0].file][name] = tensor
    names = recorded_digests(manifest, digests)
    with ThreadPoolExecutor(max_workers=io_threads(len(files))) as pool:
        found = list(pool.map(lambda file: hash_and_fill(path / file, by_file[file], names), files))
    for file, values in zip(files, found):
        for name, value in values.items():
            if value != getattr(manifest.files[file], name):
                raise CheckpointError(f"{path / file} does not match its {name} in the manifest (corrupt or modified)")
    _check_headers(path, manifest)
    return Checkpoint(path, manifest, targets)


def recorded_digests(manifest: Manifest, digests: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `digests` that the manifest records for every file; its sha256 (always there) if none is."""
    names = tuple(name for name in digests if all(getattr(r, name) is not None for r in manifest.files.values()))
    return names or ("sha256",)


def _prefetch_targets(manifest: Manifest, asked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The asked-for tensors that can take a stored tensor's bytes as they are: one piece, same shape and dtype."""
    targets = {}
    for name, tensor in asked.items():
        record = manifest.tensors.get(name)
        if (
            record is not None
            and len(record.pieces) == 1
            and list(tensor.shape) == record.shape
            and is_plain_cpu(tensor, record.dtype)
        ):
            targets[name] = tensor
    return targets


def list_checkpoints(root: Path) -> list[Path]:
    """The `step-*` directories under `root`, oldest first (staging directories are not listed)."""
    if not root.is_dir():
        return []
    found = [(parse_step(entry), entry) for entry in root.iterdir() if entry.is_dir()]
    return [entry for step, entry in sorted((s, e) for s, e in found if s is not None)]


@dataclass
class Found:
    """The checkpoint to resume from (None when there is none) and the newer ones that were not valid."""

    checkpoint: Checkpoint | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def newest_valid(
    root: Path,
    prefetch: Prefetch | None = None,
    share: SharedVerification | None = None,
    digests: tuple[str, ...] = (FAST,),
) -> Found:
    """The newest checkpoint under `root` that verifies; each newer invalid one is skipped with its reason."""
    skipped: list[tuple[Path, str]] = []
    candidates = list(reversed(list_checkpoints(root)))
    if share is not None:
        share.same_everywhere(("list", str(root), *(path.name for path in candidates)))
    for path in candidates:
        try:
            return Found(verify_checkpoint(path, prefetch, share, digests), skipped)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
    return Found(None, skipped)


def find_resume_point(
    resume: str,
    default_root: Path,
    prefetch: Prefetch | None = None,
    share: SharedVerification | None = None,
    digests: tuple[str, ...] = (FAST,),
) -> Found:
    """Resolve `resume`: `latest` is the newest valid checkpoint under `default_root` (none yet is fine);
    a path is a checkpoint, a directory of checkpoints or a run directory (its `checkpoints/`), whose
    newest valid one is taken."""
    if resume == "latest":
        found = newest_valid(default_root, prefetch, share, digests)
        if found.checkpoint is None and found.skipped:
            raise CheckpointError(_none_valid(default_root, found.skipped))
        return found
    path = Path(resume)
    if not path.exists():
        raise UserError(f"resume: {resume!r} does not exist")
    if not (path / MANIFEST_NAME).exists() and list_checkpoints(path / RUN_CHECKPOINTS):
        path = path / RUN_CHECKPOINTS
    if (path / MANIFEST_NAME).exists() or not list_checkpoints(path):
        return Found(verify_checkpoint(path, prefetch, share, digests))
    found = newest_valid(path, prefetch, share, digests)
    if found.checkpoint is None:
        raise CheckpointError(_none_valid(path, found.skipped))
    return found


def latest_checkpoint(source: str | Path) -> Checkpoint:
    """The checkpoint a command that reads a trained model (`ferry generate`, `eval`, `export`) takes from
    `source`: a checkpoint, or a directory of checkpoints, a run or a `ferry import` directory, whose newest
    valid one it is (as `resume=PATH` takes it), so that a user can point at the run they trained.

    A directory that is none of these is named as such; one named `step-N` keeps the reader's message
    (a save that never finished)."""
    path = Path(source)
    if not path.exists():
        raise UserError(f"{str(source)!r} does not exist")
    if (
        not (path / MANIFEST_NAME).exists()
        and parse_step(path) is None
        and not list_checkpoints(path)
        and not list_checkpoints(path / RUN_CHECKPOINTS)
    ):
        raise UserError(
            f"{path} is not a checkpoint (it has no {MANIFEST_NAME}), and neither it nor {path / RUN_CHECKPOINTS} "
            "holds a step-* checkpoint: give a checkpoint, a run directory or a directory of checkpoints"
        )
    return find_resume_point(str(path), path).checkpoint


def _none_valid(root: Path, skipped: list[tuple[Path, str]]) -> str:
    reasons = "\n  ".join(f"{path.name}: {reason}" for path, reason in skipped)
    return f"no valid checkpoint in {root}:\n  {reasons}"


def _check_headers(path: Path, manifest: Manifest) -> None:
    """Each file's safetensors header must hold exactly the pieces the manifest puts in it."""
    expected: dict[str, dict[str, tuple[str, list[int]]]] = {file: {} for file in manifest.files}
    for name, record in manifest.tensors.items():
        for piece in record.pieces:
            expected[piece.file][name] = (SAFETENSORS_DTYPES[record.dtype], piece.shape)
    for file, wanted in expected.items():
        try:
            with safe_open(str(path / file), framework="pt") as handle:
                slices = {key: handle.get_slice(key) for key in handle.keys()}
                found = {key: (piece.get_dtype(), piece.get_shape()) for key, piece in slices.items()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path / file} is not a readable safetensors file: {exc}") from None
        if found != wanted:
            differing = sorted(key for key in set(found) | set(wanted) if found.get(key) != wanted.get(key))
            raise CheckpointError(f"{path / file} does not hold what the manifest says: {', '.join(differing[:5])}")

"""The checkpoint format: directory and file names, the manifest schema, and its consistency rules.

A checkpoint is a directory `step-NNNNNNNN/` of safetensors files plus `manifest.json`
(docs/checkpoint-format.md). Tensor names are logical: a tensor is described by its
global shape, and each file holds a rectangular piece of it at an offset, so the same
manifest describes a checkpoint saved from one rank or from many, and a reader can
assemble any slice it needs whatever layout wrote it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferry.config.errors import UserError, first_problem

CHECKPOINT_FORMAT = "ferry-checkpoint"
# 2: every file also records its xxh3-128 (ferry/checkpoint/digests.py); version 1 manifests still load.
# 3: the manifest records the sha256 of its own content (`manifest_sha256`); versions 1 and 2 still load.
# 4: optimizer state under other keys than the moments and step counts version 3 knows (Muon's
#    `optim.momentum_buffer.<param>`), its optimizer named in `train_state.optimizer.kind`, which a reader of version 3
#    would take for AdamW's: only such checkpoints are written as 4, the others stay 3.
FORMAT_VERSION = 4
MOMENTS_FORMAT_VERSION = 3
MOMENTS_STATE_KEYS = frozenset({"exp_avg", "exp_avg_sq", "step"})  # the optimizer state keys version 3 reads


def format_version_of(tensor_names) -> int:
    """The version a checkpoint of these tensors is written as: the oldest that describes it."""
    keys = {name.split(".")[1] for name in tensor_names if name.startswith("optim.")}
    return FORMAT_VERSION if keys - MOMENTS_STATE_KEYS else MOMENTS_FORMAT_VERSION


def optimizer_kind(train_state: dict) -> str | None:
    """Which optimizer's state a checkpoint of `train_state` holds (`AdamW`, `Muon`), as its manifest records it;
    None where it holds none (weights only, an import, an average that dropped it)."""
    optimizer = train_state.get("optimizer")
    kind = optimizer.get("kind") if isinstance(optimizer, dict) else None
    return kind if isinstance(kind, str) else None


MANIFEST_DIGEST = "manifest_sha256"
MANIFEST_NAME = "manifest.json"
TENSOR_SUFFIX = ".safetensors"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
# Older checkpoints have one file per group and rank, without the part number.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_]+-rank\d{5,}(-part\d{4,})?\.safetensors$")
# A rank's group of tensors is split into files of at most this many tensor bytes (one tensor per
# file when a tensor alone is larger), so that the files of a checkpoint hash and read on all cores.
DEFAULT_FILE_BYTES = 256 << 20

# torch dtype name -> the safetensors header code of the same element type
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or not a ferry checkpoint; the message says why."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir_name(step: int) -> str:
    """Where a save is written before the rename; dot-prefixed so no reader mistakes it for a checkpoint.

    Deterministic (no pid), so that every rank of a multi-rank save writes into the same one.
    """
    return f".{step_dir_name(step)}.partial"


def parse_step(path: Path) -> int | None:
    """The step of a `step-NNNNNNNN` directory name, or None for any other name."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def rank_file_name(group: str, rank: int, part: int) -> str:
    """Each rank writes its tensors of a name group (`model`, `optim`, `rng`) into one or more parts:
    `model-rank00000-part0000.safetensors`."""
    return f"{group}-rank{rank:05d}-part{part:04d}{TENSOR_SUFFIX}"


def name_group(name: str) -> str:
    """The first segment of a logical name, which picks the file it is written to."""
    group, dot, rest = name.partition(".")
    if not dot or not rest or not re.fullmatch(r"[A-Za-z0-9_]+", group):
        raise ValueError(f"logical tensor name {name!r} must look like 'group.rest' with group in [A-Za-z0-9_]")
    return group


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {name} cannot be stored in a checkpoint")
    return name


@dataclass(frozen=True)
class TensorPiece:
    """What one rank contributes to a logical tensor: `local` sits at `offset` in a tensor of `global_shape`.

    A tensor held whole by one rank is `TensorPiece.whole(t)`; an expert tensor split
    along dim 0 over EP ranks is one piece per rank with offsets (r * E / ep, 0, 0).
    """

    local: torch.Tensor
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> TensorPiece:
        return cls(tensor, (0,) * tensor.ndim, tuple(tensor.shape))

    def check(self, name: str) -> None:
        shape = tuple(self.local.shape)
        if not len(shape) == len(self.offset) == len(self.global_shape):
            raise ValueError(f"{name}: piece of rank {len(shape)} with offset {self.offset} in {self.global_shape}")
        if any(o < 0 or o + s > g for o, s, g in zip(self.offset, shape, self.global_shape)):
            raise ValueError(f"{name}: piece {shape} at {self.offset} lies outside {self.global_shape}")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=())


class FileRecord(_Record):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    xxh3_128: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")  # absent in format version 1


class PieceRecord(_Record):
    """The box of a logical tensor that one file holds, under the tensor's logical name."""

    file: str
    offset: list[int]
    shape: list[int]


class TensorRecord(_Record):
    dtype: str
    shape: list[int]
    pieces: list[PieceRecord] = Field(min_length=1)


class Layout(_Record):
    """The parallel layout a checkpoint was saved from; loading may use another one."""

    world_size: int = Field(ge=1)
    ep_degree: int = Field(ge=1)
    mode: str
    pp_degree: int = Field(1, ge=1)  # pipeline stages; the tensors' names and boxes are the same whatever it is

    def describe(self) -> str:
        pipeline = f", PP degree {self.pp_degree}" if self.pp_degree > 1 else ""
        return f"world size {self.world_size}{pipeline}, EP degree {self.ep_degree}, mode {self.mode}"


class Manifest(_Record):
    """`manifest.json`: everything about a checkpoint except the tensor bytes. Written last."""

    format: str
    format_version: int
    step: int = Field(ge=0)
    tokens_seen: int = Field(ge=0)
    created_at: str
    layout: Layout
    model: dict = Field(alias="model_config")
    run_config: dict
    environment: dict
    train_state: dict
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    manifest_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # absent before format version 3

    def to_json(self) -> str:
        """The manifest's text, sealed with the digest of its content (`manifest_digest`)."""
        content = json.loads(self.model_dump_json(by_alias=True, exclude={MANIFEST_DIGEST}))
        return json.dumps(seal_manifest(content), indent=1)

    @classmethod
    def parse(cls, text: str, source: Path) -> Manifest:
        """Parse and check a manifest; any problem is a `CheckpointError` naming the field."""
        try:
            manifest = cls.model_validate_json(text)
        except ValidationError as exc:
            raise CheckpointError(f"{source} is malformed: {first_problem(exc)}") from None
        if manifest.format != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{source} is not a {CHECKPOINT_FORMAT} manifest (format {manifest.format!r})")
        if manifest.format_version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format_version {manifest.format_version}; this ferry reads up to {FORMAT_VERSION}"
            )
        if manifest.manifest_sha256 is not None:
            if manifest_digest(json.loads(text)) != manifest.manifest_sha256:
                raise CheckpointError(
                    f"{source} does not match its {MANIFEST_DIGEST}: its content was changed after the save "
                    "(corrupt or edited)"
                )
        elif manifest.format_version >= 3:
            raise CheckpointError(f"{source} has no {MANIFEST_DIGEST}, which format version 3 records")
        manifest.check(source)
        return manifest

    def check(self, source: Path) -> None:
        """File names are plain and listed; every tensor is tiled exactly by its pieces."""
        for file, record in self.files.items():
            if not _FILE_NAME.match(file):
                raise CheckpointError(f"{source}: file name {file!r} is not a ferry rank file")
            if self.format_version >= 2 and record.xxh3_128 is None:
                raise CheckpointError(f"{source}: {file} has no xxh3_128, which format version 2 records")
        for name, tensor in self.tensors.items():
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{source}: {name} has unknown dtype {tensor.dtype!r}")
            for piece in tensor.pieces:
                if piece.file not in self.files:
                    raise CheckpointError(f"{source}: {name} is in {piece.file}, which the manifest does not list")
            problem = coverage_problem(tensor.shape, [(p.offset, p.shape) for p in tensor.pieces])
            if problem:
                raise CheckpointError(f"{source}: {name}: {problem}")


def manifest_digest(content: dict) -> str:
    """The sha256 of a manifest's content without its own digest, as canonical JSON (keys sorted, no spaces,
    UTF-8): a changed value is found wherever it sits (a data cursor, a step, a file's digest), and any
    tool that parses JSON can check it (docs/checkpoint-format.md, "Reading without ferry")."""
    body = {key: value for key, value in content.items() if key != MANIFEST_DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def seal_manifest(content: dict) -> dict:
    """`content` (a parsed manifest) with its `manifest_sha256` set to the digest of the rest."""
    return {**content, MANIFEST_DIGEST: manifest_digest(content)}


def coverage_problem(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> str | None:
    """Why the boxes (offset, shape) do not tile a tensor of `shape` exactly once, or None when they do."""
    for offset, size in boxes:
        if not len(offset) == len(size) == len(shape):
            return f"piece at {offset} of shape {size} does not have the tensor's {len(shape)} dimensions"
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, size, shape)):
            return f"piece at {offset} of shape {size} lies outside {shape}"
    for index, (offset_a, size_a) in enumerate(boxes):
        for offset_b, size_b in boxes[index + 1 :]:
            if all(max(a, b) < min(a + sa, b + sb) for a, sa, b, sb in zip(offset_a, size_a, offset_b, size_b)):
                return f"pieces at {offset_a} and {offset_b} overlap"
    covered = sum(math.prod(size) for _, size in boxes)
    if covered != math.prod(shape):
        return f"pieces cover {covered} of {math.prod(shape)} elements"
    return None

"""`ferry release verify DIR`: is this release complete, untampered and one chain?

Checks, each failure naming its file: every file `release.json` lists is there with its size and sha256, and no
file is there that it does not list; each stage's checkpoint is the one the lineage's digest names (its manifest,
or for a weights-only copy the original manifest kept beside it, whose file records the copy's must repeat), and
the checkpoint manifest's own file digests agree with the release's; each stage whose parent is a stage of the
pipeline names that stage's final checkpoint by digest. A directory that is no release is bad input (exit 2).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.checkpoint.format import MANIFEST_NAME
from ferry.config import UserError
from ferry.data.manifest import sha256_file
from ferry.portability.release.build import RELEASE_FILE, RELEASE_FORMAT, RELEASE_VERSION
from ferry.stages.lineage import LINEAGE_FILE, LINEAGE_FORMAT


@dataclass
class ReleaseCheck:
    """What `verify_release` found: the problems (empty: it passed) and what it checked."""

    path: Path
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    stages: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        if self.passed:
            return [
                f"ferry: release {self.path}: PASS — {self.files} file(s), {self.bytes:,} bytes, every sha256 as "
                f"recorded; stage chain {' -> '.join(self.stages)} consistent by checkpoint digest"
            ]
        return [f"ferry: release {self.path}: FAIL — {len(self.problems)} problem(s)"] + [
            f"  {problem}" for problem in self.problems
        ]


def read_release(directory: str | Path) -> dict[str, Any]:
    """release.json of `directory`; anything that is not a ferry release is a `UserError` (exit 2)."""
    directory = Path(directory)
    path = directory / RELEASE_FILE
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory (a release is a directory with {RELEASE_FILE})")
    if not path.is_file():
        raise UserError(f"{directory} is not a ferry release: {RELEASE_FILE} is missing")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is unreadable: {exc}") from None
    if not isinstance(content, dict) or content.get("format") != RELEASE_FORMAT:
        raise UserError(f"{path} is not a {RELEASE_FORMAT} file")
    if content.get("version") != RELEASE_VERSION:
        raise UserError(
            f"{path}: release format version {content.get('version')!r}; this ferry reads {RELEASE_VERSION}"
        )
    for key, kind in (("files", dict), ("stages", list), ("data", list)):
        if not isinstance(content.get(key), kind):
            raise UserError(f"{path}: {key!r} is missing or not a {kind.__name__}")
    return content


def verify_release(directory: str | Path) -> ReleaseCheck:
    directory = Path(directory)
    content = read_release(directory)
    check = ReleaseCheck(directory, stages=[stage["name"] for stage in content["stages"]])
    _check_files(directory, content["files"], check)
    lineage = _lineage(directory, check)
    if lineage is not None:
        _check_chain(directory, content, lineage, check)
        _check_data(directory, content, lineage, check)
    return check


def _check_files(directory: Path, files: dict[str, dict[str, Any]], check: ReleaseCheck) -> None:
    for relative, record in files.items():
        path = directory / relative
        check.files += 1
        if not path.is_file():
            check.problems.append(f"{relative}: missing")
            continue
        size = path.stat().st_size
        check.bytes += size
        if size != record.get("bytes"):
            check.problems.append(f"{relative}: {size} bytes, recorded {record.get('bytes')}")
        elif sha256_file(path) != record.get("sha256"):
            check.problems.append(f"{relative}: sha256 differs from the recorded {str(record.get('sha256'))[:12]}")
    present = {path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()} - {
        RELEASE_FILE
    }
    for extra in sorted(present - set(files)):
        check.problems.append(f"{extra}: not listed in {RELEASE_FILE}")


def _lineage(directory: Path, check: ReleaseCheck) -> dict[str, Any] | None:
    try:
        lineage = json.loads((directory / LINEAGE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        check.problems.append(f"{LINEAGE_FILE}: unreadable ({exc})")
        return None
    if not isinstance(lineage, dict) or lineage.get("format") != LINEAGE_FORMAT:
        check.problems.append(f"{LINEAGE_FILE}: not a {LINEAGE_FORMAT} file")
        return None
    return lineage


def _check_chain(directory: Path, content: dict[str, Any], lineage: dict[str, Any], check: ReleaseCheck) -> None:
    recorded = {stage.get("name"): stage for stage in lineage.get("stages", [])}
    released = [stage["name"] for stage in content["stages"]]
    if list(recorded) != released:
        check.problems.append(f"{LINEAGE_FILE}: stages {list(recorded)}, the release lists {released}")
    for index, stage in enumerate(content["stages"]):
        name = stage["name"]
        record = recorded.get(name) or {}
        result = record.get("result") or {}
        checkpoint = stage["checkpoint"]
        if result.get("digest") != checkpoint["lineage_digest"]:
            check.problems.append(
                f"{LINEAGE_FILE}: stage {name} ended with {str(result.get('digest'))[:12]}, the release records "
                f"{checkpoint['lineage_digest'][:12]}"
            )
        _check_checkpoint(directory, name, checkpoint, content["files"], check)
        parent = record.get("parent")
        if (parent or None) != (stage.get("parent") or None):
            check.problems.append(f"{LINEAGE_FILE}: stage {name}'s parent differs from the release's record of it")
        if parent and parent.get("stage"):
            before = recorded.get(parent["stage"])
            position = released.index(parent["stage"]) if parent["stage"] in released else None
            if before is None or position is None or position >= index:
                check.problems.append(
                    f"{LINEAGE_FILE}: stage {name} starts from stage {parent['stage']}, which is not an earlier stage"
                )
            elif (before.get("result") or {}).get("digest") != parent.get("digest"):
                check.problems.append(
                    f"{LINEAGE_FILE}: stage {name}'s parent digest {str(parent.get('digest'))[:12]} is not stage "
                    f"{parent['stage']}'s final checkpoint ({str((before.get('result') or {}).get('digest'))[:12]})"
                )


def _check_data(directory: Path, content: dict[str, Any], lineage: dict[str, Any], check: ReleaseCheck) -> None:
    """Each dataset's released manifest is the one the release and every stage of the lineage name."""
    by_path = {}
    for source in content["data"]:
        by_path[source.get("path")] = source
        relative = f"{source.get('dir')}/{MANIFEST_NAME}"
        path = directory / relative
        if path.is_file() and sha256_file(path) != source.get("manifest_sha256"):
            check.problems.append(
                f"{relative}: not the manifest of data source {source.get('name')} the release records "
                f"({str(source.get('manifest_sha256'))[:12]})"
            )
    for stage in lineage.get("stages", []):
        for use in [*stage.get("data", []), *stage.get("eval_data", [])]:
            source = by_path.get(use.get("path"))
            if source is None or source.get("manifest_sha256") != use.get("manifest_sha256"):
                check.problems.append(
                    f"{LINEAGE_FILE}: stage {stage.get('name')}'s data source {use.get('name')} "
                    f"({str(use.get('manifest_sha256'))[:12]}) is not a dataset of the release"
                )


def _check_checkpoint(
    directory: Path, name: str, checkpoint: dict[str, Any], files: dict[str, dict[str, Any]], check: ReleaseCheck
) -> None:
    """The released checkpoint is the lineage's: by its manifest's digest, or (weights only) by the original
    manifest's digest and the same file records; and its manifest's file digests are the release's."""
    path = directory / checkpoint["path"]
    manifest_path = path / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        original_path = directory / (checkpoint["source_manifest"] or f"{checkpoint['path']}/{MANIFEST_NAME}")
        original_bytes = original_path.read_bytes()
        original = json.loads(original_bytes)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError) as exc:
        check.problems.append(f"{checkpoint['path']}/{MANIFEST_NAME}: stage {name}'s checkpoint is unreadable ({exc})")
        return
    relative = original_path.relative_to(directory).as_posix()
    if hashlib.sha256(original_bytes).hexdigest() != checkpoint["lineage_digest"]:
        check.problems.append(
            f"{relative}: stage {name}'s checkpoint is not the lineage's (digest {checkpoint['lineage_digest'][:12]})"
        )
    for file, record in manifest.get("files", {}).items():
        released = files.get(f"{checkpoint['path']}/{file}")
        if released is None or released.get("sha256") != record.get("sha256"):
            check.problems.append(f"{checkpoint['path']}/{file}: its checkpoint manifest records another sha256")
        if original.get("files", {}).get(file) != record:
            check.problems.append(f"{checkpoint['path']}/{file}: not the file of the lineage's checkpoint ({relative})")

"""`DIR/lineage.json`: what each stage of a pipeline started from and ended with.

A stage's record holds its parent checkpoint (path, step and digest: the sha256 of its
manifest, which names the digest of every file), its resolved config, its data mix with
the digest of every dataset, its seed and the code version; once it finishes, its final
checkpoint and figures. That is what it takes to run the same stage again elsewhere and
to know that a result came from the chain it claims.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ferry.checkpoint.format import MANIFEST_NAME
from ferry.config import UserError
from ferry.data.manifest import sha256_file
from ferry.stages.lineage_shape import check_lineage_shape

LINEAGE_FILE = "lineage.json"
LINEAGE_FORMAT = "ferry-lineage"
LINEAGE_VERSION = 1


def dataset_record(name: str, path: str, weight: float | None = None) -> dict[str, Any]:
    manifest = Path(path) / MANIFEST_NAME
    record = {"name": name, "path": path, "manifest_sha256": sha256_file(manifest) if manifest.is_file() else None}
    if weight is not None:
        record["weight"] = weight
    return record


class Lineage:
    """The lineage file of one pipeline directory, rewritten atomically after every change."""

    def __init__(self, directory: Path, pipeline: dict[str, Any], order: list[str] = ()):
        self.path = directory / LINEAGE_FILE
        self.pipeline = pipeline
        self.order = list(order)  # the stages' order in the pipeline file, which the file keeps
        self.recorded_pipeline = pipeline  # the pipeline the file named before this run (the same, when new)
        self.stages: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"{self.path} is unreadable: {exc}") from None
            if not isinstance(data, dict) or data.get("format") != LINEAGE_FORMAT:
                raise UserError(f"{self.path} is not a {LINEAGE_FORMAT} file")
            check_lineage_shape(data, self.path)
            if data["pipeline"]["name"] != pipeline["name"]:
                raise UserError(
                    f"{directory} holds the stages of pipeline {data['pipeline']['name']!r}, not {pipeline['name']!r}; "
                    "choose another --dir"
                )
            self.stages = {stage["name"]: stage for stage in data["stages"]}
            self.recorded_pipeline = data["pipeline"]

    @classmethod
    def read(cls, directory: Path) -> dict[str, Any]:
        path = directory / LINEAGE_FILE
        if not path.is_file():
            raise UserError(f"{directory} holds no pipeline ({LINEAGE_FILE} is missing)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path} is unreadable: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != LINEAGE_FORMAT:
            raise UserError(f"{path} is not a {LINEAGE_FORMAT} file")
        return check_lineage_shape(data, path)

    def put(self, record: dict[str, Any]) -> None:
        self.stages[record["name"]] = record
        self.save()

    def forget(self, name: str) -> None:
        self.stages.pop(name, None)
        self.save()

    def _position(self, record: dict[str, Any]) -> int:
        return self.order.index(record["name"]) if record["name"] in self.order else len(self.order)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": LINEAGE_FORMAT,
            "version": LINEAGE_VERSION,
            "pipeline": self.pipeline,
            "stages": sorted(self.stages.values(), key=self._position),
        }
        staging = self.path.with_suffix(".json.partial")
        staging.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(staging, self.path)

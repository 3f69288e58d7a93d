"""The rehearsal bundle: what the source half of a move hands to the target half on another machine.

    BUNDLE/
      bundle.json          format, the resolved run config, the source environment, steps, switch step,
                           the source's data (shard and tokenizer digests), code version, and the sha256
                           and size of every other file below
      checkpoint/step-N/   the switch checkpoint, in the source's own sharding
      reference/           the source's uninterrupted run: metrics.jsonl (the reference trajectory),
                           run.json (fingerprint, kernels, precision), config.yaml
      seeds/seed-K/        for an objective that samples its data: the source's run with seed K
                           (metrics.jsonl, config.yaml), the spread the `sampled` profile judges by

A bundle is checked whole before the target half starts: a missing file makes it
incomplete, a file whose bytes differ from its digest (or one no digest lists) makes
it tampered with, and either is refused before anything runs or is recorded. The
digests guard against damage and mistakes in transit; they are no signature, since
whoever can edit the files can edit bundle.json too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferry.config import UserError
from ferry.config.errors import first_problem
from ferry.platform.fingerprint import code_version
from ferry.portability.comparison.environment import Environment, without_locations
from ferry.portability.rehearsal.legs import LegResult
from ferry.train.config import RunConfig
from ferry.train.objectives.kinds import objective_kind
from ferry.train.run_dir.record import CONFIG_NAME, METRICS_NAME, RUN_RECORD_NAME

BUNDLE_FILE = "bundle.json"
BUNDLE_FORMAT = "ferry-rehearsal-bundle"
BUNDLE_VERSION = 2  # 2: seed runs (seeds/seed-K) for objectives that sample their data; 1 has none
READABLE_VERSIONS = (1, 2)
REFERENCE_DIR = "reference"
SEEDS_DIR = "seeds"
CHECKPOINT_DIR = "checkpoint"
_REQUIRED = ("format", "version", "config", "source", "steps", "switch_at", "checkpoint", "data", "files")


class _Open(BaseModel):
    """A record that may carry more than ferry reads of it."""

    model_config = ConfigDict(extra="allow", strict=True)


class _FileDigest(_Open):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class _Shard(_Open):
    file: str
    sha256: str


class _DataSource(_Open):
    name: str
    tokenizer_sha256: str
    shards: list[_Shard]


class _Config(_Open):
    name: str
    resolved: dict[str, Any]
    digest: str


class _Source(_Open):
    definition: dict[str, Any]
    digest: str


class _SeedRun(_Open):
    seed: int
    dir: str = Field(pattern=rf"^{SEEDS_DIR}/seed-\d+$")


class BundleDescription(_Open):
    """What `bundle.json` must hold, with the types ferry relies on."""

    format: str
    version: int
    config: _Config
    source: _Source
    steps: int = Field(ge=2)
    switch_at: int = Field(ge=1)
    checkpoint: str = Field(pattern=r"^checkpoint/step-\d{8}$")
    data: list[_DataSource]
    files: dict[str, _FileDigest]
    seed_runs: list[_SeedRun] = []


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its directory and the content of its bundle.json."""

    path: Path
    content: dict[str, Any]

    @property
    def checkpoint(self) -> Path:
        return self.path / self.content["checkpoint"]

    @property
    def reference(self) -> Path:
        return self.path / REFERENCE_DIR

    @property
    def steps(self) -> int:
        return self.content["steps"]

    @property
    def switch_at(self) -> int:
        return self.content["switch_at"]

    @property
    def base_config(self) -> dict[str, Any]:
        """The resolved run config the source ran, before its environment was laid over it."""
        return self.content["config"]["resolved"]

    @property
    def seed_runs(self) -> list[Path]:
        """The source's runs with other seeds (for an objective that samples its data; else none)."""
        return [self.path / run["dir"] for run in self.content.get("seed_runs", [])]

    def source(self) -> Environment:
        return Environment.model_validate(self.content["source"]["definition"])

    def reference_record(self) -> dict:
        return json.loads((self.reference / RUN_RECORD_NAME).read_text(encoding="utf-8"))


def config_digest(resolved: dict[str, Any]) -> str:
    """sha256 of a resolved run config without what only says where things lie: where the run is written
    and where its datasets are (their content is checked by digest, wherever they are)."""
    return hashlib.sha256(json.dumps(without_locations(resolved), sort_keys=True).encode()).hexdigest()


def write_bundle(
    out: Path,
    *,
    config_name: str,
    base_config: dict[str, Any],
    source: Environment,
    steps: int,
    switch_at: int,
    source_leg: LegResult,
    checkpoint: Path,
    seed_legs: dict[int, LegResult] | None = None,
) -> Bundle:
    """Assemble the bundle in a staging directory beside `out` and rename it into place."""
    if out.exists() and any(out.iterdir()):
        raise UserError(f"bundle directory {str(out)!r} is not empty; choose another --out")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / REFERENCE_DIR).mkdir(parents=True)
    shutil.copytree(checkpoint, staging / CHECKPOINT_DIR / checkpoint.name)
    for name in (METRICS_NAME, RUN_RECORD_NAME, CONFIG_NAME):
        shutil.copy2(source_leg.run_dir / name, staging / REFERENCE_DIR / name)
    seed_runs = []
    for seed, leg in (seed_legs or {}).items():
        seed_dir = f"{SEEDS_DIR}/seed-{seed}"
        (staging / seed_dir).mkdir(parents=True)
        for name in (METRICS_NAME, CONFIG_NAME):
            shutil.copy2(leg.run_dir / name, staging / seed_dir / name)
        seed_runs.append({"seed": seed, "dir": seed_dir})
    record = source_leg.record
    content = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"name": config_name, "resolved": base_config, "digest": config_digest(base_config)},
        "source": {"definition": source.model_dump(mode="json"), "digest": source.digest},
        "steps": steps,
        "switch_at": switch_at,
        "checkpoint": f"{CHECKPOINT_DIR}/{checkpoint.name}",
        "source_leg": {
            "wall_s": source_leg.wall_s,
            "first_step_s": source_leg.first_step_s,
            "tokens_per_s": source_leg.median_tokens_per_s(),
            "conditions": source_leg.conditions(),
        },
        "data": record.get("data_mix", []),
        "seed_runs": seed_runs,
        "ferry": code_version(),
        "files": {},
    }
    content["files"] = {
        path.relative_to(staging).as_posix(): _file_digest(path)
        for path in sorted(staging.rglob("*"))
        if path.is_file()
    }
    (staging / BUNDLE_FILE).write_text(json.dumps(content, indent=1), encoding="utf-8")
    if out.exists():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out)
    return Bundle(out, content)


def read_bundle(path: str | Path) -> Bundle:
    """Open and check a bundle whole: format, completeness, every file against its digest, and that
    `bundle.json` agrees with itself (config and environment digests, switch step and checkpoint)."""
    path = Path(path)
    manifest = path / BUNDLE_FILE
    if not manifest.is_file():
        raise UserError(f"{str(path)!r} is not a rehearsal bundle: it has no {BUNDLE_FILE}")
    try:
        content = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"bundle {str(path)!r}: {BUNDLE_FILE} is not readable JSON ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != BUNDLE_FORMAT:
        raise UserError(f"bundle {str(path)!r}: {BUNDLE_FILE} is not a {BUNDLE_FORMAT} description")
    if content.get("version") not in READABLE_VERSIONS:
        raise UserError(
            f"bundle {str(path)!r} is version {content.get('version')!r}; this ferry reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    missing_keys = [key for key in _REQUIRED if key not in content]
    if missing_keys:
        raise UserError(f"bundle {str(path)!r} is incomplete: {BUNDLE_FILE} lacks {', '.join(missing_keys)}")
    try:
        description = BundleDescription.model_validate(content)
    except ValidationError as exc:
        raise UserError(f"bundle {str(path)!r}: {BUNDLE_FILE} is malformed at {first_problem(exc)}") from None
    _check_files(path, description)
    _check_consistent(path, description)
    return Bundle(path, content)


def _check_files(path: Path, description: BundleDescription) -> None:
    listed = description.files
    needed = [
        f"{description.checkpoint}/manifest.json",
        *(f"{REFERENCE_DIR}/{name}" for name in (METRICS_NAME, RUN_RECORD_NAME, CONFIG_NAME)),
        *(f"{run.dir}/{name}" for run in description.seed_runs for name in (METRICS_NAME, CONFIG_NAME)),
    ]
    unlisted = [name for name in needed if name not in listed]
    if unlisted:
        raise UserError(f"bundle {str(path)!r} is incomplete: it lists no {', '.join(unlisted)}")
    root = path.resolve()
    for name, expected in listed.items():
        file = path / name
        if not file.resolve().is_relative_to(root):
            raise UserError(f"bundle {str(path)!r} was tampered with: it lists {name!r}, outside the bundle")
        inside = [file, *(path / parent for parent in file.relative_to(path).parents[:-1])]  # not the bundle itself
        if any(part.is_symlink() for part in inside):
            raise UserError(f"bundle {str(path)!r} was tampered with: {name} lies under a symbolic link")
        if not file.is_file():
            raise UserError(f"bundle {str(path)!r} is incomplete: {name} is missing")
        if _file_digest(file) != expected.model_dump(include={"sha256", "bytes"}):
            raise UserError(f"bundle {str(path)!r} was tampered with or damaged: {name} does not match its sha256")
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {BUNDLE_FILE}
    extra = sorted(present - set(listed))
    if extra:
        raise UserError(
            f"bundle {str(path)!r} was tampered with: it holds files no digest lists: {', '.join(extra[:5])}"
        )


def _check_consistent(path: Path, description: BundleDescription) -> None:
    """bundle.json's own figures against its digests and against the digest-checked files."""
    from ferry.checkpoint import read_manifest

    if config_digest(description.config.resolved) != description.config.digest:
        raise UserError(f"bundle {str(path)!r} was tampered with: its resolved config does not match its digest")
    try:
        source = Environment.model_validate(description.source.definition)
    except ValidationError as exc:
        raise UserError(
            f"bundle {str(path)!r}: its source environment is malformed: {exc.errors()[0]['msg']}"
        ) from None
    if source.digest != description.source.digest:
        raise UserError(f"bundle {str(path)!r} was tampered with: its source environment does not match its digest")
    if description.switch_at >= description.steps:
        raise UserError(
            f"bundle {str(path)!r}: switch step {description.switch_at} is not before step {description.steps}"
        )
    _check_seed_entries(path, description)
    step = read_manifest(path / description.checkpoint).step
    if step != description.switch_at:
        raise UserError(
            f"bundle {str(path)!r} was tampered with: its checkpoint is of step {step}, the switch step says "
            f"{description.switch_at}"
        )


def _check_seed_entries(path: Path, description: BundleDescription) -> None:
    """Seed runs are runs of their own: each under the directory of its seed, no seed twice, none the reference's."""
    reference_seed = description.config.resolved.get("run", {}).get("seed")
    seeds = [run.seed for run in description.seed_runs]
    for run in description.seed_runs:
        if run.dir != f"{SEEDS_DIR}/seed-{run.seed}":
            raise UserError(f"bundle {str(path)!r} was tampered with: its seed run {run.seed} lies in {run.dir}")
        if run.seed == reference_seed or seeds.count(run.seed) > 1:
            raise UserError(
                f"bundle {str(path)!r} was tampered with: seed {run.seed} is listed twice or is the reference's own"
            )


def check_compatible(bundle: Bundle, config: RunConfig) -> None:
    """Refuse a target whose model or data is not the one the bundle's checkpoint was trained with."""
    from ferry.checkpoint import config_differences, read_manifest

    saved_model = read_manifest(bundle.checkpoint).model
    differences = config_differences(saved_model, config.model.model_dump(mode="json"), "model.")
    if differences:
        raise UserError(
            f"bundle {str(bundle.path)!r} holds a checkpoint of another model than the target's; differing fields:\n  "
            + "\n  ".join(str(difference) for difference in differences)
        )
    recorded = {source["name"]: source for source in bundle.content["data"]}
    here = {source["name"]: source for source in objective_kind(config).loader(config).mix_record()}
    if set(recorded) != set(here):
        raise UserError(
            f"bundle {str(bundle.path)!r}: the source trained on data sources {sorted(recorded)}, "
            f"the target config names {sorted(here)}"
        )
    for index, (name, source) in enumerate(here.items()):
        theirs = recorded[name]
        same = source["tokenizer_sha256"] == theirs["tokenizer_sha256"] and [
            shard["sha256"] for shard in source["shards"]
        ] == [shard["sha256"] for shard in theirs["shards"]]
        if not same:
            raise UserError(
                f"data source {name!r} at {source['path']!r} is not the dataset the source trained on (its shard or "
                f"tokenizer digests differ from the bundle's); point data.sources.{index}.path at a copy of that "
                "dataset (`ferry rehearse finish BUNDLE --to ENV data.sources.N.path=...`)"
            )


def _file_digest(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}

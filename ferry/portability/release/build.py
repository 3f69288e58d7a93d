"""`ferry release PIPELINE_DIR --out DIR`: a finished pipeline as one self-describing, verifiable bundle (one
finished run, `ferry release RUN_DIR`, as a pipeline of one stage: ferry/stages/single_run.py).

    DIR/
      release.json               every file below with its size and sha256; the stage chain and the data
      README.md                  the model card (ferry/portability/release/card.py)
      lineage.json               the pipeline's lineage, as it was recorded (a run's, as its directory records it)
      pipeline.yaml              the pipeline file, when it is still where it ran from (a run has none)
      stages/<name>/
        config.yaml              the stage's resolved run config (what `ferry train` ran)
        run.json metrics.jsonl   its run record and metrics (plus its plots and restart log, when present)
        checkpoints/step-N/      its final checkpoint in the neutral format (its optimizer's state only with
                                 --optimizer)
        source-manifest.json     without --optimizer: the manifest the lineage's digest names, which the
                                 weights-only manifest is checked against file by file
        tokenizer.json           the tokenizer it trained with, so that export, generate and eval need no data
        transformers/            its export, where the architecture has one
        seed-runs/seed-<k>/      with --seed-runs, for a stage that samples its data: runs of its config with other
                                 seeds (config, run record, metrics), the spread its replays are judged against
                                 (seeds.py)
      data/<source>/             every source's manifest.json (the data files too, with --data)
      extras/                    the portability report, bench and cost records found in the pipeline dir

`ferry release verify DIR` (verify.py) checks every digest and the chain; `ferry release replay DIR`
(replay.py) trains a stage's first steps again from the release alone and judges them.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferry.checkpoint.digests import checkpoint_digest
from ferry.checkpoint.format import MANIFEST_NAME, optimizer_kind, seal_manifest
from ferry.config import UserError
from ferry.data.manifest import sha256_file
from ferry.platform.fingerprint import code_version
from ferry.platform.library_logs import LIBRARY_LOG_FILE
from ferry.stages.lineage import LINEAGE_FILE, Lineage
from ferry.stages.runner import CONFIGS_DIR
from ferry.stages.single_run import RUN_KIND, is_run_dir, run_lineage

RELEASE_FILE = "release.json"
RELEASE_FORMAT = "ferry-release"
RELEASE_VERSION = 1
CARD_FILE = "README.md"
SOURCE_MANIFEST = "source-manifest.json"
TOKENIZER_NAME = "tokenizer.json"
OPTIMIZER_GROUP = "optim"
# what a run directory holds beside its checkpoints that a release keeps
_RUN_FILES = ("run.json", "metrics.jsonl", "restarts.jsonl")
# pipeline-directory entries that hold portability, bench and cost records (kept under extras/)
_EXTRA_DIRS = ("report", "reports", "bench", "cost", "rehearsal", "rehearsals", "history", "plots")
_EXTRA_SUFFIXES = (".json", ".jsonl", ".md", ".html", ".png", ".svg", ".csv", ".yaml")
_LICENCE_KEYS = ("licence", "license")

Say = Callable[[str], None]


def stage_dir(name: str) -> str:
    return f"stages/{name}"


def build_release(
    pipeline_dir: str | Path,
    out: str | Path,
    optimizer: bool = False,
    data: bool = False,
    export: bool = True,
    say: Say = print,
) -> dict[str, Any]:
    """Write the release of the finished pipeline (or run) in `pipeline_dir` to `out`; returns its release.json
    content."""
    pipeline_dir, out = Path(pipeline_dir), Path(out)
    is_run = not (pipeline_dir / LINEAGE_FILE).is_file() and is_run_dir(pipeline_dir)
    lineage = run_lineage(pipeline_dir) if is_run else Lineage.read(pipeline_dir)
    unfinished = [stage["name"] for stage in lineage["stages"] if stage["status"] != "finished"]
    if unfinished:
        raise UserError(
            f"{pipeline_dir}: stage(s) {', '.join(unfinished)} have not finished; run the pipeline to the end "
            "before releasing it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not empty; choose a new directory")
    if out.resolve().is_relative_to(pipeline_dir.resolve()):
        raise UserError(f"--out {out} lies inside the pipeline directory {pipeline_dir}; choose a place outside it")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        content = _write(lineage, pipeline_dir, staging, optimizer, data, export, say, out)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return content


def _write(
    lineage: dict[str, Any],
    pipeline_dir: Path,
    out: Path,
    optimizer: bool,
    data: bool,
    export: bool,
    say: Say,
    final: Path,
) -> dict[str, Any]:
    pipeline = dict(lineage["pipeline"])
    is_run = pipeline.get("kind") == RUN_KIND
    if is_run:
        (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2) + "\n", encoding="utf-8")
    else:
        shutil.copy2(pipeline_dir / LINEAGE_FILE, out / LINEAGE_FILE)
    pipeline_file = Path(pipeline["file"])
    if not is_run and pipeline_file.is_file() and sha256_file(pipeline_file) == pipeline["sha256"]:
        shutil.copy2(pipeline_file, out / "pipeline.yaml")
        pipeline["released_file"] = "pipeline.yaml"
    sources = _data(lineage, out, data, say)
    by_path = {source["path"]: source["key"] for source in sources}
    stages = [_stage(record, pipeline_dir, out, optimizer, export, by_path, say, final) for record in lineage["stages"]]
    extras = [] if is_run else _extras(pipeline_dir, lineage, out)
    content: dict[str, Any] = {
        "format": RELEASE_FORMAT,
        "version": RELEASE_VERSION,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "pipeline": pipeline,
        "code": code_version(),
        "optimizer_state": optimizer,
        "data_files": data,
        "stages": stages,
        "data": sources,
        "extras": extras,
    }
    from ferry.portability.release.card import model_card

    (out / CARD_FILE).write_text(model_card(content), encoding="utf-8")
    content["files"] = file_records(out)
    (out / RELEASE_FILE).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return content


def file_records(root: Path) -> dict[str, dict[str, Any]]:
    """Every file under `root` but release.json, by its path relative to `root` (POSIX), with size and sha256."""
    records = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and relative != RELEASE_FILE:
            records[relative] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def _located(recorded: str, pipeline_dir: Path, *tail: str) -> Path:
    """A path the lineage recorded, or the same place under `pipeline_dir` when the directory has moved."""
    path = Path(recorded)
    return path if path.exists() else pipeline_dir.joinpath(*tail)


def _stage(
    record: dict[str, Any],
    pipeline_dir: Path,
    out: Path,
    optimizer: bool,
    export: bool,
    by_path: dict[str, str],
    say: Say,
    final: Path,
) -> dict[str, Any]:
    name = record["name"]
    result = record["result"]
    target = out / stage_dir(name)
    target.mkdir(parents=True)
    run_dir = _located(record["run_dir"], pipeline_dir, name)
    config = pipeline_dir / CONFIGS_DIR / f"{name}.yaml"
    shutil.copy2(config if config.is_file() else run_dir / "config.yaml", target / "config.yaml")
    kept = [file for file in _RUN_FILES if (run_dir / file).is_file()]
    kept += sorted(path.name for path in run_dir.glob("*.png"))
    for file in kept:
        shutil.copy2(run_dir / file, target / file)
    source = _located(result["checkpoint"], pipeline_dir, name, "checkpoints", Path(result["checkpoint"]).name)
    if checkpoint_digest(source) != result["digest"]:
        raise UserError(
            f"stage {name}: its final checkpoint {source} is no longer the one the lineage records (digest "
            f"{result['digest'][:12]}); the pipeline directory changed after the stage finished"
        )
    checkpoint = target / "checkpoints" / source.name
    trained_with = optimizer_kind(
        json.loads((source / MANIFEST_NAME).read_text(encoding="utf-8")).get("train_state", {})
    )
    with_optimizer = _copy_checkpoint(source, checkpoint, optimizer, target / SOURCE_MANIFEST)
    tokenizer = _tokenizer(record, target)
    entry: dict[str, Any] = {
        "name": name,
        "objective": record["config"]["train"]["objective"],
        "start": record["start"],
        "parent": record["parent"],
        "seed": record["seed"],
        "dir": stage_dir(name),
        "config": f"{stage_dir(name)}/config.yaml",
        "files": kept,
        "checkpoint": {
            "path": checkpoint.relative_to(out).as_posix(),
            "step": result["step"],
            "lineage_digest": result["digest"],
            "digest": checkpoint_digest(checkpoint),
            "optimizer": with_optimizer,
            "optimizer_kind": trained_with,
            "source_manifest": None if with_optimizer else f"{stage_dir(name)}/{SOURCE_MANIFEST}",
        },
        "tokenizer": tokenizer,
        "result": {key: result.get(key) for key in ("step", "loss", "eval_loss", "eval")},
        "data": [_data_use(source, by_path) for source in record["data"]],
        "eval_data": [_data_use(source, by_path) for source in record.get("eval_data", [])],
        "world_size": _world_size(run_dir),
    }
    entry["export"] = (
        _export(checkpoint, target / "transformers", out, final) if export else {"skipped": "not asked (--no-export)"}
    )
    say(
        f"ferry: release: stage {name}: step {result['step']} checkpoint"
        f"{f' with {trained_with} state' if with_optimizer else ' (weights)'}; export: "
        f"{entry['export'].get('arch') or entry['export'].get('skipped')}"
    )
    return entry


def _copy_checkpoint(source: Path, target: Path, optimizer: bool, source_manifest: Path) -> bool:
    """Copy the checkpoint; without `optimizer` leave out its optimizer's files and tensors, reseal its manifest and
    keep the original manifest beside it. Returns whether the optimizer's state is in the copy."""
    manifest = json.loads((source / MANIFEST_NAME).read_text(encoding="utf-8"))
    dropped = {file for file in manifest["files"] if file.startswith(f"{OPTIMIZER_GROUP}-")}
    if optimizer or not dropped:
        shutil.copytree(source, target)
        return bool(dropped)
    target.mkdir(parents=True)
    for file in manifest["files"]:
        if file not in dropped:
            shutil.copy2(source / file, target / file)
    shutil.copy2(source / MANIFEST_NAME, source_manifest)
    manifest["files"] = {file: record for file, record in manifest["files"].items() if file not in dropped}
    manifest["tensors"] = {
        name: tensor
        for name, tensor in manifest["tensors"].items()
        if not any(piece["file"] in dropped for piece in tensor["pieces"])
    }
    manifest.get("train_state", {}).pop("optimizer", None)
    if "manifest_sha256" in manifest:
        manifest = seal_manifest(manifest)
    (target / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return False


def _tokenizer(record: dict[str, Any], target: Path) -> str | None:
    """The stage's tokenizer (its first dataset's) beside its checkpoints, where export and generate look."""
    for source in record["data"]:
        path = Path(source["path"]) / TOKENIZER_NAME
        if path.is_file():
            shutil.copy2(path, target / TOKENIZER_NAME)
            return f"{stage_dir(record['name'])}/{TOKENIZER_NAME}"
    return None


def _export(checkpoint: Path, target: Path, out: Path, final: Path) -> dict[str, Any]:
    """The checkpoint as a transformers directory; where that cannot be, why (with the release's own paths)."""
    try:
        from ferry.interop.export import export_checkpoint

        exported = export_checkpoint(checkpoint, target)
    except ImportError as exc:
        return {"skipped": f"transformers is not installed ({exc.name})"}
    except UserError as exc:
        shutil.rmtree(target, ignore_errors=True)
        return {"skipped": str(exc).replace(str(out), str(final))}
    return {"path": target.relative_to(out).as_posix(), "arch": exported.arch, "parameters": exported.parameters}


def _world_size(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["layout"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def _data_use(source: dict[str, Any], by_path: dict[str, str]) -> dict[str, Any]:
    use = {"name": source["name"], "source": by_path.get(source["path"]), "manifest_sha256": source["manifest_sha256"]}
    if "weight" in source:
        use["weight"] = source["weight"]
    return use


def _data(lineage: dict[str, Any], out: Path, files: bool, say: Say) -> list[dict[str, Any]]:
    """Every dataset a stage trained or was evaluated on: its manifest (and files with `files`), under a key
    unique in the release (the source's name, numbered where two sources share one)."""
    sources: dict[str, dict[str, Any]] = {}
    for stage in lineage["stages"]:
        for role, uses in (("train", stage["data"]), ("eval", stage.get("eval_data", []))):
            for use in uses:
                entry = sources.get(use["path"])
                if entry is None:
                    entry = sources[use["path"]] = _source(use, out, files, {s["key"] for s in sources.values()})
                elif entry["manifest_sha256"] != use["manifest_sha256"]:
                    raise UserError(
                        f"data source {use['path']}: stages recorded two manifests for it ({stage['name']} recorded "
                        f"{(use['manifest_sha256'] or '?')[:12]}); one release cannot hold both"
                    )
                entry["used_by"].append({"stage": stage["name"], "role": role, "weight": use.get("weight")})
    if sources:
        how = "with their files" if files else "manifests only (--data to include the files)"
        say(f"ferry: release: {len(sources)} data source(s), {how}")
    return list(sources.values())


def _source(use: dict[str, Any], out: Path, files: bool, taken: set[str]) -> dict[str, Any]:
    path = Path(use["path"])
    key, number = use["name"], 2
    while key in taken:
        key, number = f"{use['name']}-{number}", number + 1
    manifest_path = path / MANIFEST_NAME
    if use["manifest_sha256"] is None:
        raise UserError(f"data source {use['name']} ({path}): the lineage records no manifest digest for it")
    if not manifest_path.is_file() or sha256_file(manifest_path) != use["manifest_sha256"]:
        raise UserError(
            f"data source {use['name']}: {manifest_path} is missing or no longer the manifest the lineage records "
            f"({use['manifest_sha256'][:12]}); release from the data the pipeline trained on"
        )
    target = out / "data" / key
    if files:
        shutil.copytree(path, target, ignore=shutil.ignore_patterns(".*", LIBRARY_LOG_FILE))
    else:
        target.mkdir(parents=True)
        shutil.copy2(manifest_path, target / MANIFEST_NAME)
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    licence = next((manifest[k] for k in _LICENCE_KEYS if k in manifest), None)
    return {
        "key": key,
        "name": use["name"],
        "path": str(path),
        "dir": f"data/{key}",
        "manifest_sha256": use["manifest_sha256"],
        "files_included": files,
        "tokens": manifest.get("total_tokens"),
        "documents": manifest.get("documents"),
        "records": manifest.get("records"),
        "tokenizer_sha256": (manifest.get("tokenizer") or {}).get("sha256"),
        "licence": licence,
        "used_by": [],
    }


def _extras(pipeline_dir: Path, lineage: dict[str, Any], out: Path) -> list[str]:
    """Portability report, bench and cost records in the pipeline directory: its top-level files of those
    kinds and its directories of those names, under extras/."""
    stages = {stage["name"] for stage in lineage["stages"]}
    kept = []
    for entry in sorted(pipeline_dir.iterdir()):
        if entry.name in stages or entry.name in (LINEAGE_FILE, CONFIGS_DIR) or entry.name.startswith("."):
            continue
        target = out / "extras" / entry.name
        if entry.is_file() and entry.suffix in _EXTRA_SUFFIXES:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(entry, target)
        elif entry.is_dir() and entry.name in _EXTRA_DIRS:
            shutil.copytree(entry, target, ignore=shutil.ignore_patterns(".*"))
        else:
            continue
        kept.append(f"extras/{entry.name}")
    return kept

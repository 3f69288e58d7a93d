"""Shared fixtures: a small prepared dataset and a tiny run config that trains in seconds."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ferry.checkpoint.format import MANIFEST_DIGEST, MANIFEST_NAME, seal_manifest
from ferry.config.loader import apply_overrides, validate
from ferry.data import PrepareSpec, prepare_dataset
from ferry.train import RunConfig

REPO = Path(__file__).resolve().parent.parent

TINY_RUN = {
    "run": {"name": "test", "seed": 0, "device": "cpu"},
    "model": {
        "vocab_size": 512,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 64,
        "dense_layers": 1,
        "dense_ffn_dim": 64,
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32},
    },
    "data": {"seq_len": 32},
    "train": {"steps": 6, "global_batch": 8, "micro_batch": 4, "log_every": 1},
    "optim": {"lr": 3e-3, "warmup_steps": 2},
}


def rewrite_manifest(checkpoint: Path, edit: Callable[[dict], None]) -> None:
    """Apply `edit` to a checkpoint's manifest and seal it again, as a writer of that content would have: the
    checks a test aims at see a manifest whose own digest matches. An edit that removes `manifest_sha256` (a
    manifest of an older format version) leaves it unsealed."""
    path = Path(checkpoint) / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(seal_manifest(manifest) if MANIFEST_DIGEST in manifest else manifest))


@pytest.fixture(scope="session")
def stdlib_dataset(tmp_path_factory) -> Path:
    """A BPE dataset (vocabulary 512) from the first ~400 kB of the embedded corpus."""
    output = tmp_path_factory.mktemp("data") / "stdlib"
    prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=400_000, vocab_size=512), output)
    return output


def tiny_config(dataset: Path, run_dir: Path, *overrides: str) -> RunConfig:
    """The tiny RunConfig reading `dataset` and writing to `run_dir`; dotted overrides as in the CLI."""
    raw = apply_overrides(TINY_RUN, [f"run.dir={run_dir}"])
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(dataset)}]
    return validate(RunConfig, apply_overrides(raw, list(overrides)))


@pytest.fixture
def make_config(stdlib_dataset, tmp_path):
    """Build a validated tiny RunConfig; dotted overrides as in the CLI."""

    def build(*overrides: str, run_dir: Path | None = None) -> RunConfig:
        return tiny_config(stdlib_dataset, run_dir or tmp_path / "run", *overrides)

    return build


def rehearse_ep2_to_one(dataset: Path, work: Path, *model_overrides: str) -> tuple[int, dict]:
    """`ferry rehearse` of the tiny run with `model_overrides` from 2 ranks with experts split (cpu-ep2) to one
    process, over a window long enough for a same-hardware verdict; the exit code and the verdict."""
    from ferry.cli.main import main

    raw = apply_overrides(TINY_RUN, list(model_overrides))
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(dataset)}]
    config = work / "run.yaml"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(raw))
    code = main(
        [
            "rehearse",
            str(config),
            "--from",
            "cpu-ep2",
            "--to",
            "cpu",
            "--steps",
            "35",
            "--switch-at",
            "25",
            "--dir",
            str(work / "rehearsal"),
            "--history",
            str(work / "history"),
        ]
    )
    return code, json.loads((work / "rehearsal" / "verdict.json").read_text())

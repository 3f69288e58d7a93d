"""`ferry release --seed-runs`: the seed runs a `sampled` verdict needs, trained by the releaser and carried.

A stage whose objective samples its own data (GRPO) is judged on its reward against the spread between runs that
differ only in their seed (`ferry/portability/tolerances.yaml`, `sampled`). Without them in the release, every
replay trains them first, on the replayer's hardware; with them, a third party's replay is judged against the
spread the releaser measured beside the recorded run, and trains only the replay. They are the stage's recorded
config with the next seeds, started from the release's parent checkpoint, over every recorded step; each keeps its
config, run record and metrics under `stages/<name>/seed-runs/seed-<k>/`, listed and digested like every file.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ferry.config import UserError
from ferry.portability.release.build import RELEASE_FILE, file_records, stage_dir
from ferry.portability.release.replay import stage_inputs, train_seed_runs
from ferry.train.objectives.kinds import SAMPLING_OBJECTIVES

SEED_RUNS_DIR = "seed-runs"
_KEPT = ("config.yaml", "run.json", "metrics.jsonl")

Say = Callable[[str], None]


def carry_seed_runs(out: Path, say: Say) -> list[str]:
    """Train the seed runs of every sampling stage of the release in `out` and add them to it (release.json rewritten
    with them); returns the stages that got them. All are trained before any is added: a run that fails leaves the
    release as it was, still verifying."""
    content = json.loads((out / RELEASE_FILE).read_text(encoding="utf-8"))
    sampling = [entry for entry in content["stages"] if entry["objective"] in SAMPLING_OBJECTIVES]
    with tempfile.TemporaryDirectory(prefix="ferry-release-seeds-") as scratch:
        trained = {}
        for entry in sampling:
            work = Path(scratch) / entry["name"]
            base, overrides, count = stage_inputs(out, content, entry, None, work / "unused")
            say(
                f"ferry: release: stage {entry['name']}: objective {entry['objective']} samples its training data; "
                f"training the seed runs its replays are judged against ({count} steps each)"
            )
            runs, failure = train_seed_runs(base, overrides, entry, count, work, say)
            if failure is not None:
                raise UserError(f"release --seed-runs: stage {entry['name']}: {failure}; the release is unchanged")
            trained[entry["name"]] = runs
        for entry in sampling:
            entry["seed_runs"] = [_keep(run, out, entry["name"]) for run in trained[entry["name"]]]
    content["files"] = file_records(out)
    (out / RELEASE_FILE).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return [entry["name"] for entry in sampling]


def _keep(run: Path, out: Path, stage: str) -> str:
    relative = f"{stage_dir(stage)}/{SEED_RUNS_DIR}/{run.name}"
    target = out / relative
    target.mkdir(parents=True)
    for name in _KEPT:
        if (run / name).is_file():
            shutil.copy2(run / name, target / name)
    return relative

"""`--rerun STAGE`: the stages to run again are set aside, not deleted, until the first of them gets going.

A rerun whose first stage refuses its input (a typo in a data path) or cannot start (its parent is gone)
would otherwise have deleted finished stages for nothing, and left the later ones marked finished on a
parent that no longer exists. Their directories move to `DIR/.replaced/<time>/` and their lineage records
are held; they come back, in their places, when the rerun does not get going, and are deleted once it
does. A stage's cached reference log-probs are copied into its new directory: they are keyed by the parent
checkpoint and the data, so a rerun from an unchanged parent reuses them.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.stages.lineage import Lineage

REPLACED_DIR = ".replaced"
IMPORTS_DIR = "imports"
KEPT_ON_RERUN = ("reference-cache",)


@dataclass
class SetAside:
    """Stages moved out of the way of a rerun: where their directories went and their lineage records."""

    directory: Path
    aside: Path
    pipeline: dict[str, Any]  # the lineage's pipeline (file, digest) before the rerun
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def stages(cls, directory: Path, names: list[str], lineage: Lineage) -> SetAside:
        aside = directory / REPLACED_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-{time.monotonic_ns()}"
        held = cls(directory, aside, lineage.recorded_pipeline)
        for name in names:
            for relative in (Path(name), Path(IMPORTS_DIR) / name):
                if (directory / relative).exists():
                    (aside / relative).parent.mkdir(parents=True, exist_ok=True)
                    (directory / relative).rename(aside / relative)
            for kept in KEPT_ON_RERUN:
                if (aside / name / kept).is_dir():
                    shutil.copytree(aside / name / kept, directory / name / kept)
            if name in lineage.stages:
                held.records[name] = lineage.stages[name]
                lineage.forget(name)
        return held

    def restore(self, lineage: Lineage) -> None:
        """Put every stage back as it was; what the rerun wrote in their places is removed."""
        for relative in sorted(path.relative_to(self.aside) for path in self._moved()):
            shutil.rmtree(self.directory / relative, ignore_errors=True)
            (self.aside / relative).rename(self.directory / relative)
        lineage.pipeline = self.pipeline
        lineage.stages.update(self.records)
        lineage.save()
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)
        if self.aside.parent.is_dir() and not any(self.aside.parent.iterdir()):
            self.aside.parent.rmdir()

    def _moved(self) -> list[Path]:
        if not self.aside.is_dir():
            return []
        stages = [path for path in self.aside.iterdir() if path.name != IMPORTS_DIR]
        imports = list((self.aside / IMPORTS_DIR).iterdir()) if (self.aside / IMPORTS_DIR).is_dir() else []
        return stages + imports

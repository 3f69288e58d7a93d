"""Environments as data: what changes when a run moves, in one small YAML file.

An environment names a device, hardware profile, kernel policy, precision, collective
backend and layout (local ranks, `parallel.*`, ZeRO) as dotted overrides laid over a
run config, plus the number of local ranks to start:

    name: cpu-ep2
    nproc: 2
    overrides:
      parallel.ep: 2
      optim.zero: true

`--from` / `--to` take a file path or the name of a file in `configs/environments/`.
An environment says everything it means: the shipped ones set every key that
defines them, so that two environments differ exactly where a move changes something,
whatever the run config they are laid over.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import Field

from ferry.config import ConfigError, Section, UserError, apply_override_mapping
from ferry.config.loader import validate
from ferry.config.named import named_files, read_named_yaml
from ferry.portability.comparison.tolerances import SAMPLED_PROFILE, tolerance_profile
from ferry.train.config import RunConfig
from ferry.train.objectives.kinds import SAMPLING_OBJECTIVES

ENVIRONMENTS_DIR = Path("configs") / "environments"

# Keys whose change leaves the numbers a run computes the same up to summation order: the
# layout, the kernels and the collectives. A move that changes only these is judged under
# `same-hardware`; any other change (device, hardware profile, precision) under `cross-accelerator`.
LAYOUT_KEYS = ("parallel.", "optim.zero", "train.micro_batch", "kernels.", "comm.", "checkpoint.")


class Environment(Section):
    """One place a run can live: local ranks and the config keys that differ there."""

    name: str = Field(min_length=1)
    description: str = ""
    nproc: int = Field(1, ge=1, description="local ranks to start (as torchrun --nproc-per-node)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted config keys and their values")
    path: str = Field("", description="the file it was read from (not written in the file)")

    def run_config(
        self,
        base: dict[str, Any],
        *overrides: dict[str, Any],
        by: str = "the rehearsal",
    ) -> RunConfig:
        """`base` (a resolved run config as plain data) with this environment and then `overrides`, the settings
        the procedure (`by`: a rehearsal's leg, a replay) owns, laid over it.

        A key the run config does not have, or a value it does not accept, is a `ConfigError`
        naming this environment's file; so is a key of the environment that the procedure sets itself, which
        would otherwise be dropped without a word.
        """
        try:
            raw = apply_override_mapping(base, self.overrides, self.label)
            for extra in overrides:
                self._refuse_overridden(extra, by)
                raw = apply_override_mapping(raw, extra, by)
            config = validate(RunConfig, raw)
        except ConfigError as exc:
            raise ConfigError(f"environment {self.label}: {exc}") from None
        return config

    def with_overrides(self, overrides: dict[str, Any], origin: str) -> Environment:
        """This environment with more dotted keys laid over its own (a command line's), named as such."""
        if not overrides:
            return self
        merged = {**self.overrides, **overrides}
        return self.model_copy(update={"name": f"{self.name} + {origin}", "overrides": merged})

    def _refuse_overridden(self, procedure: dict[str, Any], by: str) -> None:
        for key in self.overrides:
            taken = [other for other in procedure if _overlap(str(key), str(other))]
            if taken:
                raise ConfigError(
                    f"it sets {key}, which {by} sets itself ({', '.join(sorted(taken))}): the environment's value "
                    "would be ignored; remove it from the environment"
                )

    @property
    def label(self) -> str:
        return f"{self.name} ({self.path})" if self.path else self.name

    def as_record(self) -> dict[str, Any]:
        """What the rehearsal history keeps of it: the definition and its digest."""
        return {
            "name": self.name,
            "description": self.description,
            "nproc": self.nproc,
            "overrides": self.overrides,
            "path": self.path,
            "digest": self.digest,
        }

    @property
    def digest(self) -> str:
        """sha256 of the definition (name, ranks, overrides): two rehearsals of one path used the same one."""
        canonical = json.dumps([self.name, self.nproc, self.overrides], sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()


def _overlap(key: str, other: str) -> bool:
    """Whether two dotted keys set the same value or one sets a section holding the other."""
    return key == other or key.startswith(f"{other}.") or other.startswith(f"{key}.")


def known_environments() -> dict[str, Path]:
    """Every environment file by name; a name here shadows the same name in ferry's checkout."""
    return named_files(ENVIRONMENTS_DIR)


def load_environment(spec: str) -> Environment:
    """An environment from a file path or the name of a file in `configs/environments/`."""
    path, raw = read_named_yaml(spec, ENVIRONMENTS_DIR, "environment")
    if "path" in raw:
        raise UserError(
            f"environment file {str(path)!r}: unknown key 'path' (known: name, description, nproc, overrides)"
        )
    try:
        return validate(Environment, {"name": path.stem, **raw, "path": str(path)})
    except ConfigError as exc:
        raise ConfigError(f"environment file {str(path)!r}: {exc}") from None


def judging_profile(source: RunConfig, source_nproc: int, target: RunConfig, target_nproc: int) -> tuple[str, str]:
    """The tolerance profile a move is judged under, chosen before it runs, and why.

    An objective that draws its own training data (GRPO): `sampled`, whatever changed, since
    no per-step yardstick holds once the runs' rollouts part. Otherwise, only the layout,
    kernels or collectives changed: the numbers differ by summation order, `same-hardware`.
    Anything else (device, hardware profile, precision, seed, optimizer): `cross-accelerator`.
    Where runs are written, where their datasets lie and what they evaluate on held-out data do not count.
    """
    if source.train.objective in SAMPLING_OBJECTIVES:
        return SAMPLED_PROFILE, (
            f"objective {source.train.objective} draws its own training data: judged on its "
            f"{tolerance_profile(SAMPLED_PROFILE).metric} against the spread between seeds"
        )
    differing = sorted(_differing_keys(_training(source), _training(target)))
    other = [key for key in differing if not key.startswith(LAYOUT_KEYS)]
    if other:
        return "cross-accelerator", f"the environments differ in {', '.join(other[:6])}"
    changed = differing + (["nproc"] if source_nproc != target_nproc else [])
    if not changed:
        return "same-hardware", "the environments do not differ"
    return "same-hardware", f"only layout, kernels or collectives differ: {', '.join(changed[:6])}"


def _training(config: RunConfig) -> dict[str, Any]:
    """What of a run config decides the numbers it trains: no locations, and no held-out evaluation, which reads
    the weights and never changes them (a layout that cannot run it runs without)."""
    settings = without_locations(config.model_dump(mode="json"))
    settings.pop("eval", None)
    return settings


def _differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = []
        for key in set(a) | set(b):
            keys += _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return keys
    return [] if a == b else [prefix.rstrip(".")]


def without_locations(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved run config as plain data, less what only says where things lie: run.dir, run.overwrite,
    resume and the datasets' paths (their content is checked by digest, wherever they are)."""
    kept = copy.deepcopy({key: value for key, value in resolved.items() if key != "resume"})
    kept["run"] = {key: value for key, value in kept.get("run", {}).items() if key not in ("dir", "overwrite")}
    for source in kept.get("data", {}).get("sources", []):
        source.pop("path", None)
    return kept

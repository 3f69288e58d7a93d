"""`ferry bench SUITE`: the standard measurement of one suite on this machine, as one JSON record.

The suite's tokens are generated from its seed and written as a dataset in the
prepared format; the trainer then runs the suite's steps exactly as `ferry train`
would (N local ranks, the selected kernels, the precision of the hardware profile),
saving no checkpoint. The first `warmup_steps` are left out; the record holds the
medians and the spread (min, max) of every step figure over the measured steps,
what ran where (fingerprint, kernels, precision, hardware profile and its price),
and the two digests that say whether two records measured the same thing: the
suite's definition (`suite_digest`) and its input values (`input_digest`: every
token of every step as the loader hands it over, and the initial weights).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from ferry.config import UserError
from ferry.data import MixedLoader
from ferry.data.synthetic import write_synthetic_dataset
from ferry.metrics.jsonl import read_metrics
from ferry.portability.bench.suites import BenchSuite, check_fits, load_suite, workload_digest
from ferry.portability.comparison.environment import Environment
from ferry.portability.rehearsal.conditions import UNDER_LOAD, describe_conditions, fairness
from ferry.portability.rehearsal.legs import run_leg
from ferry.train.config import RunConfig

RECORD_KIND = "ferry-bench"
RECORD_VERSION = 1
# step figures summarised over the measured steps: name in the record -> key of metrics.jsonl
FIGURES = {
    "tokens_per_s": "tokens_per_s",
    "tokens_per_s_per_device": "tokens_per_s_per_device",
    "mfu": "mfu",
    "step_s": "step_s",
    "forward_s": "forward_s",
    "backward_s": "backward_s",
    "optimizer_s": "optimizer_s",
    "compute_s": "compute_s",
    "comm_s": "comm_s",
    "ep_wait_s": "ep_wait_s",
    "comm_compute_ratio": "comm_compute_ratio",
    "mem_peak_mib": "mem_peak_mib",
    "comm_bytes_per_step": "comm_bytes",
}


class BenchError(Exception):
    """The measurement ran and failed (a rank crashed): no record; exit code 1."""


def run_bench(
    suite_spec: str,
    overrides: list[str] = (),
    *,
    out: str | Path,
    device: str | None = None,
    nproc: int | None = None,
    work_dir: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Measure `suite_spec` here and write its record to `out`; returns the record."""
    suite = load_suite(suite_spec)
    nproc = suite.nproc if nproc is None else nproc
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    out = Path(out)
    if out.is_dir() or (out.parent.exists() and not out.parent.is_dir()):
        raise UserError(f"--out {str(out)!r} cannot be written: name a JSON file in a directory")
    if out.exists():
        raise UserError(
            f"--out {str(out)!r} already holds a record, which a new measurement does not replace; name another file"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    work = Path(work_dir) if work_dir is not None else Path("runs") / "bench" / f"{suite.name}-{stamp}"
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise UserError(f"bench directory {str(work)!r} is not an empty directory; choose another --dir")
    config = suite.run_config(work, device or suite.device, list(overrides))
    micro_batch = 1 if config.train.micro_batch == "auto" else config.train.micro_batch  # auto takes one that fits
    if config.train.global_batch % (micro_batch * nproc):
        raise UserError(
            f"suite {suite.name}: train.global_batch ({config.train.global_batch}) is not a multiple of "
            f"train.micro_batch x ranks ({config.train.micro_batch} x {nproc}); change --nproc or the batch"
        )
    if nproc % config.parallel.ep:
        raise UserError(
            f"suite {suite.name}: parallel.ep ({config.parallel.ep}) does not divide the {nproc} rank(s); change "
            "--nproc or parallel.ep"
        )
    estimate = check_fits(suite, config, nproc)
    tokens_needed = config.train.global_batch * config.data.seq_len * suite.total_steps + 1
    write_synthetic_dataset(work / "data", suite.seed, config.model.vocab_size, tokens_needed, suite.zipf_exponent)
    tokens_digest = input_tokens_digest(config, suite.total_steps)
    say(
        f"ferry: bench {suite.name} v{suite.version} ({suite.digest[:12]}) on {config.run.device} x {nproc}: "
        f"{suite.warmup_steps} warm-up + {suite.measured_steps} measured steps; memory estimate "
        f"{estimate.total_bytes / 2**30:.2f} GiB per rank"
    )
    layout = Environment(name=suite.name, nproc=nproc)
    leg = run_leg("bench", layout, config, work, say, steps=suite.total_steps)
    if not leg.ok:
        raise BenchError(f"the measurement of {suite.name} failed:\n    {leg.failure()}")
    record = bench_record(suite, config, overrides, nproc, leg.record, read_metrics(leg.run_dir), tokens_digest)
    record["wall_s"] = leg.wall_s
    record["conditions"] = leg.conditions()
    record["run_dir"] = str(leg.run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    staging.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(staging, out)
    for line in summary_lines(record):
        say(line)
    say(f"ferry: wrote {out}")
    return record


def input_tokens_digest(config: RunConfig, steps: int) -> str:
    """sha256 of every global batch the loader hands the trainer, in step order (what every rank reads from)."""
    loader = MixedLoader(config.data, seed=config.run.seed, global_batch=config.train.global_batch)
    cursor = loader.new_cursor()
    digest = hashlib.sha256()
    for _ in range(steps):
        digest.update(loader.global_batch_at(cursor).astype("<i8").tobytes())
        cursor = loader.advance(cursor)
    return digest.hexdigest()


def bench_record(
    suite: BenchSuite, config: RunConfig, overrides, nproc: int, run: dict, metrics: list[dict], tokens_digest: str
) -> dict:
    """The record of one measurement from the run's manifest and its per-step metrics.

    Refused without the digest of the initial weights: the trainer leaves it out when the run did not start
    from the suite's seed (init_from), and an input digest over "None" would match every such run whatever
    weights it started from.
    """
    measured = [record for record in metrics if record["step"] > suite.warmup_steps]
    if len(measured) < suite.measured_steps:
        raise BenchError(f"the run recorded {len(measured)} measured steps of {suite.measured_steps}")
    weights = run.get("initial_weights_xxh3")
    if not isinstance(weights, str) or not weights:
        raise BenchError(
            f"the run of {suite.name} recorded no digest of its initial weights (initial_weights_xxh3 in run.json "
            f"is {weights!r}): it did not start from the suite's seed, so its inputs cannot be compared"
        )
    spread = {name: _spread([record.get(key) for record in measured]) for name, key in FIGURES.items()}
    hardware = run.get("hardware", {})
    return {
        "kind": RECORD_KIND,
        "version": RECORD_VERSION,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "suite": suite.name,
        "suite_version": suite.version,
        "suite_digest": suite.digest,
        "input_digest": hashlib.sha256(f"{tokens_digest}:{weights}".encode()).hexdigest(),
        "workload_digest": workload_digest(config),
        "tokens_digest": tokens_digest,
        "weights_digest": weights,
        "overrides": list(overrides),
        "device": run.get("environment", {}).get("device_type"),
        "nproc": nproc,
        "layout": run.get("layout"),
        "warmup_steps": suite.warmup_steps,
        "measured_steps": len(measured),
        "tokens_per_step": config.train.global_batch * config.data.seq_len,
        **{name: values["median"] for name, values in spread.items()},
        "spread": spread,
        "model_size": run.get("model_size"),
        "kernels": run.get("kernels"),
        "precision": run.get("precision"),
        "hardware": hardware,
        "environment": run.get("environment"),
    }


def _spread(values: list) -> dict:
    numbers = [value for value in values if isinstance(value, (int, float))]
    if not numbers:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(numbers), "min": min(numbers), "max": max(numbers)}


def summary_lines(record: dict) -> list[str]:
    """The record as the console shows it: a throughput measured under load is called not a fair figure where
    it is printed, and the conditions it was measured under follow (ferry/portability/rehearsal/conditions.py)."""
    spread = record["spread"]
    tps = spread["tokens_per_s"]
    conditions = record.get("conditions")
    unfair = " (measured under load: not a fair figure)" if fairness(conditions) == UNDER_LOAD else ""
    lines = [
        f"ferry: {record['suite']} on {record['device']} x {record['nproc']}: {tps['median']:,.0f} tokens/s "
        f"(min {tps['min']:,.0f}, max {tps['max']:,.0f}){unfair}, {record['tokens_per_s_per_device']:,.0f} per "
        f"device, MFU {_percent(record['mfu'])} of the {record['hardware'].get('profile')} peak",
        f"  conditions: {describe_conditions(conditions)}",
        f"  step {record['step_s'] * 1e3:.1f} ms: forward {record['forward_s'] * 1e3:.1f}, backward "
        f"{record['backward_s'] * 1e3:.1f}, optimizer {record['optimizer_s'] * 1e3:.1f}; compute "
        f"{record['compute_s'] * 1e3:.1f}, communication {record['comm_s'] * 1e3:.1f} (EP wait "
        f"{record['ep_wait_s'] * 1e3:.1f}), comm/compute {_number(record['comm_compute_ratio'])}",
        f"  peak memory {_number(record['mem_peak_mib'], ',.0f')} MiB, {_number(record['comm_bytes_per_step'], ',.0f')}"
        f" bytes to collectives per step; input {record['input_digest'][:12]}, suite {record['suite_digest'][:12]}",
    ]
    return lines


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _number(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)

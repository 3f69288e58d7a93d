"""Training runs executed on spawned ranks by tests/test_distributed_training.py."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY_RUN

from ferry.config.loader import apply_overrides, validate
from ferry.train import RunConfig, Trainer


def tiny_config(dataset: str, run_dir: str, *overrides: str) -> RunConfig:
    raw = apply_overrides(
        TINY_RUN, [f"run.dir={run_dir}", "train.steps=10", "checkpoint.interval=5", "checkpoint.keep=5"]
    )
    raw["data"]["sources"] = [{"name": "stdlib", "path": dataset}]
    return validate(RunConfig, apply_overrides(raw, list(overrides)))


def train_run(dataset: str, run_dir: str, *overrides: str) -> dict:
    """Train on every rank; rank 0, which writes the metrics records, returns them (another rank may finish
    while rank 0 still writes the last)."""
    trainer = Trainer(tiny_config(dataset, run_dir, *overrides))
    result = trainer.fit()
    rank = trainer.parts.job.rank
    metrics = (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    return {"losses": result.losses, "records": [json.loads(line) for line in metrics], "rank": rank}


def train_counting_exchanges(dataset: str, run_dir: str, *overrides: str) -> dict:
    """`train_run`, counting the all-to-alls that reach the process group (below any recompute's cache)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountExchanges(TorchDispatchMode):
        issued = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.alltoall_base_.default:
                CountExchanges.issued += 1
            return func(*args, **(kwargs or {}))

    with CountExchanges():
        result = train_run(dataset, run_dir, *overrides)
    return {**result, "exchanges": CountExchanges.issued}


def train_recording_overlap(dataset: str, run_dir: str, *overrides: str) -> dict:
    """`train_run`, recording in order each asynchronous exchange's issue and completion and each attention's
    forward: what ran while an exchange was in flight, whatever the timings."""
    from ferry.comm.pending import PendingAllToAll
    from ferry.model.attention import Attention

    events: list[tuple[str, int]] = []
    issue, complete, attend = PendingAllToAll.issue, PendingAllToAll.complete, Attention.forward

    def issuing(self, x_RX):
        events.append((f"issue {self.op}", id(self)))
        return issue(self, x_RX)

    def completing(self):
        events.append((f"complete {self.op}", id(self)))
        return complete(self)

    def attending(self, *args, **kwargs):
        events.append(("attention", 0))
        return attend(self, *args, **kwargs)

    PendingAllToAll.issue, PendingAllToAll.complete, Attention.forward = issuing, completing, attending
    try:
        result = train_run(dataset, run_dir, *overrides)
    finally:
        PendingAllToAll.issue, PendingAllToAll.complete, Attention.forward = issue, complete, attend
    return {**result, "events": events}


def train_counting_orthogonalised(dataset: str, run_dir: str, *overrides: str) -> dict:
    """`train_run`, counting the matrices this rank's Muon orthogonalises (a stack of experts counts each)."""
    import math

    from ferry.parallel import muon_fsdp
    from ferry.parallel.optimizers import muon

    counted = {"matrices": 0}
    original = muon.orthogonalise

    def counting(update, steps, dtype):
        counted["matrices"] += math.prod(update.shape[:-2])
        return original(update, steps, dtype)

    muon.orthogonalise = muon_fsdp.orthogonalise = counting
    try:
        result = train_run(dataset, run_dir, *overrides)
    finally:
        muon.orthogonalise = muon_fsdp.orthogonalise = original
    return {**result, **counted}


def train_reporting_failure(dataset: str, run_dir: str, *overrides: str) -> dict:
    """`train_run`, returning the error that ended it on this rank (its type and message) instead of raising."""
    try:
        return {**train_run(dataset, run_dir, *overrides), "error": None}
    except Exception as exc:  # the test reads every rank's
        return {"error": f"{type(exc).__name__}: {exc}", "exit_code": getattr(exc, "exit_code", None)}


def kept_by_a_forward(dataset: str, run_dir: str, seq_len: int, *overrides: str) -> dict:
    """What one training forward of the tiny model (4 rows of `seq_len` random tokens, packed documents) keeps for
    its backward on this rank, measured as the activation-checkpointing tests measure it; and the bytes the
    forward and backward handed to the context-parallel exchanges."""
    import torch

    from ferry.metrics.kept_memory import KeptMemory
    from ferry.model.head_loss import HeadTargets

    raw = apply_overrides(TINY_RUN, [f"run.dir={run_dir}", f"model.max_seq_len={seq_len}", f"data.seq_len={seq_len}"])
    raw["data"]["sources"] = [{"name": "stdlib", "path": dataset}]
    trainer = Trainer(validate(RunConfig, apply_overrides(raw, list(overrides))))
    model, plan = trainer.parts.model.model, trainer.parts.model.plan
    generator = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(1, 512, (4, seq_len), generator=generator)
    document_ids_BS = (torch.rand(4, seq_len, generator=generator) < 1 / 200).long().cumsum(dim=1)
    plan.stats.take()
    with KeptMemory() as kept:
        output = model(tokens_BS, document_ids_BS=document_ids_BS, targets=HeadTargets(tokens_BS, 256))
        loss = output.head_loss.lm_loss_sum
    kept_bytes = kept.kept_bytes()
    loss.backward()
    exchanged = plan.stats.take()
    return {"kept": kept_bytes, "cp_bytes": {op: stats.bytes for op, stats in exchanged.items()}}


def train_counting_bytes(dataset: str, run_dir: str, *overrides: str) -> dict:
    """`train_run`, keeping the calls and bytes of each of ferry's collectives in the last step, by op, on this
    rank; with the run's config."""
    from ferry.comm.stats import CommStats

    taken: list[dict] = []
    take = CommStats.take

    def keeping(self):
        result = take(self)
        taken.append({op: (stats.calls, stats.bytes) for op, stats in result.items()})
        return result

    CommStats.take = keeping
    try:
        result = train_run(dataset, run_dir, *overrides)
    finally:
        CommStats.take = take
    return {
        **result,
        "last_step": taken[-1],
        "config": tiny_config(dataset, run_dir, *overrides).model_dump(mode="json"),
    }


def train_holding_exporter(dataset: str, run_dir: str, gate: str, *overrides: str) -> dict:
    """`train_run` whose rank 0, once its Prometheus exporter serves the last step's record, writes `gate/served`
    and holds the exporter up until `gate/release` appears: a scraper then sees every series the run exports,
    however quick the run (`tests/test_prometheus_scrape.py`)."""
    import time

    from ferry.metrics.prometheus import PrometheusSink

    last_step = tiny_config(dataset, run_dir, *overrides).train.steps
    write = PrometheusSink.write

    def holding(self, record: dict) -> None:
        write(self, record)
        if record.get("step") == last_step:
            (Path(gate) / "served").touch()
            waited = 0.0
            while not (Path(gate) / "release").exists():
                if waited > 120:
                    raise TimeoutError(f"{gate}/release did not appear within 120 s")
                time.sleep(0.05)
                waited += 0.05

    PrometheusSink.write = holding
    try:
        return train_run(dataset, run_dir, *overrides)
    finally:
        PrometheusSink.write = write

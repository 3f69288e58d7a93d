"""Sinks and outputs of the step record: JSONL, Prometheus over loopback, TensorBoard, the hub, docs/metrics.md,
and `ferry plot` (the Grafana dashboard: tests/test_dashboard.py)."""

import argparse
import json
import re
import socket
import sys
import urllib.request

import pytest
import torch
from conftest import REPO

from ferry.cli.metrics import add_metrics_commands
from ferry.comm import CommStats, tier_figures
from ferry.config import UserError
from ferry.inference import SourceLoss, eval_record
from ferry.metrics import (
    METRICS,
    METRICS_FILE,
    MetricsConfig,
    PrometheusConfig,
    StepMetrics,
    StepTimes,
    build_sinks,
    moe_diagnostics,
    prometheus_names,
    read_metrics,
)
from ferry.metrics.plots import plot_run
from ferry.metrics.prometheus import PrometheusSink

LAYERS, EXPERTS = 2, 4


def full_record(step: int) -> dict:
    """A record as the wired trainer writes it: its own keys, then timing and MoE keys from ferry.metrics."""
    metrics = StepMetrics(torch.device("cpu"), world_size=2, flops_per_token=1e6, peak_flops=1e12)
    times = StepTimes(
        step_s=0.5, forward_s=0.15, backward_s=0.25, optimizer_s=0.05, comm_s=0.08, ep_wait_s=0.05, blocked_s=0.1
    )
    hot = step % EXPERTS
    counts_LE = torch.tensor([[40 if e == hot else 20 for e in range(EXPERTS)]] * LAYERS)
    probs_LE = torch.full((LAYERS, EXPERTS), 1 / EXPERTS)
    exchanged = CommStats()
    exchanged.record("ep_dispatch", 3072, 0.02, tier_bytes={"intra_node": 1024, "inter_node": 2048}, tier="inter_node")
    return {
        "step": step,
        "loss": 6.0 / step,
        "lm_loss": 5.9 / step,
        "token_accuracy": 0.25,
        "trained_share": 1.0,
        "aux_loss": 1.01,
        "z_loss": 0.3,
        "lr": 1e-3,
        "grad_norm": 0.8,
        "tokens": step * 1024,
        **metrics.record(times, tokens=1024),
        "comm_bytes": 4096 * step,
        "ep_comm_s": 0.08,
        "ep_exchanges": 24,
        **tier_figures(exchanged.take()),
        "ep_overlap_share": 0.375,
        "optimizer_state_mib": 12.5,
        "loss_scale": 1.0,
        "skipped_steps": 0,
        "checkpoint.blocked_s": 0.0,
        "checkpoint.write_s": 0.0,
        "checkpoint.failed_saves": 0,
        "checkpoint_interval_steps": 10,
        "goodput": 0.9,
        "lost_steps": 2,
        "loading_s": 0.4,
        "restarting_s": 3.5,
        **moe_diagnostics(counts_LE, probs_LE, torch.tensor([1.2, 1.3]), ep_degree=2),
        **eval_record({"held_out": SourceLoss(loss=3.25, tokens=4096)}),
        **OBJECTIVE_KEYS,
        **PIPELINE_KEYS,
        **OPT_IN_KEYS,
    }


# what DPO and GRPO steps add (a record holds one objective's keys; the sinks must know them all)
OBJECTIVE_KEYS = {
    "rewards/chosen": 0.2,
    "rewards/rejected": -0.1,
    "rewards/margin": 0.3,
    "rewards/accuracy": 0.75,
    "logps/chosen": -2.0,
    "logps/rejected": -3.5,
    "reward": 0.6,
    "reward_std": 0.4,
    "solve_rate": 0.6,
    "kl": 0.01,
    "clip_fraction": 0.02,
    "completion_length": 2.5,
    "filtered_groups": 0.25,
    "eval/rewards/accuracy": {"held_out": 0.8},
    "eval/rewards/margin": {"held_out": 1.2},
    "eval/solve_rate": {"held_out": 0.7},
    "eval/greedy_solve_rate": {"held_out": 0.8},
}


# what a pipeline-parallel run's steps add
PIPELINE_KEYS = {
    "pp.bubble": 0.2,
    "pp.schedule_s": 0.35,
    "pp.stage_busy_s": [0.28, 0.3],
    "pp.stage_mem_peak_mib": [410.5, 398.0],
}


# what a run that tracks its attention logits adds (metrics.attn_max_logit, optim.muon.qk_clip), and a
# context-parallel run (parallel.cp)
OPT_IN_KEYS = {
    "mtp.loss": {"1": 3.5, "2": 3.9},
    "attn.max_logit": 12.5,
    "attn.clipped_heads": 2,
    "cp.comm_s": 0.02,
    "cp.bytes": 2_097_192,
    "tracker_failures": 0,
}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_every_record_key_is_in_the_metric_table():
    assert set(full_record(1)) == {metric.key for metric in METRICS}


def test_prometheus_serves_the_documented_names_over_loopback():
    record = full_record(3)
    sink = PrometheusSink(PrometheusConfig(enabled=True, port=0), run_name="demo")
    try:
        assert sink.port > 0
        sink.write(record)
        text = scrape(f"http://127.0.0.1:{sink.port}/metrics")
    finally:
        sink.close()
    served = set(re.findall(r"^(ferry_\w+)\{", text, flags=re.MULTILINE))
    assert served == prometheus_names()
    assert 'ferry_loss{run="demo"} 2.0' in text
    assert 'ferry_moe_expert_tokens{expert="3",layer="1",run="demo"} 40.0' in text
    assert 'ferry_moe_layer_imbalance{layer="0",run="demo"}' in text
    assert 'ferry_eval_loss{run="demo",source="held_out"} 3.25' in text
    memory = re.search(r'^ferry_memory_peak_bytes\{run="demo"\} (\S+)$', text, flags=re.MULTILINE)
    assert float(memory.group(1)) == pytest.approx(record["mem_peak_mib"] * 2**20)


def test_prometheus_binds_loopback_by_default():
    sink = PrometheusSink(PrometheusConfig(enabled=True, port=0), run_name="demo")
    try:
        assert sink._server.server_address[0] == "127.0.0.1"
    finally:
        sink.close()


def test_a_busy_prometheus_port_names_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match="metrics.sinks.prometheus.port"):
            PrometheusSink(PrometheusConfig(enabled=True, port=port), run_name="demo")


def test_a_busy_prometheus_port_is_refused_before_the_earlier_run_is_replaced(make_config, tmp_path):
    from ferry.train import Trainer

    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=1", run_dir=run_dir)).fit()
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = (
            "run.overwrite=true",
            "metrics.sinks.prometheus.enabled=true",
            f"metrics.sinks.prometheus.port={port}",
        )
        with pytest.raises(UserError, match="metrics.sinks.prometheus.port"):
            Trainer(make_config("train.steps=1", *served, run_dir=run_dir)).fit()
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before
    assert (run_dir / "checkpoints" / "step-00000001").is_dir()


def test_docs_name_every_metric_and_its_record_key():
    docs = (REPO / "docs" / "metrics.md").read_text()
    for metric in METRICS:
        assert f"`{metric.prometheus}`" in docs, metric.prometheus
        assert f"`{metric.key}`" in docs, metric.key


def test_hub_sends_one_record_to_every_sink_on_rank_zero_only(tmp_path):
    pytest.importorskip("tensorboard")
    config = MetricsConfig.model_validate(
        {"sinks": {"console": False, "prometheus": {"enabled": True, "port": 0}, "tensorboard": {"enabled": True}}}
    )
    quiet = build_sinks(config, tmp_path / "other", rank=1, run_name="r", total_steps=2, log_every=1)
    quiet.write(full_record(1))
    quiet.message("not printed")
    quiet.close()
    assert not (tmp_path / "other").exists()

    records = [full_record(step) for step in (1, 2)]
    hub = build_sinks(config, tmp_path, rank=0, run_name="r", total_steps=2, log_every=1)
    try:
        for record in records:
            hub.write(record)
        text = scrape(f"http://127.0.0.1:{hub.prometheus.port}/metrics")
    finally:
        hub.close()
    assert read_metrics(tmp_path) == records
    assert 'ferry_step{run="r"} 2.0' in text
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_missing_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    config = MetricsConfig.model_validate({"sinks": {"console": False, "tensorboard": {"enabled": True}}})
    with pytest.raises(UserError, match=r"ferry-moe\[tensorboard\]"):
        build_sinks(config, tmp_path, rank=0, run_name="r", total_steps=1, log_every=1)


def test_console_sink_prints_progress_and_messages(tmp_path, capsys):
    hub = build_sinks(MetricsConfig(), tmp_path, rank=0, run_name="r", total_steps=2, log_every=1)
    hub.message("ferry: hello")
    hub.write(full_record(1))
    hub.close()
    out = capsys.readouterr().out
    assert "ferry: hello" in out and "step      1/2" in out and "mfu" in out


def test_read_metrics_ignores_a_cut_last_line_and_refuses_damage(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(UserError, match="line 1"):
        read_metrics(path)
    with pytest.raises(UserError, match="neither a run directory"):
        read_metrics(tmp_path / "missing")


def write_run(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def test_plot_writes_every_png(tmp_path):
    run = write_run(tmp_path / "run", [full_record(step) for step in range(1, 9)])
    result = plot_run(run)
    assert [path.name for path in result.written] == ["loss.png", "throughput.png", "time_split.png", "expert_load.png"]
    for path in result.written:
        assert path.parent == run / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not result.skipped


def test_plot_skips_with_the_reason_a_plot_whose_values_are_malformed(tmp_path):
    records = [full_record(step) for step in range(1, 9)]
    records[4]["moe.tokens_per_expert"] = records[4]["moe.tokens_per_expert"][:-1]  # a ragged row
    records[5]["loss"] = "x"
    result = plot_run(write_run(tmp_path / "run", records))
    assert [path.name for path in result.written] == ["throughput.png", "time_split.png"]
    assert set(result.skipped) == {"loss", "expert_load"}
    assert all("holds a value this plot cannot draw" in reason for reason in result.skipped.values())


def test_plot_skips_what_an_older_run_did_not_record(tmp_path, capsys):
    records = [
        {"step": s, "loss": 5.0 - s / 10, "lm_loss": 5.0, "lr": 1e-3, "tokens_per_s": 900.0, "step_s": 0.2}
        for s in range(1, 5)
    ]
    run = write_run(tmp_path / "old", records)
    parser = argparse.ArgumentParser()
    add_metrics_commands(parser.add_subparsers())
    args = parser.parse_args(["plot", str(run), "--output", str(tmp_path / "out")])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "skipped time_split" in out and "skipped expert_load" in out
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["loss.png", "throughput.png"]

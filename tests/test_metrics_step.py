"""Step timers, the timing/throughput/MFU keys of a record, the profiler trace, and the metrics config."""

import json
import time

import pytest
import torch

from ferry.config import ConfigError
from ferry.config.loader import validate
from ferry.metrics import MetricsConfig, ProfileConfig, StepMetrics, StepTimer, StepTimes, TorchTrace
from ferry.metrics import timer as timer_module
from ferry.model import ModelConfig, Transformer
from ferry.platform.hardware import MfuPeak

ISSUE_KEYS = {
    "step_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "generate_s",
    "compute_s",
    "comm_s",
    "comm_compute_ratio",
    "ep_wait_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "mem_peak_mib",
}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timer_module.time, "perf_counter", fake)
    return fake


def test_regions_sum_over_repeats_and_waits_nested_in_waits_count_once(clock):
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    for _ in range(2):
        with timer.region("forward"):
            clock.now += 1.0
            with timer.region("ep_wait"):
                clock.now += 0.25
                with timer.region("comm"):
                    clock.now += 0.5
            clock.now += 1.0
        with timer.region("backward"):
            with timer.region("comm"):
                clock.now += 0.5
            clock.now += 3.0
    with timer.region("optimizer"):
        clock.now += 0.5
    clock.now += 0.25
    times = timer.stop()
    assert times == StepTimes(
        step_s=13.25, forward_s=5.5, backward_s=7.0, optimizer_s=0.5, comm_s=2.0, ep_wait_s=1.5, blocked_s=2.5
    )


def test_added_time_counts_like_a_region(clock):
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    timer.add("comm", 0.75)
    with timer.region("backward"):
        clock.now += 2.0
    times = timer.stop()
    assert times.comm_s == 0.75 and times.blocked_s == 0.75 and times.backward_s == 2.0


def test_a_misspelt_region_is_refused():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    with pytest.raises(ValueError, match="forwards"):
        with timer.region("forwards"):
            pass


def test_step_record_keys_and_formulas():
    metrics = StepMetrics(torch.device("cpu"), world_size=4, flops_per_token=6e6, peak_flops=1e12)
    times = StepTimes(
        step_s=2.0, forward_s=0.6, backward_s=1.0, optimizer_s=0.2, comm_s=0.3, ep_wait_s=0.2, blocked_s=0.4
    )
    record = metrics.record(times, tokens=8192)
    assert set(record) == ISSUE_KEYS
    assert record["compute_s"] == pytest.approx(1.4)
    assert record["comm_compute_ratio"] == pytest.approx(0.3 / 1.4)
    assert record["tokens_per_s"] == pytest.approx(4096)
    assert record["tokens_per_s_per_device"] == pytest.approx(1024)
    assert record["mfu"] == pytest.approx(6e6 * 4096 / (4 * 1e12))
    assert 10 < record["mem_peak_mib"] < 1e6
    json.dumps(record, allow_nan=False)


def test_a_real_step_is_timed_sanely_on_cpu():
    config = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=16,
        moe={"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32},
    )
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters())
    metrics = StepMetrics(torch.device("cpu"), world_size=1, flops_per_token=1e6, peak_flops=1e11)
    tokens_BS = torch.randint(0, 64, (4, 16))
    metrics.timer.start()
    for _ in range(2):
        with metrics.timer.region("forward"):
            loss = model(tokens_BS).logits_BSV.float().logsumexp(-1).mean()
        with metrics.timer.region("backward"):
            loss.backward()
    with metrics.timer.region("optimizer"):
        optimizer.step()
    record = metrics.record(metrics.timer.stop(), tokens=2 * tokens_BS.numel())
    phases = record["forward_s"] + record["backward_s"] + record["optimizer_s"]
    assert record["forward_s"] > 0 and record["backward_s"] > 0 and record["optimizer_s"] > 0
    assert phases <= record["step_s"]
    assert record["compute_s"] == pytest.approx(phases)
    assert record["comm_s"] == 0.0 and record["comm_compute_ratio"] == 0.0
    assert 0 < record["mfu"] < 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_device_regions_time_the_stream_not_the_host():
    """A queued kernel returns at once on the host; the region must still last as long as the kernel."""
    device = torch.device("cuda")
    timer = StepTimer(device)
    torch.cuda._sleep(1_000)
    torch.cuda.synchronize(device)
    timer.start()
    with timer.region("forward"):
        queued = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        queued = time.perf_counter() - queued
    times = timer.stop()
    assert times.forward_s > 0.01
    assert queued < times.forward_s / 4
    assert times.step_s >= times.forward_s


def test_torch_trace_covers_its_window(tmp_path):
    trace = TorchTrace(ProfileConfig(torch_trace=[2, 3]), tmp_path, torch.device("cpu"))
    for step in range(1, 5):
        trace.step_started(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        trace.step_finished(step)
    assert trace.path == tmp_path / "traces" / "rank0-steps-2-3.json"
    events = json.loads(trace.path.read_text())["traceEvents"]
    assert any("mm" in event.get("name", "") for event in events)


def test_torch_trace_off_by_default(tmp_path):
    trace = TorchTrace(ProfileConfig(), tmp_path, torch.device("cpu"))
    trace.step_started(1)
    trace.step_finished(1)
    trace.close()
    assert not (tmp_path / "traces").exists()


@pytest.mark.parametrize(
    "raw, culprit",
    [
        ({"torch_trace": [5, 2]}, "torch_trace"),
        ({"torch_trace": [0, 2]}, "torch_trace"),
        ({"torch_trace": [1, 2, 3]}, "torch_trace"),
    ],
)
def test_profile_config_names_the_bad_key(raw, culprit):
    with pytest.raises(ConfigError, match=culprit):
        validate(ProfileConfig, raw)


def test_metrics_config_defaults_and_strictness():
    config = MetricsConfig()
    assert config.sinks.console and not config.sinks.prometheus.enabled and not config.sinks.tensorboard.enabled
    assert config.sinks.prometheus.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="sinks.prometheus.prot"):
        validate(MetricsConfig, {"sinks": {"prometheus": {"prot": 1}}})
    with pytest.raises(ConfigError, match="sinks.prometheus.port"):
        validate(MetricsConfig, {"sinks": {"prometheus": {"port": 70000}}})


def _times(step_s: float = 1.0) -> StepTimes:
    return StepTimes(
        step_s=step_s, forward_s=0.3, backward_s=0.6, optimizer_s=0.1, comm_s=0.0, ep_wait_s=0.0, blocked_s=0.0
    )


def test_an_mfu_above_100_percent_measures_a_measured_peak_again_and_says_which_peak_was_stale():
    stale = {
        "dtype": "fp32",
        "tflops": 0.05,
        "kind": "measured",
        "measured_at": "2026-01-01T00:00:00",
        "load_average": 0.08,
        "threads": 2,
        "cache": "/cache/ferry/cpu_peak.json",
    }
    peak = MfuPeak(stale, remeasure=lambda: {**stale, "tflops": 0.2, "measured_at": "2026-01-02T00:00:00"})
    metrics = StepMetrics(torch.device("cpu"), world_size=1, flops_per_token=1e6, peak_flops=peak)
    mfu = metrics.record(_times(), tokens=80_000)["mfu"]  # 8e10 FLOP/s: 1.6 x the stale 5e10, 0.4 x the new 2e11
    assert mfu == pytest.approx(0.4)
    (note,) = metrics.take_notes()
    assert "MFU 160.0% was computed against the fp32 peak 50.0 GFLOP/s measured 2026-01-01T00:00:00" in note
    assert "/cache/ferry/cpu_peak.json" in note and "MFU 40.0% from here on" in note
    assert metrics.peak_flops == 2e11 and metrics.take_notes() == []


def test_an_mfu_above_100_percent_against_a_fixed_peak_is_printed_only_with_a_warning_naming_it():
    metrics = StepMetrics(torch.device("cpu"), world_size=2, flops_per_token=1e6, peak_flops=1e10)
    assert metrics.record(_times(), tokens=40_000)["mfu"] == pytest.approx(2.0)
    (note,) = metrics.take_notes()
    assert "MFU 200.0% is above 100%" in note and "the fp32 peak 10.0 GFLOP/s given" in note
    metrics.record(_times(), tokens=40_000)
    assert metrics.take_notes() == [], "warned once, not every step"
    below = StepMetrics(torch.device("cpu"), world_size=1, flops_per_token=1e6, peak_flops=1e12)
    below.record(_times(), tokens=40_000)
    assert below.take_notes() == []

"""Trainer-level checks of the metrics (record keys, Prometheus during a run) and of loss scaling."""

import math
import threading
import time
import urllib.request

import torch

from ferry.metrics.names import objective_keys
from ferry.train import Trainer, train


def test_a_single_process_record_has_every_documented_key(make_config, stdlib_dataset):
    held_out = f"eval.sources=[{{name: held_out, path: {stdlib_dataset}}}]"
    records = train(make_config("train.steps=2", held_out, "eval.batches=1")).final_record
    assert objective_keys("lm") <= set(records)
    assert records["comm_s"] == 0 and records["comm_bytes"] == 0 and records["ep_wait_s"] == 0
    assert 0 < records["mfu"] < 1
    assert records["forward_s"] + records["backward_s"] + records["optimizer_s"] <= records["step_s"]


def test_prometheus_is_scraped_over_loopback_during_a_run(make_config):
    trainer = Trainer(
        make_config("train.steps=40", "metrics.sinks.prometheus.enabled=true", "metrics.sinks.prometheus.port=0")
    )
    runner = threading.Thread(target=trainer.fit)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        page = ""
        while time.monotonic() < deadline and "ferry_step{" not in page:
            time.sleep(0.2)
            hub = trainer.hub
            if hub is None or hub.prometheus is None:
                continue
            assert hub.prometheus.url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(hub.prometheus.url, timeout=5) as response:
                page = response.read().decode()
        for name in (
            "ferry_step{",
            "ferry_loss{",
            "ferry_tokens_per_second{",
            "ferry_mfu{",
            "ferry_moe_expert_tokens{",
        ):
            assert name in page
    finally:
        runner.join(timeout=300)
    assert not runner.is_alive()


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {f"param.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for param, moments in trainer.optimizer.state.items():
        for key, value in moments.items():
            state[f"optim.{key}.{id(param)}"] = value.clone()
    return state


def test_dynamic_loss_scaling_skips_an_overflow_untouched_and_recovers(make_config):
    trainer = Trainer(
        make_config(
            "precision.loss_scaling.kind=dynamic",
            "precision.loss_scaling.init_scale=1024",
            "precision.loss_scaling.growth_interval=2",
        )
    )
    first = trainer.train_step()
    assert first["loss_scale"] == 1024 and first["skipped_steps"] == 0
    before = _snapshot(trainer)
    victim = trainer.model.layers[0].attn.wq.weight
    poison = victim.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    bad = trainer.train_step()
    poison.remove()
    assert bad["skipped_steps"] == 1 and bad["loss_scale"] == 512
    after = _snapshot(trainer)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before), "the bad step touched the state"
    good = trainer.train_step()
    assert good["skipped_steps"] == 1 and math.isfinite(good["grad_norm"])
    assert any(not torch.equal(before[k], v) for k, v in _snapshot(trainer).items())
    grown = trainer.train_step()
    assert grown["loss_scale"] == 1024, "two clean steps (growth_interval) grow the scale again"

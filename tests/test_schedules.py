"""Learning-rate schedules against hand-computed values, and the trainer following the configured one."""

from __future__ import annotations

import json
import math

import pytest

from ferry.train import train
from ferry.train.config import OptimConfig
from ferry.train.optimizer import learning_rate


def _rates(total: int, **options) -> list[float]:
    config = OptimConfig.model_validate({"lr": 1.0, **options})
    return [learning_rate(config, step, total) for step in range(total)]


def test_cosine_warms_up_then_reaches_the_floor_at_the_last_step():
    expected = [
        0.5,
        1.0,
        1.0,
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)),
        0.1 + 0.9 * 0.5 * (1 + math.cos(2 * math.pi / 3)),
        0.1,
    ]
    assert _rates(6, warmup_steps=2, min_lr_ratio=0.1) == pytest.approx(expected)


def test_linear_decays_to_zero_when_asked():
    assert _rates(6, warmup_steps=2, min_lr_ratio=0.0, schedule="linear") == pytest.approx(
        [0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]
    )


def test_wsd_is_stable_until_its_decay_fraction():
    assert _rates(10, warmup_steps=1, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.3) == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]
    )
    assert _rates(8, warmup_steps=2, min_lr_ratio=0.2, schedule="wsd", decay_fraction=0.5) == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]
    )


def test_constant_stays_after_the_warm_up():
    assert _rates(5, warmup_steps=2, schedule="constant") == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])


def test_an_unknown_schedule_is_named(make_config):
    from ferry.config import UserError

    with pytest.raises(UserError, match="optim.schedule"):
        make_config("optim.schedule=step")


def test_the_trainer_records_the_configured_schedule(make_config):
    config = make_config(
        "train.steps=5",
        "optim.schedule=wsd",
        "optim.decay_fraction=0.4",
        "optim.warmup_steps=1",
        "optim.min_lr_ratio=0",
    )
    train(config)
    records = [json.loads(line) for line in (config.run.path / "metrics.jsonl").read_text().splitlines()]
    assert [record["lr"] for record in records] == pytest.approx(
        [learning_rate(config.optim, step, 5) for step in range(5)]
    )
    assert records[-1]["lr"] == 0.0 and records[1]["lr"] == config.optim.lr

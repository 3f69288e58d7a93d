"""The job's layout is laid out and checked once per run (`ferry.parallel.layout`), and every part of the run
reads that record: the plan that places the model, the memory model, the run's records."""

from __future__ import annotations

import json

import pytest

import ferry.parallel.layout as layout_module
from ferry.config import UserError
from ferry.parallel.layout import lay_out_job
from ferry.train import train
from ferry.train.memory import memory_estimate


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_run_lays_its_job_out_once(make_config, monkeypatch):
    import ferry.parallel.plan
    import ferry.train.config
    import ferry.train.memory

    calls = []
    for module in (ferry.train.config, ferry.train.memory, ferry.parallel.plan):
        calls.append(_counting(monkeypatch, module, "lay_out_job"))
    result = train(make_config("train.steps=2", "train.micro_batch=auto"))
    assert sum(len(made) for made in calls) == 1
    assert json.loads((result.run_dir / "run.json").read_text())["layout"] == {
        "world_size": 1,
        "ep_degree": 1,
        "mode": "single",
    }


def test_a_pipelines_stage_split_is_computed_once_and_read_by_the_memory_model(make_config, monkeypatch):
    splits = _counting(monkeypatch, layout_module, "split_stages")
    config = make_config("model.n_layers=4", "parallel.pp=2")
    layout = config.check_world_size(2)
    assert len(splits) == 1 and layout.split.blocks == ((0, 1), (2, 3)) and layout.replicas == 1
    memory_estimate(config, 2, "cpu", layout=layout)
    assert len(splits) == 1, "the memory model reads the layout's split"
    assert layout.record()["pp_stages"] == {"blocks_per_stage": [2, 2], "stages_of_rank": [[0], [1]]}


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            {"ep": 3},
            4,
            "parallel.ep: 3 does not divide the world size 4; set parallel.ep=1, parallel.ep=2 or parallel.ep=4",
        ),
        ({"ep": 2, "pp": 2}, 2, "parallel.ep: 2 does not divide the 1 ranks of each pipeline stage"),
        ({"mode": "fsdp", "ep": 2}, 2, "parallel.ep: FSDP mode replicates experts"),
        ({"pp": 3}, 4, "parallel.pp: 3 does not divide the world size 4"),
    ],
)
def test_a_layout_the_job_cannot_take_is_refused_naming_the_setting(make_config, overrides, world_size, message):
    config = make_config(*(f"parallel.{key}={value}" for key, value in overrides.items()), "model.n_layers=4")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lay_out_job(config.parallel, config.model, world_size)

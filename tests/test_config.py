"""Config machinery: overrides, validation messages, and the YAML round trip."""

import re

import pytest
from conftest import REPO

from ferry.config import ConfigError, UserError, dump_yaml, load_config, parse_override
from ferry.train import RunConfig, load_run_config


def test_override_values_are_typed_yaml():
    assert parse_override("train.steps=50") == (["train", "steps"], 50)
    assert parse_override("optim.lr=1e-3") == (["optim", "lr"], 1e-3)
    assert parse_override("optim.betas=[0.9, 0.99]") == (["optim", "betas"], [0.9, 0.99])
    assert parse_override("run.dir=/tmp/x") == (["run", "dir"], "/tmp/x")
    assert parse_override("run.dir=") == (["run", "dir"], None)


def test_quoted_segments_keep_their_dots():
    assert parse_override('kernels.ops."moe.grouped_mm"=portable') == (["kernels", "ops", "moe.grouped_mm"], "portable")


def test_overrides_reach_nested_sections_and_list_items(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  sources:\n    - {name: a, path: p}\n    - {name: b, path: q}\n")
    config = load_run_config(path, ["model.moe.num_experts=16", "data.sources.1.weight=3"])
    assert config.model.moe.num_experts == 16
    assert config.data.sources[1].weight == 3.0
    assert config.run.name == "c"
    assert str(config.run.path) == "runs/c"


def test_resolved_config_round_trips(tmp_path):
    config = load_run_config(REPO / "configs" / "tiny.yaml", ["train.steps=7"])
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_yaml(config))
    assert load_run_config(dumped).model_dump() == {**config.model_dump()}


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.moe.num_expert=4", "model.moe.num_expert: unknown key; did you mean 'num_experts'"),
        ("train.steps=abc", "train.steps: Input should be a valid integer"),
        ("train.steps=-3", "train.steps: Input should be greater than or equal to 1"),
        ("model.moe.top_k=9", "model.moe.top_k: top_k must not exceed num_experts (8)"),
        ("model.n_kv_heads=3", "model.n_kv_heads: n_kv_heads must divide n_heads"),
        ("train.micro_batch=5", "train.micro_batch: micro_batch must divide global_batch"),
        ("model.moe.score_func=relu", "model.moe.score_func: Input should be 'softmax' or 'sigmoid'"),
        ("data.seq_len=4096", "data: seq_len 4096 exceeds model.max_seq_len"),
        ("optim.betas=[0.9, 1.5]", "optim.betas: each beta must lie in [0, 1)"),
        ("data.sources.0.weight=0", "data.sources.0.weight: Input should be greater than 0"),
    ],
)
def test_invalid_values_name_the_dotted_key(override, named):
    with pytest.raises(ConfigError) as caught:
        load_run_config(REPO / "configs" / "tiny.yaml", [override])
    assert named in str(caught.value)


def test_a_chunked_loss_is_refused_where_there_is_no_next_token_loss():
    with pytest.raises(ConfigError) as caught:
        load_run_config(REPO / "configs" / "tiny.yaml", ["train.objective=grpo", "train.loss_chunk=64"])
    assert "train.loss_chunk: chunks the next-token loss (objective lm); grpo" in str(caught.value)
    assert load_run_config(REPO / "configs" / "tiny.yaml", ["train.loss_chunk=64"]).train.loss_chunk == 64


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, None, ["train.steps=0", "optim.lr=-1"])
    assert "train.steps" in str(caught.value) and "optim.lr" in str(caught.value)


HELD_OUT = "eval.sources=[{name: held, path: data/held}]"


@pytest.mark.parametrize(
    "overrides, world_size, suggested",
    [
        ([], 16, ["train.micro_batch=1", "train.global_batch=128"]),  # tiny.yaml on two 8-GPU nodes
        (["train.global_batch=48"], 4, ["train.micro_batch=6", "train.global_batch=64"]),  # the largest that fits
        (["train.global_batch=24", "train.micro_batch=4"], 16, ["train.global_batch=64"]),  # 16 ranks cannot split 24
        ([HELD_OUT, "eval.batch_size=24", "train.micro_batch=4"], 4, ["train.micro_batch=2", "eval.batch_size=32"]),
        (
            ["parallel.ep=3", "train.micro_batch=1"],
            16,
            ["parallel.ep=1", "parallel.ep=2", "parallel.ep=4", "parallel.ep=8"],
        ),
        (
            ["parallel.ep=4", "train.micro_batch=1", "train.global_batch=12", "model.moe.num_experts=4"],
            6,
            ["parallel.ep=1", "parallel.ep=2"],  # of 6 and of the 4 experts, split evenly
        ),
    ],
)
def test_a_job_size_that_does_not_split_names_the_overrides_that_do(overrides, world_size, suggested):
    tiny = REPO / "configs" / "tiny.yaml"
    with pytest.raises(UserError) as caught:
        load_run_config(tiny, overrides).check_world_size(world_size)
    assert caught.value.exit_code == 2
    assert re.findall(r"[a-z_.]+=\d+", str(caught.value)) == suggested
    for fix in suggested:
        load_run_config(tiny, [*overrides, fix]).check_world_size(world_size)


def test_the_batch_refusal_is_one_sentence_naming_the_keys():
    with pytest.raises(UserError) as caught:
        load_run_config(REPO / "configs" / "tiny.yaml").check_world_size(16)
    assert str(caught.value) == (
        "train.global_batch (16) must be a multiple of train.micro_batch x world size (8 x 16 = 128); "
        "set train.micro_batch=1 (the same 16 sequences in smaller passes) or train.global_batch=128"
    )

"""Pipeline parallelism on 2 and 4 CPU processes: a pipelined run trains as the single process does, its
checkpoints are the single process's, and what it cannot run is refused before any rank starts.

Tolerance, fixed before measuring: 1e-6 relative on losses and router figures over 10 steps. A pipeline changes
only the order of floating-point sums (each stage's gradients accumulated over micro-batches in the schedule's
order, the routers' loss gradients joining the residual stream's at their stage instead of at the loss); measured
on a 4-block MoE model over 10 steps: PP2 (1F1B, GPipe, interleaved 1F1B) within 3.9e-8 of the single process,
looped BFS within 5.9e-8, zero bubble (portable kernels, logits then loss) within 2.0e-8, PP2 x EP2 x ZeRO-1 on
4 ranks within 2.0e-8. Expert loads are integers and must be equal.
"""

import json

import distributed_training as runs
import pipeline_runs
import pytest

from ferry.comm.spawn import RankFailure, run_on_ranks
from ferry.config import UserError
from ferry.train import Trainer

TOLERANCE = 1e-6
# 4 blocks (the first dense): stage 0 holds one MoE layer, stage 1 two, so the routers' losses and loads of a
# step come from both stages; bias balancing on, so the loads steer the next step's routing
PIPELINED_MODEL = ("model.n_layers=4", "model.moe.bias_balancing.enabled=true", "train.micro_batch=2")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(stdlib_dataset, tmp_path_factory):
    """The 1-process run and the PP2 (1F1B) run of the same 10 steps, each with checkpoints at 5 and 10."""
    single_dir = tmp_path_factory.mktemp("single")
    single = pipeline_runs.train_reporting(str(stdlib_dataset), str(single_dir), *PIPELINED_MODEL)
    pp_dir = tmp_path_factory.mktemp("pp2")
    pp = run_on_ranks(
        pipeline_runs.train_reporting, 2, str(stdlib_dataset), str(pp_dir), *PIPELINED_MODEL, "parallel.pp=2"
    )
    return {"single": single, "single_dir": single_dir, "pp": pp, "pp_dir": pp_dir}


def test_pp2_trains_as_one_process(reference):
    single, pp = reference["single"], reference["pp"]
    assert _relative(pp[0]["losses"], single["losses"]) < TOLERANCE
    assert pp[1]["losses"] == pp[0]["losses"], "every rank reports the global loss"
    for pipelined, alone in zip(pp[0]["records"], single["records"], strict=True):
        assert pipelined["moe.tokens_per_expert"] == alone["moe.tokens_per_expert"]
        for figure in ("aux_loss", "z_loss", "grad_norm", "moe.router_entropy", "moe.aux_score", "moe.balance_gap"):
            assert _relative([pipelined[figure]], [alone[figure]]) < TOLERANCE, figure
        assert _relative(pipelined["moe.router_entropy_per_layer"], alone["moe.router_entropy_per_layer"]) < TOLERANCE


def test_each_stage_moves_its_routers_biases_as_one_process(reference):
    single, pp = reference["single"], reference["pp"]
    assert sorted(pp[0]["biases"]) == [0] and sorted(pp[1]["biases"]) == [1, 2], "stage 0 holds MoE layer 0"
    held = {**pp[0]["biases"], **pp[1]["biases"]}
    assert held == single["biases"]
    assert any(any(bias) for bias in held.values()), "the biases moved"


def test_a_pipelined_run_records_its_stages_and_bubble(reference):
    from ferry.metrics.names import objective_keys

    record = reference["pp"][0]["records"][-1]
    held_out = {"eval.loss", "eval.perplexity"}  # a pipelined run evaluates nothing while it trains
    assert objective_keys("lm", pipelined=True) - held_out <= set(record)
    assert len(record["pp.stage_busy_s"]) == 2 and min(record["pp.stage_busy_s"]) > 0
    assert len(record["pp.stage_mem_peak_mib"]) == 2 and min(record["pp.stage_mem_peak_mib"]) > 0
    assert 0 < record["pp.bubble"] < 1
    assert record["forward_s"] > 0 and record["backward_s"] > 0
    layout = json.loads((reference["pp_dir"] / "run.json").read_text())["layout"]
    assert layout["pp_degree"] == 2 and layout["pp_schedule"] == "1f1b"
    assert layout["pp_stages"] == {"blocks_per_stage": [2, 2], "stages_of_rank": [[0], [1]]}


@pytest.mark.parametrize(
    "schedule",
    [
        ("parallel.pp_schedule=gpipe",),
        ("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"),
        ("parallel.pp_schedule=looped_bfs", "parallel.pp_virtual_stages=2", "parallel.pp_split=[1,1,1,1]"),
        (
            "parallel.pp_schedule=zero_bubble",
            "parallel.pp_virtual_stages=2",
            "kernels.policy=portable",
            "train.loss_chunk=0",
        ),
    ],
    ids=["gpipe", "interleaved_1f1b", "looped_bfs", "zero_bubble"],
)
def test_every_schedule_gives_the_same_losses(reference, stdlib_dataset, tmp_path, schedule):
    pp = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        *PIPELINED_MODEL,
        "parallel.pp=2",
        "train.steps=4",
        *schedule,
    )
    assert _relative(pp[0]["losses"], reference["single"]["losses"][:4]) < TOLERANCE


def test_a_pipelined_checkpoint_holds_the_single_process_tensors(reference):
    def tensors(run_dir) -> dict:
        manifest = json.loads((run_dir / "checkpoints" / "step-00000010" / "manifest.json").read_text())
        return {name: record["shape"] for name, record in manifest["tensors"].items() if not name.startswith("rng.")}

    assert tensors(reference["pp_dir"]) == tensors(reference["single_dir"])


def test_ferry_ckpt_inspect_names_the_pipeline_a_checkpoint_was_saved_from(reference, capsys):
    from ferry.cli.main import main

    assert main(["ckpt", "inspect", str(reference["pp_dir"] / "checkpoints" / "step-00000010")]) == 0
    assert "layout      world size 2, PP degree 2, EP degree 1, mode ep" in capsys.readouterr().out


def test_a_pp2_checkpoint_resumes_in_one_process(reference, stdlib_dataset, tmp_path):
    checkpoint = reference["pp_dir"] / "checkpoints" / "step-00000005"
    config = runs.tiny_config(str(stdlib_dataset), str(tmp_path), *PIPELINED_MODEL, f"resume={checkpoint}")
    resumed = Trainer(config).fit().losses
    assert len(resumed) == 5
    assert _relative(resumed, reference["single"]["losses"][5:]) < TOLERANCE


def test_a_one_process_checkpoint_resumes_as_pp2(reference, stdlib_dataset, tmp_path):
    checkpoint = reference["single_dir"] / "checkpoints" / "step-00000005"
    resumed = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        *PIPELINED_MODEL,
        "parallel.pp=2",
        f"resume={checkpoint}",
    )
    assert len(resumed[0]["losses"]) == 5
    assert _relative(resumed[0]["losses"], reference["single"]["losses"][5:]) < TOLERANCE


def test_ferry_eval_reads_a_pipelined_checkpoint_as_the_single_process_one(reference, stdlib_dataset, capsys):
    from ferry.cli.main import main

    figures = []
    for run_dir in (reference["pp_dir"], reference["single_dir"]):
        final = run_dir / "checkpoints" / "step-00000010"
        assert (
            main(["eval", str(final), "--data", str(stdlib_dataset), "--batches", "2", "--batch-size", "8", "--json"])
            == 0
        )
        figures.append(json.loads(capsys.readouterr().out)["datasets"][str(stdlib_dataset)]["loss"])
    assert _relative(figures[:1], figures[1:]) < TOLERANCE


def test_a_pp2_checkpoint_resumes_as_ep2(reference, stdlib_dataset, tmp_path):
    checkpoint = reference["pp_dir"] / "checkpoints" / "step-00000005"
    resumed = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        *PIPELINED_MODEL,
        "parallel.ep=2",
        "optim.zero=true",
        f"resume={checkpoint}",
    )
    assert _relative(resumed[0]["losses"], reference["single"]["losses"][5:]) < TOLERANCE


@pytest.mark.parametrize("layout", [("parallel.ep=2",), ("parallel.ep=1",)], ids=["pp2-ep2", "pp2-dp2"])
def test_a_pipeline_with_zero1_on_4_ranks_trains_as_one_process(reference, stdlib_dataset, tmp_path, layout):
    """world 4 = pp 2 x (dp x ep) 2: each stage's two ranks split the step's rows and, with ep 2, its experts;
    dense gradients are summed over a stage's ranks, expert gradients over the ranks holding the same experts."""
    run = run_on_ranks(
        runs.train_run,
        4,
        str(stdlib_dataset),
        str(tmp_path),
        *PIPELINED_MODEL,
        "parallel.pp=2",
        *layout,
        "optim.zero=true",
        timeout_s=240,
    )
    assert _relative(run[0]["losses"], reference["single"]["losses"]) < TOLERANCE
    for pipelined, alone in zip(run[0]["records"], reference["single"]["records"], strict=True):
        assert pipelined["moe.tokens_per_expert"] == alone["moe.tokens_per_expert"]


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (("model.n_layers=3",), 2, "do not split model.n_layers (3) evenly; set parallel.pp to one of [1, 3]"),
        (("parallel.pp_split=[1,2]",), 2, "parallel.pp_split [1, 2] places 3 blocks; model.n_layers is 4"),
        (("train.micro_batch=8",), 2, "1f1b needs at least parallel.pp (2) micro-batches a step, this run has 1"),
        (
            ("train.micro_batch=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"),
            4,
            "interleaved_1f1b runs a step's micro-batches in rounds of about parallel.pp (2): at least 2 that split "
            "into equal rounds (a multiple of 2 always does); this run has 1",
        ),
        (
            ("parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2"),
            2,
            "zero_bubble runs each backward in two passes over one graph",
        ),
        (
            (
                "parallel.pp_schedule=zero_bubble",
                "parallel.pp_virtual_stages=2",
                "kernels.policy=portable",
                "train.loss_chunk=0",
                "train.micro_batch=1",
                "train.global_batch=5",
            ),
            2,
            "zero_bubble runs a step's micro-batches in rounds of about parallel.pp (2): at least 2 that split into "
            "equal rounds (a multiple of 2 always does); this run has 5",
        ),
        (("model.skip=farskip",), 2, "model.skip=farskip is not supported with pipeline parallelism"),
        ((), 3, "parallel.pp: 2 does not divide the world size 3"),
        (("parallel.ep=2",), 2, "parallel.ep: 2 does not divide the 1 ranks of each pipeline stage"),
    ],
    ids=[
        "uneven-split",
        "split-sum",
        "1f1b-micro-batches",
        "interleaved-rounds",
        "zero-bubble-kernels",
        "zero-bubble-rounds",
        "farskip",
        "world",
        "ep",
    ],
)
def test_a_pipeline_the_run_cannot_take_is_refused_before_any_rank_starts(make_config, overrides, world_size, message):
    config = make_config("model.n_layers=4", "parallel.pp=2", *overrides)
    with pytest.raises(UserError) as refused:
        config.check_world_size(world_size)
    assert message in str(refused.value)


def test_a_refused_pipeline_setting_gets_its_own_reason_and_fix_only(make_config):
    config = make_config("model.n_layers=4", "parallel.pp=2", "model.tie_embeddings=true")
    with pytest.raises(UserError) as refused:
        config.check_world_size(2)
    message = str(refused.value)
    assert "(the tied head lives on another stage than its embedding); set model.tie_embeddings=false" in message
    assert not any(other in message for other in ("eval.sources", "memory model", "FarSkip", "overlap trial"))


def test_a_pipeline_evaluates_held_out_data_as_one_process_does(stdlib_dataset, tmp_path):
    """Held-out windows scored stage to stage while the run trains: within documents, the head and loss by chunks
    on the last stage as the run trains them, the sums counted once per pipeline; the single process's figures
    within the tolerance."""
    held_out = (
        f"eval.sources=[{{name: held, path: {stdlib_dataset}}}]",
        "eval.interval=3",
        "train.steps=3",
        "data.document_masking=true",
        "train.loss_chunk=16",
    )
    single = pipeline_runs.train_reporting(str(stdlib_dataset), str(tmp_path / "one"), *PIPELINED_MODEL, *held_out)
    pp = run_on_ranks(
        pipeline_runs.train_reporting,
        2,
        str(stdlib_dataset),
        str(tmp_path / "pp2"),
        *PIPELINED_MODEL,
        *held_out,
        "parallel.pp=2",
    )
    evaluated = [(record, alone) for record, alone in zip(pp[0]["records"], single["records"]) if "eval.loss" in alone]
    assert len(evaluated) == 1 and "eval.loss" in evaluated[0][0]
    for pipelined, alone in evaluated:
        assert _relative([pipelined["eval.loss"]["held"]], [alone["eval.loss"]["held"]]) < TOLERANCE
    assert _relative(pp[0]["losses"], single["losses"]) < TOLERANCE


def test_ferry_train_refuses_a_bad_pipeline_with_exit_2(stdlib_dataset, tmp_path, capsys):
    from conftest import REPO

    from ferry.cli.main import main

    code = main(
        [
            "train",
            str(REPO / "configs" / "tiny.yaml"),
            "--nproc",
            "2",
            f"data.sources.0.path={stdlib_dataset}",
            f"run.dir={tmp_path}",
            "parallel.pp=2",
            "model.n_layers=3",
        ]
    )
    assert code == 2
    assert "parallel.pp: 2 x pp_virtual_stages 1 = 2 stages do not split model.n_layers (3)" in capsys.readouterr().err
    assert not (tmp_path / "run.json").exists()


def test_a_pipeline_refused_inside_the_ranks_fails_on_every_rank(stdlib_dataset, tmp_path):
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(
            runs.train_run, 2, str(stdlib_dataset), str(tmp_path), "parallel.pp=2", "model.n_layers=3", timeout_s=120
        )
    assert str(caught.value).count("stages do not split model.n_layers (3) evenly") == 2


def test_the_memory_model_counts_the_largest_stage_and_the_schedules_micro_batches(make_config):
    from ferry.train.memory import memory_estimate

    single = memory_estimate(make_config(*PIPELINED_MODEL), 1, "cpu")
    one_f_one_b = memory_estimate(make_config(*PIPELINED_MODEL, "parallel.pp=2"), 2, "cpu")
    gpipe = memory_estimate(make_config(*PIPELINED_MODEL, "parallel.pp=2", "parallel.pp_schedule=gpipe"), 2, "cpu")
    assert one_f_one_b.state_bytes < 0.7 * single.state_bytes, "a stage holds about half the weights and moments"
    assert gpipe.state_bytes == one_f_one_b.state_bytes
    assert gpipe.backward_bytes > 1.5 * one_f_one_b.backward_bytes, "GPipe keeps all 4 micro-batches, 1F1B 2"


def test_ferry_launch_explains_where_the_stages_fall():
    from conftest import REPO

    from ferry.launch import build_launch_spec
    from ferry.launch.environment import explain

    spec = build_launch_spec(
        str(REPO / "configs" / "tiny.yaml"),
        ["train.micro_batch=1", "parallel.ep=8", "parallel.pp=2"],
        platform="p5.48xlarge",
        nodes=2,
        master_addr="10.0.0.1",
    )
    assert "pipeline: 2 stages (1f1b) of 8 consecutive ranks, 1 whole node(s) each" in explain(spec)
    with pytest.raises(UserError, match="parallel.pp: 3 does not divide the world size 16"):
        build_launch_spec(
            str(REPO / "configs" / "tiny.yaml"),
            ["parallel.pp=3"],
            platform="p5.48xlarge",
            nodes=2,
            master_addr="10.0.0.1",
        )


def test_a_balanced_split_counts_the_embedding_and_the_head_with_their_stages(make_config):
    from ferry.parallel.pipeline_split import balanced_counts, split_stages

    assert balanced_counts([10] * 6, 25, 3) == [1, 4, 1], "35, 40, 35 beats 45, 20, 45"
    assert balanced_counts([10] * 4, 0, 2) == [2, 2]
    config = make_config("model.n_layers=6", "model.vocab_size=4096", "parallel.pp=2", "parallel.pp_split=balanced")
    blocks = split_stages(config.parallel, config.model).blocks
    assert [len(stage) for stage in blocks] == [3, 3] and blocks[1] == (3, 4, 5)
    virtual = make_config(
        "model.n_layers=8", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"
    )
    split = split_stages(virtual.parallel, virtual.model)
    assert split.stages_of(0) == [0, 2] and split.blocks_of(1) == {2, 3, 6, 7}


def test_torchs_v_shaped_schedules_are_refused_naming_the_supported_ones(make_config):
    from ferry.config import ConfigError

    with pytest.raises(ConfigError, match="zbv: torch's V-shaped schedules place the first and the last") as refused:
        make_config("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2")
    assert "choose one of gpipe, 1f1b, interleaved_1f1b, looped_bfs, zero_bubble" in str(refused.value)

"""Whole training runs on 2 CPU processes: layouts agree, checkpoints reshard, metrics are global.

Tolerance: a 2-rank run differs from the 1-process run only in the order of
floating-point sums (gradient all-reduce, per-rank loss partial sums), so losses
agree to 1e-5 relative over 10 steps (observed: below 1e-6).
"""

import json

import distributed_training as runs
import pytest

from ferry.comm.spawn import RankFailure, run_on_ranks
from ferry.train import Trainer

LAYOUT_TOLERANCE = 1e-5


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(stdlib_dataset, tmp_path_factory):
    """The uninterrupted 1-process run, and the uninterrupted (world 2, ep 2) run with checkpoints at 5 and 10."""
    held_out = (f"eval.sources=[{{name: held_out, path: {stdlib_dataset}}}]", "eval.interval=5", "eval.batches=2")
    single_dir = tmp_path_factory.mktemp("single")
    single = Trainer(runs.tiny_config(str(stdlib_dataset), str(single_dir), *held_out)).fit().losses
    ep_dir = tmp_path_factory.mktemp("ep2")
    ep = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(ep_dir), "parallel.ep=2", "optim.zero=true", *held_out
    )
    return {"single": single, "single_dir": single_dir, "ep": ep, "ep_dir": ep_dir}


def test_world2_ep2_with_zero_matches_one_process(reference):
    rank0 = reference["ep"][0]
    assert rank0["losses"] == [r["loss"] for r in rank0["records"]]
    assert _relative(rank0["losses"], reference["single"]) < LAYOUT_TOLERANCE
    assert reference["ep"][1]["losses"] == rank0["losses"], "every rank reports the global loss"


def test_held_out_loss_does_not_depend_on_the_layout(reference, stdlib_dataset, capsys):
    """The 2-rank evaluation splits each batch over the ranks and sums in one all-reduce: it gives the
    1-process figures of the same weights (`ferry eval` on its checkpoint) and of the 1-process run."""
    from ferry.cli.main import main

    def held_out(records: list[dict]) -> dict[int, float]:
        return {record["step"]: record["eval.loss"]["held_out"] for record in records if "eval.loss" in record}

    single_records = [json.loads(line) for line in (reference["single_dir"] / "metrics.jsonl").read_text().splitlines()]
    ep, single = held_out(reference["ep"][0]["records"]), held_out(single_records)
    assert sorted(ep) == sorted(single) == [5, 10]
    assert _relative(list(ep.values()), list(single.values())) < LAYOUT_TOLERANCE
    final = reference["ep_dir"] / "checkpoints" / "step-00000010"
    assert (
        main(["eval", str(final), "--data", str(stdlib_dataset), "--batches", "2", "--batch-size", "8", "--json"]) == 0
    )
    figures = json.loads(capsys.readouterr().out)
    assert figures["seq_len"] == 32 and figures["step"] == 10
    assert figures["datasets"][str(stdlib_dataset)]["loss"] == pytest.approx(ep[10], rel=1e-6)


def test_a_2_rank_ep_run_records_global_and_communication_metrics(reference):
    record = reference["ep"][0]["records"][-1]
    assert record["comm_s"] > 0 and record["ep_wait_s"] > 0 and record["comm_bytes"] > 0
    assert record["ep_wait_s"] <= record["step_s"]
    assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
    assert 0 < record["mfu"] < 1
    assert sum(map(sum, record["moe.tokens_per_expert"])) == 8 * 32 * 2, "loads summed over both ranks"
    assert record["moe.ep_imbalance"] >= 1.0
    manifest = json.loads((reference["ep_dir"] / "run.json").read_text())
    assert manifest["layout"] == {"world_size": 2, "ep_degree": 2, "mode": "ep"}
    assert manifest["environment"]["comm_backend"] == "gloo"


def test_zero1_shards_the_optimizer_state(reference, stdlib_dataset, tmp_path):
    plain = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), "parallel.ep=2", "train.steps=2")
    sharded = reference["ep"][0]["records"][-1]["optimizer_state_mib"]
    assert sharded < 0.75 * plain[0]["records"][-1]["optimizer_state_mib"]


@pytest.mark.parametrize(
    "layout",
    [("parallel.ep=1",), ("parallel.mode=fsdp",), ("parallel.ep=2",)],
    ids=["world2-ep1", "fsdp", "world2-ep2-no-zero"],
)
def test_an_ep2_checkpoint_resumes_in_another_2_rank_layout(reference, stdlib_dataset, tmp_path, layout):
    checkpoint = reference["ep_dir"] / "checkpoints" / "step-00000005"
    resumed = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), f"resume={checkpoint}", *layout)
    continued = resumed[0]["losses"]
    assert len(continued) == 5
    assert _relative(continued, reference["single"][5:]) < LAYOUT_TOLERANCE


@pytest.mark.parametrize("layout", [("parallel.ep=2",), ("parallel.mode=fsdp",)], ids=["ep2", "fsdp"])
def test_a_resume_that_finds_nothing_gives_each_rank_its_piece_of_the_seeds_weights(
    reference, stdlib_dataset, tmp_path, layout
):
    """A run asked to resume draws its weights only when it finds no checkpoint, after they were laid out over
    the ranks: each rank's experts (EP) or shards (FSDP) are its piece of what a run from scratch draws."""
    run = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), "resume=latest", *layout)
    assert _relative(run[0]["losses"], reference["single"]) < LAYOUT_TOLERANCE
    resumed, single = (json.loads((path / "run.json").read_text()) for path in (tmp_path, reference["single_dir"]))
    assert resumed["initial_weights_xxh3"] == single["initial_weights_xxh3"] is not None


@pytest.mark.parametrize("layout", [(), ("parallel.mode=fsdp",)], ids=["one-process", "fsdp"])
def test_the_chunked_head_loss_trains_as_logits_then_loss(reference, stdlib_dataset, tmp_path, layout):
    """`train.loss_chunk` (here 40 tokens, not a divisor of the micro-batch's 128) changes where the head's
    gradients are made, not what they are; under FSDP the head's weight is the one gathered in the forward."""
    overrides = (str(stdlib_dataset), str(tmp_path), "train.loss_chunk=40", *layout)
    if layout:
        losses = run_on_ranks(runs.train_run, 2, *overrides)[0]["losses"]
    else:
        losses = Trainer(runs.tiny_config(*overrides)).fit().losses
    assert _relative(losses, reference["single"]) < LAYOUT_TOLERANCE


def test_an_ep2_checkpoint_resumes_in_one_process(reference, stdlib_dataset, tmp_path):
    checkpoint = reference["ep_dir"] / "checkpoints" / "step-00000005"
    resumed = Trainer(runs.tiny_config(str(stdlib_dataset), str(tmp_path), f"resume={checkpoint}")).fit().losses
    assert _relative(resumed, reference["single"][5:]) < LAYOUT_TOLERANCE


def test_a_bad_layout_fails_on_every_rank_without_hanging(stdlib_dataset, tmp_path):
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path), "parallel.ep=3", timeout_s=120)
    assert str(caught.value).count("parallel.ep: 3 does not divide the world size 2") == 2


def test_an_error_only_the_main_rank_meets_is_reported_by_every_rank(stdlib_dataset, tmp_path):
    """A busy Prometheus port (only rank 0 serves one): rank 1 says why it stops too, and nothing of the earlier
    run is replaced."""
    import socket
    import subprocess
    import sys

    from conftest import REPO

    base = [
        sys.executable,
        "-m",
        "ferry",
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        f"data.sources.0.path={stdlib_dataset}",
        "model.vocab_size=512",
        f"run.dir={tmp_path}",
        "train.steps=1",
        "eval.sources=[]",
    ]
    assert subprocess.run(base, capture_output=True, text=True, timeout=300).returncode == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        served = ["metrics.sinks.prometheus.enabled=true", f"metrics.sinks.prometheus.port={taken.getsockname()[1]}"]
        result = subprocess.run([*base, "--nproc", "2", *served], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "ferry: rank 0: error: metrics.sinks.prometheus: cannot listen on" in result.stderr
    assert "ferry: rank 1: error: rank 0: metrics.sinks.prometheus: cannot listen on" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_nproc_launch_reports_each_ranks_error_and_exits_2(stdlib_dataset, tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    missing = tmp_path / "no-dataset"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry",
            "train",
            str(REPO / "configs" / "tiny.yaml"),
            "--nproc",
            "2",
            f"data.sources.0.path={missing}",
            "model.vocab_size=512",
            f"run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"'{missing}' is not a prepared dataset" in result.stderr
    for rank in (0, 1):
        reported = (
            f"ferry: rank {rank}: error: data.sources.0 (stdlib): '{missing}' is not a prepared dataset"
            in result.stderr
            or f"ferry: rank {rank} was stopped by the launcher" in result.stderr
        )
        assert reported, f"rank {rank}'s fate is not reported"
    assert "Traceback" not in result.stderr


def test_nproc_launch_refuses_a_layout_the_job_cannot_take_before_any_rank_starts(stdlib_dataset, tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry",
            "train",
            str(REPO / "configs" / "tiny.yaml"),
            "--nproc",
            "2",
            f"data.sources.0.path={stdlib_dataset}",
            "model.vocab_size=512",
            f"run.dir={tmp_path}",
            "parallel.ep=3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "ferry: error: parallel.ep: 3 does not divide the world size 2" in result.stderr
    assert "rank 0" not in result.stderr and "rank 1" not in result.stderr, "no rank was started"
    assert "Traceback" not in result.stderr


def test_checkpointed_expert_parallel_training_equals_the_plain_ep_run(stdlib_dataset, tmp_path):
    """EP2 with ZeRO-1, blocks recomputed in the backward (selective, then full): the exchange's rows are the
    first run's, so the losses equal the plain EP2 run's bit for bit (the same kernels: EP runs the experts
    behind the dispatcher either way), its collectives are not issued again (counted where they reach the
    process group) and each step's record counts the same bytes."""
    layout = ("parallel.ep=2", "optim.zero=true", "train.steps=3")
    runs_by_mode = {
        mode: run_on_ranks(
            runs.train_counting_exchanges,
            2,
            str(stdlib_dataset),
            str(tmp_path / mode),
            *layout,
            f"train.activation_checkpointing={mode}",
        )[0]
        for mode in ("none", "selective", "full")
    }
    plain = runs_by_mode.pop("none")
    assert plain["exchanges"] > 0
    for checkpointed in runs_by_mode.values():
        assert checkpointed["losses"] == plain["losses"]
        assert checkpointed["exchanges"] == plain["exchanges"]
        assert [r["comm_bytes"] for r in checkpointed["records"]] == [r["comm_bytes"] for r in plain["records"]]


def test_checkpointed_fsdp_training_equals_the_plain_fsdp_run(stdlib_dataset, tmp_path):
    """FSDP gathers a block's weights around its module call and the recompute runs inside it, in the backward
    it already gathers for: the same all-gathers, and the same losses bit for bit. The plain run is pinned to the
    portable routed experts, which a checkpointed run takes: under `auto` the plain run takes the CPU's fused
    loop, which cannot be replayed and sums each expert's rows in another order, and every block's gradient then
    differs in its last bits (by 2e-9 at most, measured on gradients of up to 3e-2) from the first step on."""
    layout = ("parallel.mode=fsdp", "train.steps=3", 'kernels.ops."moe.routed_experts"=portable')
    plain, checkpointed = (
        run_on_ranks(
            runs.train_run,
            2,
            str(stdlib_dataset),
            str(tmp_path / mode),
            *layout,
            f"train.activation_checkpointing={mode}",
        )[0]
        for mode in ("none", "selective")
    )
    assert checkpointed["losses"] == plain["losses"]
    assert [r["grad_norm"] for r in checkpointed["records"]] == [r["grad_norm"] for r in plain["records"]]
    assert [r["comm_bytes"] for r in checkpointed["records"]] == [r["comm_bytes"] for r in plain["records"]]


def test_a_chunked_expert_parallel_exchange_trains_as_the_single_exchange(stdlib_dataset, tmp_path):
    """EP2, `parallel.ep_overlap: chunked` in 2 and 4 parts: every expert computes the same rows, in parts, so the
    losses equal the single exchange's to 1e-8 relative over 4 steps (measured 1e-10) and the gradient norms to
    1e-6 (measured 3e-8 at the fourth step, 3e-12 at the first: the weight gradients are summed over the parts,
    in another order, and the weights drift apart by as much). Every step issues its exchanges in parts, each
    measured in flight and waited for (how much of them the experts compute through is a timing, which a loaded
    2-core machine can bring to 0: benchmarks/ep_overlap.py measures it); the single exchange overlaps nothing.
    Recomputed under activation checkpointing, the chunked
    exchange is the same bit for bit, with no exchange issued again."""
    layout = (str(stdlib_dataset), "parallel.ep=2", "train.steps=4")
    variants = {
        "none": (),
        "chunked2": ("parallel.ep_overlap=chunked",),
        "chunked4": ("parallel.ep_overlap=chunked", "parallel.ep_chunks=4"),
        "chunked2-recomputed": ("parallel.ep_overlap=chunked", "train.activation_checkpointing=selective"),
    }
    done = {
        name: run_on_ranks(runs.train_counting_exchanges, 2, layout[0], str(tmp_path / name), *layout[1:], *extra)[0]
        for name, extra in variants.items()
    }
    single = done["none"]
    for name in ("chunked2", "chunked4"):
        assert _relative(done[name]["losses"], single["losses"]) < 1e-8
        norms = [[record["grad_norm"] for record in done[run]["records"]] for run in (name, "none")]
        assert _relative(*norms) < 1e-6
        assert all(0 <= record["ep_overlap_share"] <= 1 and record["ep_comm_s"] > 0 for record in done[name]["records"])
        parts = [
            (record["ep_exchanges"], plain["ep_exchanges"])
            for record, plain in zip(done[name]["records"], single["records"])
        ]
        assert all(chunked > whole for chunked, whole in parts), "every step exchanged its rows in parts"
    assert all(record["ep_overlap_share"] == 0 for record in single["records"])
    recomputed = done["chunked2-recomputed"]
    assert recomputed["losses"] == done["chunked2"]["losses"]
    assert recomputed["exchanges"] == done["chunked2"]["exchanges"]


def test_ep_overlap_auto_measures_every_candidate_and_trains_as_the_one_it_keeps(stdlib_dataset, tmp_path):
    """The trial steps restore the run after each candidate, so the run that follows is, bit for bit, the run
    that set the kept candidate from the start; run.json holds every candidate's figures and the choice is the
    fastest of them. Each candidate ran its own exchange: the parts and the per-expert exchanges multiply the
    messages (how much of them overlaps is a timing, measured by benchmarks/ep_overlap.py)."""
    auto = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path / "auto"),
        "parallel.ep=2",
        "train.steps=3",
        "parallel.ep_overlap=auto",
        "parallel.ep_overlap_trial_steps=1",
    )[0]
    record = json.loads((tmp_path / "auto" / "run.json").read_text())["ep_overlap"]
    candidates = record["candidates"]
    assert set(candidates) == {"none", "chunked2", "chunked4", "rowwise"} and record["trial_steps"] == 1
    assert record["chosen"] == min(candidates, key=lambda name: candidates[name]["step_s"])
    assert candidates["none"]["ep_overlap_share"] == 0
    assert all(0 <= figures["ep_overlap_share"] <= 1 for figures in candidates.values())
    exchanges = {name: figures["ep_exchanges"] for name, figures in candidates.items()}
    assert exchanges["none"] < exchanges["chunked2"] < exchanges["chunked4"]
    assert exchanges["none"] < exchanges["rowwise"]
    kept = {
        "none": ("parallel.ep_overlap=none",),
        "chunked2": ("parallel.ep_overlap=chunked",),
        "chunked4": ("parallel.ep_overlap=chunked", "parallel.ep_chunks=4"),
        "rowwise": ("parallel.ep_dispatch=rowwise",),
    }[record["chosen"]]
    fixed = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "fixed"), "parallel.ep=2", "train.steps=3", *kept
    )[0]
    assert auto["losses"] == fixed["losses"]
    assert len(auto["records"]) == 3, "the trial steps are not the run's steps"


def test_ep_overlap_auto_is_refused_for_objectives_that_use_up_what_a_trial_step_reads(stdlib_dataset, tmp_path):
    from ferry.config import ConfigError

    with pytest.raises(ConfigError, match="ep_overlap auto measures trial steps of next-token training"):
        runs.tiny_config(str(stdlib_dataset), str(tmp_path), "train.objective=dpo", "parallel.ep_overlap=auto")


def test_the_rowwise_exchange_trains_as_the_permuted_one(stdlib_dataset, tmp_path):
    """EP2, `parallel.ep_dispatch: rowwise`: the rows reach the experts in the order the permuted exchange copies
    them into, so the losses and gradient norms are the same bit for bit over 4 steps, with the same bytes moved in
    one exchange per local expert; recomputed under activation checkpointing, nothing is sent again."""
    layout = ("parallel.ep=2", "train.steps=4")
    variants = {
        "permuted": (),
        "rowwise": ("parallel.ep_dispatch=rowwise",),
        "rowwise-recomputed": ("parallel.ep_dispatch=rowwise", "train.activation_checkpointing=selective"),
    }
    done = {
        name: run_on_ranks(
            runs.train_counting_exchanges, 2, str(stdlib_dataset), str(tmp_path / name), *layout, *extra
        )[0]
        for name, extra in variants.items()
    }
    permuted, rowwise = done["permuted"], done["rowwise"]
    assert rowwise["losses"] == permuted["losses"]
    for key in ("grad_norm", "comm_bytes"):
        assert [r[key] for r in rowwise["records"]] == [r[key] for r in permuted["records"]]
    assert rowwise["exchanges"] > permuted["exchanges"], "one exchange per local expert"
    assert done["rowwise-recomputed"]["losses"] == rowwise["losses"]
    assert done["rowwise-recomputed"]["exchanges"] == rowwise["exchanges"]
    from ferry.config import ConfigError

    with pytest.raises(ConfigError, match="ep_dispatch rowwise exchanges per local expert"):
        runs.tiny_config(
            str(stdlib_dataset), str(tmp_path), "parallel.ep_dispatch=rowwise", "parallel.ep_overlap=chunked"
        )

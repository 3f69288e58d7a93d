"""Context parallelism (`parallel.cp`): ranks splitting every sequence train as one process does, compose with the
other layouts, resume across degrees, keep half the activations at cp 2, and report their exchanges.

The runs read windows of 1,024 byte-tokens packed from short documents (paragraphs of Python's standard library,
hundreds of bytes each), with document masking on: every window holds many document borders, which the split
sequence's chunks cut across. Tolerance: the suite's layout tolerance, 1e-5 relative per step over 10 fp32 steps
(observed below 2e-7: a split sequence sums its attention, routers' means and gradients in another order).
"""

from __future__ import annotations

import inspect
import json
import textwrap

import distributed_training as runs
import pytest

from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.config import UserError
from ferry.data import prepare_dataset
from ferry.data.prepare import PrepareSpec

LAYOUT_TOLERANCE = 1e-5
LONG = (
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "data.document_masking=true",
    "train.global_batch=4",
    "train.micro_batch=2",
)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def packed_documents(tmp_path_factory):
    """Short documents (a few hundred bytes each), byte-tokenised: a 1,024-token window packs several."""
    import bisect  # noqa: E401
    import calendar
    import fnmatch
    import heapq
    import json.decoder
    import json.encoder
    import shlex
    import string

    modules = (textwrap, json.decoder, json.encoder, string, shlex, fnmatch, heapq, bisect, calendar, inspect)
    documents = [part for module in modules for part in inspect.getsource(module).split("\n\n") if part.strip()]
    root = tmp_path_factory.mktemp("packed")
    corpus = root / "documents.jsonl"
    corpus.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    prepare_dataset(PrepareSpec(inputs=[str(corpus)], tokenizer="byte"), root / "dataset")
    return root / "dataset"


@pytest.fixture(scope="module")
def reference(packed_documents, tmp_path_factory):
    """The 1-process run (held-out evaluation at steps 5 and 10, checkpoints at 4, 8 and 10), and cp 2 on 2 ranks."""
    data = str(packed_documents)
    held_out = (
        f"eval.sources=[{{name: held_out, path: {data}}}]",
        "eval.interval=5",
        "eval.batches=1",
        "eval.batch_size=2",
        "checkpoint.interval=4",
    )
    single_dir = tmp_path_factory.mktemp("single")
    single = runs.train_run(data, str(single_dir), *LONG, *held_out)
    cp_dir = tmp_path_factory.mktemp("cp2")
    cp = run_on_ranks(runs.train_run, 2, data, str(cp_dir), *LONG, *held_out, "parallel.cp=2")
    return {"single": single, "single_dir": single_dir, "cp": cp, "cp_dir": cp_dir, "held_out": held_out}


def test_documents_are_packed_so_that_chunks_cut_across_them(packed_documents):
    import numpy as np

    eos = json.loads((packed_documents / "manifest.json").read_text())["tokenizer"]["eos_id"]
    tokens = np.concatenate([np.load(shard) for shard in sorted(packed_documents.glob("shard-*.npy"))])
    assert len(tokens) / (tokens == eos).sum() < 400, "windows of 1,024 tokens would hold few document borders"


def test_cp2_trains_and_evaluates_as_one_process(reference):
    single, ranks = reference["single"], reference["cp"]
    assert ranks[0]["losses"] == ranks[1]["losses"], "every rank reports the global loss"
    assert _relative(ranks[0]["losses"], single["losses"]) < LAYOUT_TOLERANCE

    def held_out(records: list[dict]) -> list[float]:
        return [record["eval.loss"]["held_out"] for record in records if "eval.loss" in record]

    assert len(held_out(single["records"])) == 2
    assert _relative(held_out(ranks[0]["records"]), held_out(single["records"])) < LAYOUT_TOLERANCE
    run = json.loads((reference["cp_dir"] / "run.json").read_text())
    assert run["layout"]["cp_degree"] == 2


def test_a_cp_run_reports_its_exchanges_at_their_analytic_size(reference):
    """Per step: each attention layer gathers every rank's keys and values (2 x 2 key heads x 8 wide, fp32) of the
    micro-batch's 2 x 1,024 positions, in the forward, and reduce-scatters their gradients in the backward; each MoE
    layer sums its 4 loads and its count. 2 micro-batches, 2 attention layers, 1 MoE layer."""
    record = reference["cp"][0]["records"][-1]
    gather = 2 * 1024 * (2 * 2 * 8) * 4
    analytic = 2 * (2 * 2 * gather + 1 * (4 + 1) * 4)
    assert record["cp.bytes"] == analytic
    assert record["cp.comm_s"] > 0
    assert "cp.bytes" not in reference["single"]["records"][-1]


def test_a_checkpoint_resumes_across_context_parallel_degrees(reference, packed_documents, tmp_path):
    """cp 2 -> 1 -> 2: one process resumes the cp 2 run's step-4 checkpoint and saves at step 8, which cp 2 resumes:
    each continues the uninterrupted run, data cursor included."""
    data, held_out = str(packed_documents), reference["held_out"]
    single = reference["single"]["losses"]
    one = runs.train_run(
        data, str(tmp_path / "one"), *LONG, *held_out, f"resume={reference['cp_dir'] / 'checkpoints' / 'step-00000004'}"
    )
    assert _relative(one["losses"], single[4:]) < LAYOUT_TOLERANCE
    two = run_on_ranks(
        runs.train_run,
        2,
        data,
        str(tmp_path / "two"),
        *LONG,
        *held_out,
        "parallel.cp=2",
        f"resume={tmp_path / 'one' / 'checkpoints' / 'step-00000008'}",
    )
    assert _relative(two[0]["losses"], single[8:]) < LAYOUT_TOLERANCE


def test_cp2_with_experts_split_over_the_same_ranks_and_zero_trains_as_one_process(
    reference, packed_documents, tmp_path
):
    ranks = run_on_ranks(
        runs.train_run,
        2,
        str(packed_documents),
        str(tmp_path),
        *LONG,
        "parallel.cp=2",
        "parallel.ep=2",
        "optim.zero=true",
        "train.activation_checkpointing=full",
        "checkpoint.interval=0",
    )
    assert _relative(ranks[0]["losses"], reference["single"]["losses"]) < LAYOUT_TOLERANCE


@pytest.mark.parametrize("layout", [("parallel.ep=2", "optim.zero=true"), ("parallel.pp=2",)], ids=["dp2-ep2", "pp2"])
def test_cp2_on_4_ranks_composes_with_data_expert_and_pipeline_parallelism(packed_documents, tmp_path, layout):
    """cp 2 x dp 2 with experts split over 2 ranks, and 2 pipeline stages of cp 2, on 4 ranks: as one process with
    the same micro-batches, held-out losses too (shorter windows: 4 processes share 2 cores)."""
    data = str(packed_documents)
    shorter = (
        "model.max_seq_len=256",
        "data.seq_len=256",
        "data.document_masking=true",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.steps=6",
        "checkpoint.interval=0",
        f"eval.sources=[{{name: held_out, path: {data}}}]",
        "eval.interval=3",
        "eval.batches=1",
        "eval.batch_size=2",
    )
    single = runs.train_run(data, str(tmp_path / "one"), *shorter)
    ranks = run_on_ranks(runs.train_run, 4, data, str(tmp_path / "four"), *shorter, "parallel.cp=2", *layout)
    assert all(rank["losses"] == ranks[0]["losses"] for rank in ranks)
    assert _relative(ranks[0]["losses"], single["losses"]) < LAYOUT_TOLERANCE

    def held_out(records: list[dict]) -> list[float]:
        return [record["eval.loss"]["held_out"] for record in records if "eval.loss" in record]

    assert len(held_out(single["records"])) == 2
    assert _relative(held_out(ranks[0]["records"]), held_out(single["records"])) < LAYOUT_TOLERANCE


@pytest.mark.parametrize(
    "variant",
    [
        (
            "model.attention=mla",
            "model.n_kv_heads=4",
            "model.mla.kv_lora_rank=16",
            "model.mla.qk_nope_head_dim=8",
            "model.mla.qk_rope_head_dim=8",
            "model.mla.v_head_dim=8",
        ),
        ("model.skip=farskip",),
        ("train.loss_chunk=128",),
    ],
    ids=["mla", "farskip", "chunked-head-loss"],
)
def test_cp2_splits_latent_attention_and_farskip_blocks_as_one_process_computes_them(
    packed_documents, tmp_path, variant
):
    """MLA gathers each key's latent and rotary part and expands them on every rank; FarSkip's MoE exchange is in
    flight while the next attention gathers its keys; the chunked head loss takes each rank's targets inside the
    model."""
    data = str(packed_documents)
    shorter = (
        "model.max_seq_len=256",
        "data.seq_len=256",
        "data.document_masking=true",
        "train.global_batch=4",
        "train.micro_batch=2",
        "train.steps=6",
        "checkpoint.interval=0",
        *variant,
    )
    single = runs.train_run(data, str(tmp_path / "one"), *shorter)
    extra = ("parallel.ep=2",) if "model.skip=farskip" in variant else ()
    ranks = run_on_ranks(runs.train_run, 2, data, str(tmp_path / "two"), *shorter, "parallel.cp=2", *extra)
    assert _relative(ranks[0]["losses"], single["losses"]) < LAYOUT_TOLERANCE


def test_cp2_keeps_half_the_activations_of_one_process(packed_documents, tmp_path):
    """One training forward of 4 rows of 1,024 tokens (packed documents): what it keeps for the backward per rank,
    at cp 1, 2 and 4 (measured 51.5 MB, 25.7 MB and 13.4 MB: 0.50 and 0.26 of one process); the keys and values
    gathered from the other ranks are what keeps it above a half and a quarter."""
    data = str(packed_documents)
    one = runs.kept_by_a_forward(data, str(tmp_path / "one"), 1024)["kept"]
    two = run_on_ranks(runs.kept_by_a_forward, 2, data, str(tmp_path / "two"), 1024, "parallel.cp=2")
    assert max(rank["kept"] for rank in two) <= 0.55 * one
    four = run_on_ranks(
        runs.kept_by_a_forward,
        4,
        data,
        str(tmp_path / "four"),
        1024,
        "parallel.cp=4",
        "train.global_batch=4",
        "train.micro_batch=4",
    )
    assert max(rank["kept"] for rank in four) <= 0.3 * one


def test_layouts_that_do_not_compose_are_refused_before_any_rank_starts(make_config, capsys):
    with pytest.raises(UserError, match=r"parallel.cp: 3 does not divide the world size 2; set parallel.cp to one of"):
        make_config("parallel.cp=3").check_world_size(2)
    with pytest.raises(UserError, match="parallel.cp: 2 does not divide the 1 ranks of each pipeline stage"):
        make_config("parallel.cp=2", "parallel.pp=2", "model.n_layers=2").check_world_size(2)
    assert main(["train", "configs/tiny.yaml", "parallel.cp=2", "train.objective=grpo"]) == 2
    assert "cp 2: objective grpo generates its rollouts" in capsys.readouterr().err


def test_the_memory_model_and_the_micro_batch_choice_know_cp(make_config):
    from ferry.train.memory import choose_micro_batch, memory_estimate

    long = ("model.max_seq_len=1024", "data.seq_len=1024", "train.global_batch=8")
    whole = memory_estimate(make_config(*long), 2, "cpu")
    split = memory_estimate(make_config(*long, "parallel.cp=2"), 2, "cpu")
    assert split.backward_bytes < 0.6 * whole.backward_bytes
    config = make_config(*long, "parallel.cp=2", "train.micro_batch=auto")
    chosen, record = choose_micro_batch(config, config.check_world_size(2), "cpu")
    assert chosen == 8, "both ranks of the group read the same 8 rows: a micro-batch of all 8 splits them"


def test_launch_explain_places_the_context_parallel_groups(tmp_path, capsys):
    argv = [
        "launch",
        "configs/tiny.yaml",
        "--platform",
        "cpu",
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--scheduler",
        "slurm",
        "--out",
        str(tmp_path / "launch"),
        "parallel.cp=2",
        "--explain",
    ]
    assert main(argv) == 0
    assert (
        "context parallelism: groups of 2 consecutive ranks split every sequence (inside a node); the data is "
        "split over 2 data rank(s)"
    ) in capsys.readouterr().out

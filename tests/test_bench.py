"""`ferry bench`: suites as data, identical inputs on every layout, the record, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data.synthetic import synthetic_tokens
from ferry.portability.bench import suites
from ferry.portability.bench.suites import load_suite

SUITES = ["moe-tiny", "moe-tiny-ep2", "moe-tiny-pp2", "olmoe-1b-7b", "olmoe-1b-7b-ep8"]
KEYS = {"suite", "suite_digest", "input_digest", "tokens_per_s", "tokens_per_s_per_device", "mfu", "environment"}


def bench(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    code = main(["bench", *argv, "--out", str(out), "--dir", str(tmp_path / name)])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def short_suite(folder, name):
    """The standard suite `name` as a file of its own that measures 4 steps after 1 warm-up step instead of 12
    after 3: the same model, batch, tokens and initial weights, a third of the steps."""
    raw = yaml.safe_load((suites.SUITES_DIR / f"{name}.yaml").read_text())
    raw.update(warmup_steps=1, measured_steps=4)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """moe-tiny on one rank (auto kernels), on two ranks with experts split, with portable kernels, and
    moe-tiny-ep2 (cuda too when a GPU is here), each as a short suite."""
    root = tmp_path_factory.mktemp("bench")
    tiny, tiny_ep2 = short_suite(root, "moe-tiny"), short_suite(root, "moe-tiny-ep2")
    runs = {
        "single": (tiny,),
        "ep2-layout": (tiny, "--nproc", "2", "parallel.ep=2"),
        "portable": (tiny, "kernels.policy=portable"),
        "ep2-suite": (tiny_ep2,),
    }
    if torch.cuda.is_available():
        runs["cuda"] = (tiny, "--device", "cuda")
    found = {}
    for name, argv in runs.items():
        code, record = bench(root, name, *argv)
        assert code == 0, name
        found[name] = record
    return root, found


def test_every_suite_loads_and_names_its_shape():
    for name in SUITES:
        suite = load_suite(name)
        assert suite.name == name and suite.version >= 1 and len(suite.digest) == 64
    olmoe = load_suite("olmoe-1b-7b").config["model"]
    assert (olmoe["dim"], olmoe["n_layers"], olmoe["moe"]["num_experts"], olmoe["moe"]["top_k"]) == (2048, 16, 64, 8)
    assert olmoe["moe"]["expert_ffn_dim"] == 1024 and load_suite("olmoe-1b-7b").config["data"]["seq_len"] == 4096
    assert load_suite("olmoe-1b-7b-ep8").nproc == 8 and load_suite("olmoe-1b-7b-ep8").config["parallel"]["ep"] == 8


def test_a_changed_suite_changes_its_digest_and_a_new_description_does_not():
    suite = load_suite("moe-tiny")
    assert suite.model_copy(update={"measured_steps": 13}).digest != suite.digest
    changed = json.loads(json.dumps(suite.config))
    changed["model"]["moe"]["top_k"] = 1
    assert suite.model_copy(update={"config": changed}).digest != suite.digest
    assert suite.model_copy(update={"description": "reworded"}).digest == suite.digest


def test_synthetic_tokens_are_a_function_of_the_seed_alone():
    a, b = synthetic_tokens(7, 512, 10_000, 1.1), synthetic_tokens(7, 512, 10_000, 1.1)
    assert (a == b).all() and a.min() >= 0 and a.max() < 512
    assert not (synthetic_tokens(8, 512, 10_000, 1.1) == a).all()
    counts = torch.bincount(torch.from_numpy(a), minlength=512)
    assert counts[0] > 5 * counts[20], "Zipf: frequent tokens are far more frequent"


def test_the_same_suite_has_the_same_inputs_on_every_layout_kernel_and_device(records):
    _, found = records
    same = [found[name] for name in found if name != "ep2-suite"]
    for key in ("input_digest", "tokens_digest", "weights_digest", "suite_digest"):
        assert len({record[key] for record in same}) == 1, key
    assert found["ep2-layout"]["layout"] == {"world_size": 2, "ep_degree": 2, "mode": "ep"}
    assert found["ep2-suite"]["input_digest"] == found["single"]["input_digest"]
    assert found["ep2-suite"]["suite_digest"] != found["single"]["suite_digest"]


def test_a_record_holds_the_figures_medians_spread_and_where_it_ran(records):
    _, found = records
    record = found["single"]
    assert KEYS <= set(record)
    assert record["measured_steps"] == 4 and record["warmup_steps"] == 1
    spread = record["spread"]["tokens_per_s"]
    assert spread["min"] <= record["tokens_per_s"] == spread["median"] <= spread["max"]
    assert 0 < record["mfu"] < 1 and record["tokens_per_s_per_device"] == record["tokens_per_s"]
    assert record["hardware"]["profile"] == "cpu" and record["hardware"]["price_per_device_hour_usd"] == 0.10
    assert record["kernels"]["policy"] == "auto" and record["precision"]["compute_dtype"] == "fp32"
    assert record["environment"]["torch"] == torch.__version__
    measured = record["conditions"]  # how busy the machine was is not asserted: it varies
    assert measured["ranks"] == 1 and measured["torch_threads"] == record["environment"]["cpu_threads"]
    assert measured["cpu_model"] == record["environment"]["cpu_model"] and isinstance(measured["under_load"], bool)
    assert found["portable"]["kernels"]["policy"] == "portable"


def test_the_ep2_suite_waits_on_its_all_to_all(records):
    _, found = records
    record = found["ep2-suite"]
    assert record["nproc"] == 2 and record["layout"]["ep_degree"] == 2
    assert record["ep_wait_s"] > 0 and record["comm_s"] > 0 and record["comm_bytes_per_step"] > 0
    assert record["comm_compute_ratio"] > 0
    assert found["single"]["ep_wait_s"] == 0 and found["single"]["comm_s"] == 0


def test_a_suite_that_cannot_fit_is_refused_naming_the_memory_it_needs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(suites, "device_memory_bytes", lambda device, ranks=1: ("this host", 64 * 2**30))
    code, record = bench(tmp_path, "olmoe", "olmoe-1b-7b", "--device", "cpu")
    err = capsys.readouterr().err
    assert code == 2 and record is None
    assert "olmoe-1b-7b needs about 128.9 GiB per rank" in err and "AdamW moments 103.1 GiB" in err
    assert "the optimizer step's temporaries 25.8 GiB" in err and "this host has 64.0 GiB per rank" in err
    assert not (tmp_path / "olmoe").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_a_gpu_suite_without_a_gpu_is_refused_naming_the_memory_it_needs(tmp_path, capsys):
    code, record = bench(tmp_path, "olmoe", "olmoe-1b-7b")
    err = capsys.readouterr().err
    assert code == 2 and record is None
    assert "runs on cuda, but no CUDA or ROCm device is visible here; it needs about 128.9 GiB per rank" in err


def fake_gpus(monkeypatch, *memories):
    """A CUDA host with GPUs of these sizes, as torch would report it (this machine has none)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(memories))
    gpus = [SimpleNamespace(name="Fake GPU", total_memory=memory) for memory in memories]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])


def test_a_suite_with_more_ranks_than_gpus_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    fake_gpus(monkeypatch, 141 * 2**30)
    code, record = bench(tmp_path, "ep2", "moe-tiny-ep2", "--device", "cuda")
    err = capsys.readouterr().err
    assert code == 2 and record is None
    assert "suite moe-tiny-ep2 runs 2 ranks on cuda, one GPU each, but 1 GPU(s) are visible here" in err
    assert not (tmp_path / "ep2").exists()


def test_the_memory_check_takes_the_smallest_gpu_the_ranks_use(tmp_path, monkeypatch):
    suite = load_suite("moe-tiny-ep2")
    config = suite.run_config(tmp_path, "cuda", [])
    fake_gpus(monkeypatch, 141 * 2**30, 141 * 2**30, 2**20)  # the third GPU is not used by two ranks
    assert suites.check_fits(suite, config, 2).total_bytes < 2**30
    fake_gpus(monkeypatch, 141 * 2**30, 2**20)
    with pytest.raises(UserError, match=r"Fake GPU \(GPU 1, the smallest of the 2 the ranks take\) has 0\.0"):
        suites.check_fits(suite, config, 2)


def test_a_record_without_the_initial_weights_digest_is_refused(tmp_path):
    from ferry.portability.bench.bench import BenchError, bench_record

    suite = load_suite("moe-tiny")
    config = suite.run_config(tmp_path, "cpu", [])
    metrics = [{"step": step, "tokens_per_s": 1.0} for step in range(1, suite.total_steps + 1)]
    with pytest.raises(BenchError, match="recorded no digest of its initial weights"):
        bench_record(suite, config, [], 1, {"initial_weights_xxh3": None}, metrics, "t" * 64)
    record = bench_record(suite, config, [], 1, {"initial_weights_xxh3": "w" * 32}, metrics, "t" * 64)
    assert record["weights_digest"] == "w" * 32


def test_a_figure_measured_under_load_says_so_in_the_summary_and_an_older_record_still_prints(tmp_path):
    from ferry.portability.bench.bench import FIGURES, bench_record, summary_lines
    from ferry.portability.rehearsal.conditions import MachineLoad, throughput_conditions

    suite = load_suite("moe-tiny")
    config = suite.run_config(tmp_path, "cpu", [])
    figures = dict.fromkeys(FIGURES.values(), 1.0) | {"tokens_per_s": 4000.0, "tokens_per_s_per_device": 4000.0}
    metrics = [{"step": step, **figures} for step in range(1, suite.total_steps + 1)]
    run = {
        "initial_weights_xxh3": "w" * 32,
        "hardware": {"profile": "cpu"},
        "environment": {"cpu_model": "AMD EPYC", "logical_cores": 2, "cpu_threads": 2},
        "layout": {"world_size": 1},
    }
    record = bench_record(suite, config, [], 1, run, metrics, "t" * 64)
    older = "\n".join(summary_lines(record))  # a record of a ferry that did not measure the load
    assert "4,000 tokens/s (min 4,000, max 4,000), 4,000 per device" in older
    assert "  conditions: load unknown: recorded before ferry measured it" in older

    busy = summary_lines({**record, "conditions": throughput_conditions(MachineLoad((3.9,), 1.2), run)})
    assert "4,000 tokens/s (min 4,000, max 4,000) (measured under load: not a fair figure), 4,000 per device" in busy[0]
    assert busy[1] == (
        "  conditions: measured under load: other processes used 1.2 of 2 cores, load average up to 3.9 "
        "(AMD EPYC, 1 rank x 2 threads): not a fair figure"
    )
    at_rest = summary_lines({**record, "conditions": throughput_conditions(MachineLoad((0.6,), 0.1), run)})
    assert "not a fair figure" not in "\n".join(at_rest)
    assert at_rest[1] == (
        "  conditions: other processes used 0.1 of 2 cores, load average up to 0.6 (AMD EPYC, 1 rank x 2 threads)"
    )


def test_the_olmoe_estimate_fits_an_h200_and_counts_every_peak():
    from pathlib import Path

    config = load_suite("olmoe-1b-7b").run_config(Path("/nonexistent"), "cuda", [])
    estimate = suites.memory_estimate(config, 1, "cuda")
    params = 6_919_161_856
    assert estimate.state_bytes == params * 16  # fp32 parameters and gradients, two fp32 moments
    assert estimate.optimizer_bytes == params * 4  # AdamW's temporary square root
    copies = params * 2  # the bf16 weights the backward keeps
    assert estimate.backward_bytes > copies
    h200 = 143_771 * 2**20  # what torch reports for an H200 (nvidia-smi: 143771 MiB)
    assert estimate.total_bytes <= suites.HEADROOM * h200


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["no-such-suite"], "'no-such-suite' is neither a file nor a known benchmark suite"),
        (["moe-tiny", "model.dimension=3"], "model.dimension"),
        (["moe-tiny", "--nproc", "0"], "--nproc must be at least 1"),
        (["moe-tiny", "--nproc", "3"], "not a multiple of train.micro_batch x ranks"),
        (["moe-tiny-ep2", "--nproc", "1"], "parallel.ep (2) does not divide the 1 rank(s)"),
        (["moe-tiny", "train.steps=5"], "train.steps is fixed by the suite"),
        (["moe-tiny", "run.seed=3"], "run.seed is fixed by the suite"),
        # the starting weights and the objective: the weights digest would be "None" after init_from
        (["moe-tiny", "init_from=runs/elsewhere/checkpoints"], "init_from is fixed by the suite"),
        (["moe-tiny", "init_optimizer=true"], "init_optimizer is fixed by the suite"),
        (["moe-tiny", "train.objective=dpo"], "train.objective is fixed by the suite"),
        (["moe-tiny", 'train."objective"=dpo'], "train.objective is fixed by the suite"),
        (["moe-tiny", "train={objective: dpo}"], "train is fixed by the suite"),
    ],
)
def test_bad_bench_input_exits_2(argv, culprit, tmp_path, capsys):
    code, record = bench(tmp_path, "bad", *argv)
    assert code == 2 and record is None
    assert culprit in capsys.readouterr().err


def test_cost_of_real_records_vendor_against_portable_kernels(records, tmp_path):
    root, found = records
    paths = [str(root / "single.json"), str(root / "portable.json")]
    assert main(["cost", *paths, "--out", str(tmp_path / "cost")]) == 0
    rows = json.loads((tmp_path / "cost" / "cost.json").read_text())["records"]
    for row, name in zip(rows, ("single", "portable")):
        per_hour = found[name]["tokens_per_s_per_device"] * 3600
        assert row["usd_per_million_tokens_rent"] == pytest.approx(0.10 / per_hour * 1e6)
        assert row["measured_on_cpu"]
    assert rows[0]["label"] == "cpu (cpu x1, kernels auto)"
    assert rows[1]["label"] == "cpu (cpu x1, kernels portable) [kernels.policy=portable]"
    scaling = json.loads((tmp_path / "cost" / "cost.json").read_text())["scaling"]
    assert scaling == []  # one layout: nothing to scale


def test_a_scaling_view_from_one_suite_at_two_layouts(records, tmp_path):
    root, found = records
    assert main(["cost", str(root / "single.json"), str(root / "ep2-layout.json"), "--out", str(tmp_path / "c")]) == 0
    scaling = json.loads((tmp_path / "c" / "cost.json").read_text())["scaling"]
    assert [(row["world_size"], row["ep_degree"]) for row in scaling] == [(1, 1), (2, 2)]
    assert scaling[1]["comm_compute_ratio"] == found["ep2-layout"]["comm_compute_ratio"] > 0


def test_a_bench_dir_that_is_a_file_or_an_out_under_a_file_is_refused_before_running(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("x")
    assert main(["bench", "moe-tiny", "--out", str(tmp_path / "r.json"), "--dir", str(taken)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert main(["bench", "moe-tiny", "--out", str(taken / "r.json"), "--dir", str(tmp_path / "w")]) == 2
    assert "cannot be written" in capsys.readouterr().err and not (tmp_path / "w").exists()
    assert main(["bench", "moe-tiny", "--out", str(taken), "--dir", str(tmp_path / "w")]) == 2
    assert "already holds a record" in capsys.readouterr().err and taken.read_text() == "x"


def test_a_model_override_changes_the_workload_digest(records, tmp_path):
    root, found = records
    code, record = bench(tmp_path, "top1", str(root / "moe-tiny.yaml"), "model.moe.top_k=1")
    assert code == 0 and record["input_digest"] == found["single"]["input_digest"]
    assert record["workload_digest"] != found["single"]["workload_digest"]
    assert (
        found["ep2-layout"]["workload_digest"]
        == found["portable"]["workload_digest"]
        == found["single"]["workload_digest"]
    )

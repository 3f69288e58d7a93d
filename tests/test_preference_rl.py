"""DPO and GRPO: the losses against hand-computed values, the reference cache, short runs on the embedded
task, and bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.records import RecordDataset
from ferry.data.tasks import task_documents
from ferry.metrics.names import objective_keys
from ferry.train.objectives.preference_losses import clipped_policy_loss, dpo_losses, group_advantages, k3_kl
from ferry.train.objectives.verifiers import exact_match, numeric_match
from ferry.train.trainer import Trainer, train


@pytest.fixture(scope="module")
def chat_tokenizer(stdlib_dataset) -> Path:
    """The test corpus's tokenizer; preparing chat or record data adds the chat tokens to it."""
    return stdlib_dataset / "tokenizer.json"


def test_dpo_prefers_the_chosen_answer_and_matches_hand_values():
    policy_c, policy_r, ref_c, ref_r = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))
    losses, chosen, rejected = dpo_losses(policy_c, policy_r, ref_c, ref_r, beta=0.5, kind="sigmoid")
    margin = (-1.0 + 2.0) - (-3.0 + 2.0)  # 2.0
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * margin))))
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.5))
    swapped, _, _ = dpo_losses(policy_r, policy_c, ref_r, ref_c, beta=0.5, kind="sigmoid")
    assert losses.item() < math.log(2) < swapped.item()
    ipo, _, _ = dpo_losses(policy_c, policy_r, ref_c, ref_r, beta=0.5, kind="ipo")
    assert ipo.item() == pytest.approx((margin - 1.0) ** 2)


def test_group_advantages_clipping_and_k3():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    centred = group_advantages(rewards, scale_by_std=False)
    assert centred.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    scaled = group_advantages(rewards, scale_by_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()
    assert scaled[0, 0].item() == pytest.approx(0.5 / (std + 1e-4))
    assert scaled[1].abs().max().item() == 0.0
    logps = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    losses, clipped = clipped_policy_loss(logps, torch.zeros(3), torch.tensor([1.0, -1.0, 1.0]), 0.2, 0.28)
    assert losses.tolist() == pytest.approx([-1.28, 0.8, -1.1])
    assert clipped.tolist() == [True, True, False]
    same = torch.tensor([-0.3, -2.0])
    assert k3_kl(same, same).abs().max().item() == 0.0
    assert (k3_kl(same, same + 0.5) > 0).all()


def test_verifiers():
    assert exact_match(" 9 ", "9") == 1.0 and exact_match("9.", "9") == 0.0
    assert numeric_match("the answer is 1,234.0", "1234") == 1.0
    assert numeric_match("-3 then 7", "7") == 1.0 and numeric_match("no number", "7") == 0.0


@pytest.fixture(scope="module")
def task(tmp_path_factory, chat_tokenizer: Path) -> dict[str, Path]:
    """The largest-digit task's three views and held-out sets, in the test tokenizer with the chat tokens."""
    root = tmp_path_factory.mktemp("largest")
    out = {}
    for split in ("largest", "largest-held-out"):
        for view, flags in (
            ("chat", {"chat": True, "seq_len": 64}),
            ("pairs", {"records": "preferences"}),
            ("prompts", {"records": "prompts"}),
        ):
            name = f"{view}{'-held-out' if split.endswith('held-out') else ''}"
            spec = PrepareSpec(embedded=split, tokenizer=str(chat_tokenizer), embedded_max_bytes=60_000, **flags)
            prepare_dataset(spec, root / name)
            out[name] = root / name
    spec = PrepareSpec(
        embedded="largest", tokenizer=str(chat_tokenizer), embedded_max_bytes=20_000, records="preferences"
    )
    prepare_dataset(spec, root / "pairs-fewer")
    out["pairs-fewer"] = root / "pairs-fewer"
    return out


def _config(tmp_path: Path, name: str, overrides: list[str]):
    from conftest import tiny_config

    base = ["model.vocab_size=576", "data.seq_len=64", "train.log_every=100", "checkpoint.interval=0"]
    return tiny_config(Path("unused"), tmp_path / name, *base, *overrides)


@pytest.fixture(scope="module")
def sft(tmp_path_factory, task) -> Path:
    tmp = tmp_path_factory.mktemp("sft")
    chat = f"data.sources=[{{name: chat, path: {task['chat']}}}]"
    train(_config(tmp, "sft", [chat, "train.steps=120", "optim.lr=1e-2"]))
    return tmp / "sft" / "checkpoints"


def test_the_task_views_speak_of_the_same_problems_and_never_of_held_out_ones(task):
    pairs = RecordDataset(task["pairs"], "pairs", "preferences")
    prompts = RecordDataset(task["prompts"], "prompts", "prompts")
    train_questions = {json.loads(d.text)["prompt"][0]["content"] for d in task_documents("largest", "prompts")}
    held_out = {json.loads(d.text)["prompt"][0]["content"] for d in task_documents("largest-held-out", "prompts")}
    assert not train_questions & held_out
    shared = range(min(len(pairs), len(prompts)))
    assert all((pairs.field(i, "prompt") == prompts.field(i, "prompt")).all() for i in shared)
    assert (pairs.field(0, "chosen") != pairs.field(0, "rejected")).any()


def test_a_record_file_that_changed_is_refused_before_it_is_read(tmp_path, task):
    answers = Path(shutil.copytree(task["prompts"], tmp_path / "prompts")) / "answers.json"
    assert RecordDataset(answers.parent, "intact", "prompts").verified == "xxh3_128"
    answers.write_text(answers.read_text() + "\n")  # the same answers: only the digest tells
    with pytest.raises(UserError, match=r"answers\.json' is not the file its manifest names"):
        RecordDataset(answers.parent, "changed", "prompts")
    assert RecordDataset(answers.parent, "unchecked", "prompts", verify="none").verified is None


def test_dpo_reuses_its_reference_cache_and_recomputes_it_for_new_data(tmp_path, task, sft, capsys):
    cache = tmp_path / "cache"
    common = [
        "train.objective=dpo",
        "train.steps=2",
        f"init_from={sft}",
        f"dpo.reference_cache={cache}",
        "optim.lr=1e-3",
        "run.overwrite=true",
        f"eval.sources=[{{name: held_out, path: {task['pairs-held-out']}}}]",
    ]
    first = _config(tmp_path, "dpo", [f"data.sources=[{{name: pairs, path: {task['pairs']}}}]", *common])
    train(first)
    entries = sorted(cache.glob("*.safetensors"))
    assert len(entries) == 2  # training pairs and held-out pairs
    stamps = {path: path.stat().st_mtime_ns for path in entries}
    capsys.readouterr()
    train(first)
    assert "reused from" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in cache.glob("*.safetensors")} == stamps
    other = _config(tmp_path, "dpo", [f"data.sources=[{{name: pairs, path: {task['pairs-fewer']}}}]", *common])
    capsys.readouterr()
    train(other)
    assert "(pairs) computed from" in capsys.readouterr().out
    assert len(list(cache.glob("*.safetensors"))) == 3
    new_parent = _config(
        tmp_path,
        "dpo2",
        [
            f"data.sources=[{{name: pairs, path: {task['pairs-fewer']}}}]",
            *common,
            f"init_from={tmp_path / 'dpo' / 'checkpoints'}",
        ],
    )
    capsys.readouterr()
    train(new_parent)
    assert capsys.readouterr().out.count("computed from") == 2  # the same data, another parent: both recomputed
    assert len(list(cache.glob("*.safetensors"))) == 5
    record = json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert objective_keys("dpo") <= set(record)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen"):
        assert math.isfinite(record[key])
    assert 0.0 <= record["eval/rewards/accuracy"]["held_out"] <= 1.0
    assert "moe.imbalance" in record
    # `ferry eval` on the run's last checkpoint gives its last held-out figures (the reference: its init_from)
    held_out = str(task["pairs-held-out"])
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "dpo"), "--data", held_out, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["datasets"][held_out]
    assert figures["kind"] == "preferences" and figures["records"] > 0
    assert figures["rewards/accuracy"] == record["eval/rewards/accuracy"]["held_out"]
    assert figures["rewards/margin"] == pytest.approx(record["eval/rewards/margin"]["held_out"], rel=1e-6)
    assert 0.0 <= figures["preference_accuracy"] <= 1.0 and figures["logps/chosen"] < 0
    assert main(["eval", str(tmp_path / "dpo"), "--data", held_out, "--reference", "none", "--json"]) == 0
    assert "rewards/accuracy" not in json.loads(capsys.readouterr().out)["datasets"][held_out]


def test_scoring_the_reference_reports_its_progress(tmp_path, task, sft, monkeypatch, capsys):
    """Scoring every pair under the reference takes minutes on a large set: it prints how far it is."""
    from ferry.metrics import progress as progress_module

    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    config = _config(
        tmp_path,
        "dpo",
        [
            "train.objective=dpo",
            "train.steps=1",
            f"init_from={sft}",
            "dpo.score_batch=16",
            "optim.lr=1e-3",
            f"data.sources=[{{name: pairs, path: {task['pairs']}}}]",
        ],
    )
    capsys.readouterr()
    train(config)
    batches = -(-len(RecordDataset(task["pairs"], "pairs", "preferences")) // 16)
    lines = [line.split(" after ")[0] for line in capsys.readouterr().out.splitlines() if "reference log-probs" in line]
    expected = [
        f"ferry: reference log-probs of data.sources.0 (pairs): {n}/{batches} batches of 16 pairs"
        for n in range(1, batches + 1)
    ]
    assert lines[:batches] == expected


def test_a_grpo_held_out_evaluation_during_training_reports_its_progress(tmp_path, task, sft, monkeypatch, capsys):
    """Sampling completions for every held-out prompt takes minutes on a large set: each decoding step is a
    forward the evaluation's progress counts (and the hang watchdog's clock restarts at)."""
    from ferry.metrics import progress as progress_module

    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    config = _config(
        tmp_path,
        "grpo",
        [
            "train.objective=grpo",
            f"init_from={sft}",
            f"data.sources=[{{name: prompts, path: {task['prompts']}}}]",
            f"eval.sources=[{{name: held_out, path: {task['prompts-held-out']}}}]",
            "train.global_batch=2",
            "train.micro_batch=2",
            "grpo.group_size=2",
            "grpo.max_new_tokens=3",
            "grpo.verifier=numeric",
            "train.steps=1",
        ],
    )
    capsys.readouterr()
    train(config)
    lines = [
        line.split(" after ")[0]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("ferry: held-out evaluation at step 1:")
    ]
    # sampled, then greedy: a prefill and at least one more decoding step each
    assert len(lines) >= 4
    assert lines == [f"ferry: held-out evaluation at step 1: {n} forwards" for n in range(1, len(lines) + 1)]


def test_a_new_parent_invalidates_the_reference_cache(tmp_path, task, sft):
    from ferry.train.objectives.reference import LogprobCache

    inputs = {"parent": "a", "data": ["x"], "model": {}, "precision": {}}
    assert LogprobCache(tmp_path, inputs).key != LogprobCache(tmp_path, {**inputs, "parent": "b"}).key
    assert LogprobCache(tmp_path, inputs).key != LogprobCache(tmp_path, {**inputs, "data": ["y"]}).key


def test_grpo_trains_from_rollouts_and_resumes_with_the_same_draws(tmp_path, task, sft, capsys):
    overrides = [
        "train.objective=grpo",
        f"init_from={sft}",
        f"data.sources=[{{name: prompts, path: {task['prompts']}}}]",
        f"eval.sources=[{{name: held_out, path: {task['prompts-held-out']}}}]",
        "eval.interval=0",
        "train.global_batch=4",
        "train.micro_batch=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=3",
        "grpo.verifier=numeric",
        "grpo.kl_coef=0.05",
        "grpo.iterations=2",
        "train.steps=4",
        "optim.lr=1e-3",
        "checkpoint.interval=2",
    ]
    whole = train(_config(tmp_path, "whole", overrides))
    records = [json.loads(line) for line in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("moe.imbalance" in r for r in records) and max(r["reward"] for r in records) > 0
    assert objective_keys("grpo") - {"eval/solve_rate", "eval/greedy_solve_rate"} <= set(records[0])
    assert objective_keys("grpo") <= set(records[-1])
    assert max(r["clip_fraction"] for r in records) > 0 and records[-1]["kl"] > 0  # iterations 2, kl_coef 0.05
    for key in ("reward", "reward_std", "solve_rate", "kl", "clip_fraction", "completion_length", "generate_s"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[-1]["generate_s"] > 0
    assert 0.0 <= records[-1]["eval/solve_rate"]["held_out"] <= 1.0
    # `ferry eval` on the last checkpoint draws the evaluation's completions again: the same solve rates
    held_out = str(task["prompts-held-out"])
    capsys.readouterr()
    assert main(["eval", str(whole.run_dir), "--data", held_out, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["datasets"][held_out]
    assert figures["kind"] == "prompts" and figures["verifier"] == "numeric"
    assert figures["solve_rate"] == records[-1]["eval/solve_rate"]["held_out"]
    assert figures["greedy_solve_rate"] == records[-1]["eval/greedy_solve_rate"]["held_out"]
    assert figures["solve_rate"] > 0, "nothing solved: the comparison would be empty"
    train(_config(tmp_path, "split", [*overrides, "train.stop_at=2"]))
    resumed = train(_config(tmp_path, "split", [*overrides, "resume=latest"]))
    assert resumed.losses == whole.losses[2:]


def test_a_grpo_move_is_judged_on_its_reward_against_the_spread_between_seeds(tmp_path, task, sft, capsys):
    """`ferry rehearse` of a GRPO run: the source trains two seed runs beside its reference and the bundle
    carries them; a target that draws as the source does passes, a run that samples colder fails against them.

    512 completions a step (32 prompts x 16): at that size a sampler at temperature 0.3 leaves the band of the
    seed spread by 1.8x or more (4.4x at the median) in every one of 336 seed sets measured on two CPU code paths
    (AVX-512 and AVX2), so the verdict does not depend on which CPU's rounding drew the rollouts; at 32
    completions a step it left the band in only 40-57% of them (ferry/portability/tolerances.yaml)."""
    from ferry.config import dump_yaml
    from ferry.portability import compare_runs
    from ferry.portability.rehearsal.bundle import _file_digest

    grpo = [
        "train.objective=grpo",
        f"init_from={sft}",
        f"data.sources=[{{name: prompts, path: {task['prompts']}}}]",
        "eval.interval=0",
        "train.global_batch=32",
        "train.micro_batch=8",
        "grpo.group_size=16",
        "grpo.max_new_tokens=3",
        "grpo.verifier=numeric",
        "optim.lr=1e-3",
        "train.steps=12",
    ]
    config = _config(tmp_path, "grpo", grpo)
    path = tmp_path / "grpo.yaml"
    path.write_text(dump_yaml(config))
    bundle, history = tmp_path / "bundle", str(tmp_path / "history")
    assert (
        main(
            [
                "rehearse",
                "start",
                str(path),
                "--from",
                "cpu",
                "--out",
                str(bundle),
                "--steps",
                "12",
                "--switch-at",
                "10",
            ]
        )
        == 0
    )
    described = json.loads((bundle / "bundle.json").read_text())["seed_runs"]
    assert described == [{"seed": 1, "dir": "seeds/seed-1"}, {"seed": 2, "dir": "seeds/seed-2"}]
    seed_rewards = [
        [json.loads(line)["reward"] for line in (bundle / run["dir"] / "metrics.jsonl").open()] for run in described
    ]
    assert len(seed_rewards[0]) == 12 and seed_rewards[0] != seed_rewards[1], "the seeds drew the same samples"

    def refused(name: str, change) -> str:
        """A copy of the bundle, changed, finished: refused before anything trains."""
        copy = tmp_path / f"bundle-{name}"
        shutil.copytree(bundle, copy)
        description = json.loads((copy / "bundle.json").read_text())
        change(copy, description)
        (copy / "bundle.json").write_text(json.dumps(description))
        capsys.readouterr()
        code = main(
            [
                "rehearse",
                "finish",
                str(copy),
                "--to",
                "cpu",
                "--dir",
                str(tmp_path / f"work-{name}"),
                "--history",
                history,
            ]
        )
        assert code == 2 and not (tmp_path / f"work-{name}").exists(), name
        return capsys.readouterr().err

    def other_learning_rate(copy, description):
        seed_config = copy / "seeds" / "seed-1" / "config.yaml"
        seed_config.write_text(seed_config.read_text().replace("lr: 0.001", "lr: 0.002"))
        description["files"]["seeds/seed-1/config.yaml"] = _file_digest(seed_config)

    def linked_to_the_reference(copy, description):
        shutil.rmtree(copy / "seeds" / "seed-1")
        (copy / "seeds" / "seed-1").symlink_to("../reference", target_is_directory=True)

    assert "seed 1 is listed twice" in refused("twice", lambda _, d: d["seed_runs"].append(d["seed_runs"][0]))
    moved = refused("moved", lambda _, description: description["seed_runs"][0].update(dir="seeds/seed-2"))
    assert "seed run 1 lies in seeds/seed-2" in moved
    assert "lies under a symbolic link" in refused("linked", linked_to_the_reference)
    assert "seed run seed-1 is not the source's config with seed 1 (they differ in optim)" in refused(
        "lr", other_learning_rate
    )

    assert (
        main(["rehearse", "finish", str(bundle), "--to", "cpu", "--dir", str(tmp_path / "same"), "--history", history])
        == 0
    )
    record = json.loads((tmp_path / "same" / "verdict.json").read_text())
    assert record["profile"] == "sampled" and "objective grpo" in record["profile_reason"] and record["conclusive"]
    for comparison in record["comparisons"].values():
        assert comparison["passed"] and comparison["metric"] == "reward" and comparison["seed_spread"] > 0
    # a colder sampler draws other rewards than the source's seeds do: judged against them, it fails
    colder = train(_config(tmp_path, "colder", [*grpo, "grpo.temperature=0.3"])).run_dir
    seed_runs = [bundle / run["dir"] for run in described]
    verdict = compare_runs(bundle / "reference", colder, profile="sampled", seed_runs=seed_runs)
    assert not verdict.passed and verdict.max_bound_fraction > 1


def _exit_code(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def test_bad_preference_and_rl_input_exits_2_naming_it(tmp_path, task, sft, chat_tokenizer, make_config, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "chosen": "a"}) + "\n", encoding="utf-8")
    args = ["data", "prepare", str(bad), "--preferences", "--tokenizer", str(chat_tokenizer), "--output"]
    code, err = _exit_code([*args, str(tmp_path / "p1")], capsys)
    assert code == 2 and "bad.jsonl:1" in err and "'rejected'" in err
    bad.write_text(json.dumps({"prompt": "hi", "chosen": "a", "rejected": "  "}) + "\n", encoding="utf-8")
    code, err = _exit_code([*args, str(tmp_path / "p2")], capsys)
    assert code == 2 and "'rejected' is empty" in err
    bad.write_text(json.dumps({"prompt": "hi", "chosen": 1, "rejected": "b"}) + "\n", encoding="utf-8")
    code, err = _exit_code([*args, str(tmp_path / "p3")], capsys)
    assert code == 2 and "'chosen' must be text or one assistant message, not int" in err
    train_args = [
        "train",
        "configs/tiny.yaml",
        f"run.dir={tmp_path / 'r'}",
        "model.vocab_size=4160",
        "model.max_seq_len=64",
        "data.seq_len=64",
        "train.objective=grpo",
        f"init_from={sft}",
        f"data.sources=[{{name: prompts, path: {task['prompts']}}}]",
    ]
    code, err = _exit_code([*train_args, "grpo.verifier=fuzzy"], capsys)
    assert code == 2 and "grpo.verifier" in err and "fuzzy" in err
    code, err = _exit_code([*train_args, "grpo.group_size=1"], capsys)
    assert code == 2 and "grpo.group_size" in err
    code, err = _exit_code([*train_args[:-1], f"data.sources=[{{name: pairs, path: {task['pairs']}}}]"], capsys)
    assert code == 2 and "preferences" in err
    for budget in ("tokens: 4096", "epochs: 2"):
        code, err = _exit_code(
            [*train_args[:-1], f"data.sources=[{{name: prompts, path: {task['prompts']}, {budget}}}]"], capsys
        )
        assert code == 2 and f"data.sources.0.{budget.split(':')[0]} (prompts) is a budget of a token mix" in err
    lm_on_pairs = [arg for arg in train_args if not arg.startswith(("train.objective", "data.sources"))]
    code, err = _exit_code([*lm_on_pairs, f"data.sources=[{{name: pairs, path: {task['pairs']}}}]"], capsys)
    assert code == 2 and "holds preferences (a record dataset)" in err and "train.objective: dpo does" in err
    evaluate = ["eval", str(sft), "--data"]
    code, err = _exit_code([*evaluate, str(task["prompts-held-out"]), "--verifier", "fuzzy"], capsys)
    assert code == 2 and "--verifier" in err and "fuzzy" in err
    code, err = _exit_code([*evaluate, str(task["pairs-held-out"]), "--reference", str(tmp_path / "nope")], capsys)
    assert code == 2 and "--reference" in err and "does not exist" in err
    Trainer(make_config("train.steps=1", run_dir=tmp_path / "other-model")).fit()
    code, err = _exit_code(
        [*evaluate, str(task["pairs-held-out"]), "--reference", str(tmp_path / "other-model")], capsys
    )
    assert code == 2 and "--reference" in err and "has a vocabulary of 512 tokens, the model 576" in err


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_dpo_and_grpo_steps_are_unchanged_by_how_a_step_runs(tmp_path, task, sft, objective):
    """Blocks recomputed in the backward (fp32: the same kernels, bit for bit), and weights cast once a step
    (bf16 compute: the same casts and sums as autocast's), give each objective the losses of its plain run; the
    rollouts, reference scores and evaluations run without a backward, and so without either."""
    if objective == "dpo":
        overrides = [
            "train.objective=dpo",
            f"data.sources=[{{name: pairs, path: {task['pairs']}}}]",
            f"dpo.reference_cache={tmp_path / 'cache'}",
        ]
    else:
        overrides = [
            "train.objective=grpo",
            f"data.sources=[{{name: prompts, path: {task['prompts']}}}]",
            "train.global_batch=4",
            "train.micro_batch=2",
            "grpo.group_size=4",
            "grpo.max_new_tokens=3",
            "grpo.verifier=numeric",
            "grpo.kl_coef=0.05",
        ]
    common = [
        *overrides,
        f"init_from={sft}",
        "train.steps=2",
        "optim.lr=1e-3",
        'kernels.ops."moe.routed_experts"=portable',
    ]
    variants = {
        "plain": [],
        "recomputed": ["train.activation_checkpointing=selective"],
        "bf16-per-use": ["precision.compute_dtype=bf16", "precision.weight_casts=micro_batch"],
        "bf16-per-step": ["precision.compute_dtype=bf16", "precision.weight_casts=step"],
    }
    losses = {name: train(_config(tmp_path, name, [*common, *extra])).losses for name, extra in variants.items()}
    assert losses["recomputed"] == losses["plain"]
    assert losses["bf16-per-step"] == losses["bf16-per-use"] != losses["plain"]

"""Held-out evaluation: `eval` sources give `eval.loss` / `eval.perplexity` every `eval.interval` steps
and after the last, the same windows every time (so `ferry eval` on a checkpoint gives the figure the
run recorded), into metrics.jsonl and the loss plot; bad sources are refused naming them (exit 2)."""

from __future__ import annotations

import json
import math

import pytest

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data import PrepareSpec, prepare_dataset
from ferry.inference import EvalConfig, HeldOutEvaluation
from ferry.inference.scoring import score_with
from ferry.metrics.plots import _loss, plot_run
from ferry.train import Trainer

HELD_OUT = ("eval.interval=2", "eval.batches=2")


def _sources(*paths) -> str:
    return "eval.sources=[" + ", ".join(f"{{name: {name}, path: {path}}}" for name, path in paths) + "]"


@pytest.fixture(scope="module")
def byte_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    text = root / "text.txt"
    text.write_text("held-out text tokenized as bytes\n" * 400, encoding="utf-8")
    output = root / "dataset"
    prepare_dataset(PrepareSpec(inputs=[str(text)], tokenizer="byte"), output)
    return output


@pytest.mark.parametrize("loss_chunk", [0, 48], ids=["logits", "chunked-head"])
def test_a_run_records_held_out_loss_at_its_interval_and_ferry_eval_agrees(
    make_config, stdlib_dataset, tmp_path, capsys, loss_chunk
):
    """With `train.loss_chunk` the evaluation scores by chunks too, and `ferry eval` as the run did."""
    qwen3_shaped = ("model.qk_norm=true", "model.qk_norm_scope=head")  # so that it exports
    config = make_config(
        "train.steps=5",
        f"train.loss_chunk={loss_chunk}",
        *qwen3_shaped,
        _sources(("held_out", stdlib_dataset)),
        *HELD_OUT,
    )
    Trainer(config).fit()
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (config.run.path / "metrics.jsonl").read_text().splitlines()]
    evaluated = {record["step"]: record for record in records if "eval.loss" in record}
    assert sorted(evaluated) == [2, 4, 5], "every eval.interval steps and after the last"
    final = evaluated[5]
    assert math.exp(final["eval.loss"]["held_out"]) == pytest.approx(final["eval.perplexity"]["held_out"])
    assert final["eval.loss"]["held_out"] < evaluated[2]["eval.loss"]["held_out"], "the model learns"
    assert f"held-out at step 5: held_out loss {final['eval.loss']['held_out']:.4f}" in out
    checkpoint = config.run.path / "checkpoints" / "step-00000005"
    assert main(["eval", str(checkpoint), "--data", str(stdlib_dataset), "--micro-batch", "2"]) == 0
    printed = capsys.readouterr().out
    assert "2 x 8 windows of 32 tokens" in printed, "the run's own eval.batches and batch size"
    assert f"loss {final['eval.loss']['held_out']:.4f}" in printed and "(512 tokens)" in printed
    assert main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    exported = ["eval", str(tmp_path / "hf"), "--data", str(stdlib_dataset), "--seq-len", "32", "--batches", "2"]
    assert main([*exported, "--batch-size", "8", "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["datasets"][str(stdlib_dataset)]["loss"]
    assert loss == pytest.approx(final["eval.loss"]["held_out"], rel=1e-5), "the export, with its tokenizer file"
    labels = [line.get_label() for line in _loss(records).axes[0].get_lines()]
    assert "held-out held_out" in labels
    assert "loss.png" in {path.name for path in plot_run(config.run.path).written}


def test_an_export_of_a_document_masked_run_is_evaluated_as_the_run_was_when_asked(
    make_config, stdlib_dataset, tmp_path, capsys
):
    """An export records no run, so `ferry eval` of it attends across documents unless `--document-masking on`
    says what the run did; with it, the figure is the run's."""
    qwen3_shaped = ("model.qk_norm=true", "model.qk_norm_scope=head")
    config = make_config(
        "train.steps=2",
        "data.document_masking=true",
        *qwen3_shaped,
        _sources(("held_out", stdlib_dataset)),
        *HELD_OUT,
    )
    Trainer(config).fit()
    recorded = [json.loads(line) for line in (config.run.path / "metrics.jsonl").read_text().splitlines()][-1]
    assert main(["export", str(config.run.path / "checkpoints" / "step-00000002"), str(tmp_path / "hf")]) == 0
    exported = ["eval", str(tmp_path / "hf"), "--seq-len", "32", "--batches", "2", "--batch-size", "8", "--json"]
    losses = {}
    for masking in ("run", "on", "off"):
        capsys.readouterr()
        assert main([*exported, "--data", str(stdlib_dataset), "--document-masking", masking]) == 0
        losses[masking] = json.loads(capsys.readouterr().out)["datasets"][str(stdlib_dataset)]["loss"]
    assert losses["on"] == pytest.approx(recorded["eval.loss"]["held_out"], rel=1e-5)
    short = tmp_path / "short.jsonl"  # documents of a few tokens: every window holds several
    short.write_text("".join(json.dumps({"text": f"x = {n} + {n * 7}"}) + "\n" for n in range(400)))
    tokenizer = str(stdlib_dataset / "tokenizer.json")
    prepare_dataset(PrepareSpec(inputs=[str(short)], tokenizer=tokenizer), tmp_path / "short")
    for masking in ("run", "on", "off"):
        capsys.readouterr()
        assert main([*exported, "--data", str(tmp_path / "short"), "--document-masking", masking]) == 0
        losses[masking] = json.loads(capsys.readouterr().out)["datasets"][str(tmp_path / "short")]["loss"]
    assert losses["run"] == losses["off"] != losses["on"]


def test_the_windows_and_the_figure_do_not_depend_on_the_micro_batch(make_config, stdlib_dataset):
    trainer = Trainer(make_config("train.steps=1"))
    config = EvalConfig.model_validate({"sources": [{"name": "a", "path": str(stdlib_dataset)}], "batches": 3})
    whole = HeldOutEvaluation(config, 32, batch_size=8, micro_batch=8)
    split = HeldOutEvaluation(config, 32, batch_size=8, micro_batch=1)
    assert (whole.sources[0].windows == split.sources[0].windows).all()
    available = whole.sources[0].dataset.num_windows(32)
    assert whole.sources[0].windows[-1] >= available * 23 // 24, "spread over the whole dataset"
    score = score_with(trainer.model)
    assert whole.run(score, trainer.parts.job.device)["a"].loss == pytest.approx(
        split.run(score, trainer.parts.job.device)["a"].loss, rel=1e-6
    )


def test_a_source_too_small_for_the_evaluation_is_named(make_config, stdlib_dataset, tmp_path):
    config = make_config(_sources(("tiny", stdlib_dataset)), "eval.batches=100000")
    with pytest.raises(
        UserError, match=r"eval\.sources\.0 \(tiny\): \d+ windows of 32 tokens; the evaluation reads 800000"
    ):
        Trainer(config)


def test_a_source_with_another_tokenizer_is_refused(make_config, byte_dataset):
    with pytest.raises(UserError, match=r"eval\.sources\.0 \(bytes\) was tokenized with another tokenizer"):
        Trainer(make_config(_sources(("bytes", byte_dataset))))


def test_an_eval_batch_that_does_not_split_into_micro_batches_is_named(make_config, stdlib_dataset):
    with pytest.raises(UserError, match=r"eval\.batch_size"):
        make_config(_sources(("a", stdlib_dataset)), "eval.batch_size=6")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--micro-batch", "3"], "--micro-batch 3"),
        (["--seq-len", "1000"], "--seq-len 1000"),
        (["--batches", "0"], "batches"),
    ],
)
def test_bad_eval_input_exits_2_naming_it(make_config, stdlib_dataset, argv, named, capsys):
    config = make_config("train.steps=1")
    Trainer(config).fit()
    capsys.readouterr()
    assert main(["eval", str(config.run.path), "--data", str(stdlib_dataset), *argv]) == 2
    assert named in capsys.readouterr().err


def test_ferry_eval_refuses_a_dataset_of_another_tokenizer(make_config, byte_dataset, capsys):
    config = make_config("train.steps=1")
    Trainer(config).fit()
    capsys.readouterr()
    assert main(["eval", str(config.run.path), "--data", str(byte_dataset), "--batch-size", "4"]) == 2
    assert "another tokenizer" in capsys.readouterr().err

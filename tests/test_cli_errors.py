"""Malformed input on the command line: exit code 2, one message naming the culprit, no traceback."""

import subprocess
import sys

import pytest
from conftest import REPO

from ferry.cli.main import main

TINY = str(REPO / "configs" / "tiny.yaml")


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CASES = {
    "unknown key": lambda t: ([TINY, "model.moe.num_expert=4"], "model.moe.num_expert"),
    "wrong type": lambda t: ([TINY, "train.steps=many"], "train.steps"),
    "negative steps": lambda t: ([TINY, "train.steps=-5"], "train.steps"),
    "top_k above num_experts": lambda t: ([TINY, "model.moe.top_k=12"], "model.moe.top_k"),
    "override without =": lambda t: ([TINY, "train.steps"], "train.steps"),
    "missing config file": lambda t: ([str(t / "nope.yaml")], "nope.yaml"),
    "a directory as the config": lambda t: ([str(t)], "is a directory; give the YAML file"),
    "unreadable YAML": lambda t: ([_write(t, "bad.yaml", "model: [dim: 3\n")], "bad.yaml"),
    "YAML that is not a mapping": lambda t: ([_write(t, "list.yaml", "- 1\n- 2\n")], "list.yaml"),
    "missing data path": lambda t: (
        [TINY, f"data.sources.0.path={t / 'no-such-data'}", f"run.dir={t / 'run'}"],
        "no-such-data",
    ),
    "unknown section": lambda t: ([TINY, "trainer.steps=3"], "trainer"),
    "heads do not divide dim": lambda t: ([TINY, "model.n_heads=3"], "model.n_heads"),
    "index past a list": lambda t: ([TINY, "data.sources.3.weight=1"], "data.sources.3"),
    "bad device name": lambda t: ([TINY, "run.device=tpu"], "run.device"),
    "infinite learning rate": lambda t: ([TINY, "optim.lr=.inf"], "optim.lr"),
    "not-a-number loss weight": lambda t: ([TINY, "model.moe.aux_loss_coef=.nan"], "model.moe.aux_loss_coef"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_train_input_exits_2_naming_the_culprit(case, tmp_path, capsys):
    argv, culprit = CASES[case](tmp_path)
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert culprit in err
    assert "Traceback" not in err
    assert err.startswith("ferry: error:")


def test_bad_prepare_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    code = main(["data", "prepare", str(bad), "--output", str(tmp_path / "out"), "--tokenizer", "byte"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{bad}:2" in err and "'text'" in err
    assert not (tmp_path / "out").exists(), "a failed prepare must leave nothing behind"


def test_a_real_process_exits_2_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "train", TINY, "optim.lr=fast"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "optim.lr" in result.stderr
    assert "Traceback" not in result.stderr


def test_widths_the_selected_grouped_gemm_cannot_take_exit_2_naming_them(stdlib_dataset, tmp_path, capsys):
    pinned = 'kernels.ops={"moe.routed_experts": "portable", "moe.grouped_mm": "torch_grouped_mm"}'
    argv = [TINY, f"data.sources.0.path={stdlib_dataset}", f"run.dir={tmp_path / 'run'}", "train.steps=1"]
    code = main(["train", *argv, "model.moe.expert_ffn_dim=190", pinned])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "got in 128 and out 190 (model.dim, model.moe.expert_ffn_dim)" in err
    assert "Traceback" not in err


def test_a_file_where_an_output_directory_goes_exits_2_naming_it(stdlib_dataset, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("kept")
    text = tmp_path / "a.txt"
    text.write_text("some text to prepare\n" * 20)
    commands = [
        ["data", "prepare", str(text), "--output", str(taken / "ds"), "--tokenizer", "byte"],
        ["train", TINY, f"data.sources.0.path={stdlib_dataset}", "model.vocab_size=512", f"run.dir={taken / 'run'}"],
        ["kernels", "boundary", "--out", str(taken / "boundary.md")],
    ]
    for argv in commands:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert str(taken) in err and "Traceback" not in err
    assert taken.read_text() == "kept"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "runs/none", "--prompt", "a", "--device", "banana"],
        ["eval", "runs/none", "--device", "banana"],
        ["kernels", "list", "--device", "banana"],
        ["hardware", "show", "--device", "banana"],
    ],
)
def test_a_device_that_is_not_here_is_named_as_the_flag_given(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "argument --device: 'banana' is not available on this machine" in err and "run.device" not in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-bytes", "3"], "--max-bytes is the text budget of an embedded corpus"),
        (["--prompts", "--shard-tokens", "5"], "--shard-tokens: --prompts writes its records whole"),
    ],
)
def test_a_prepare_option_that_would_be_ignored_is_refused(tmp_path, flags, named, capsys):
    rows = _write(tmp_path, "rows.jsonl", '{"text": "hello", "prompt": "2+2=", "answer": "4"}\n')
    assert main(["data", "prepare", rows, *flags, "--tokenizer", "byte", "--output", str(tmp_path / "out")]) == 2
    assert named in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_blank_prompt_line_and_a_dataset_given_twice_are_refused(tmp_path, capsys):
    prompts = _write(tmp_path, "prompts.txt", "def f(x):\n\nclass A:\n")
    assert main(["generate", str(tmp_path / "no-run"), "--prompts-file", prompts]) == 2
    assert "line 2 is blank; give one prompt per line" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "no-run"), "--data", "data/x", "data/x"]) == 2
    assert "--data 'data/x' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, option, suggestion",
    [
        (["train", TINY, "--steps", "10"], "--steps", "did you mean train.steps=10?"),
        (["train", TINY, "--train.steps=10"], "--train.steps=10", "did you mean train.steps=10?"),
        (["train", TINY, "run.seed=1", "--micro-batch", "2", "--nproc", "2"], "--micro-batch", "train.micro_batch=2?"),
        (["train", TINY, "--num-experts=4"], "--num-experts=4", "did you mean model.moe.num_experts=4?"),
        (["train", TINY, "--run-name", "my run"], "--run-name", "did you mean 'run.name=my run'?"),
        (["train", TINY, "--steps"], "--steps", "did you mean train.steps=VALUE?"),
        (
            ["launch", TINY, "--platform", "cpu", "--nodes", "1", "--warmup-steps", "5"],
            "--warmup-steps",
            "did you mean optim.warmup_steps=5?",
        ),
        (["rehearse", TINY, "--from", "cpu", "--to", "cpu", "--lr", "1e-3"], "--lr", "did you mean optim.lr=1e-3?"),
        (["train", TINY, "--fast", "1"], "--fast", "neither an option of this command nor a config key"),
    ],
)
def test_an_unknown_option_names_the_dotted_override_and_starts_nothing(argv, option, suggestion, tmp_path, capsys):
    out = str(tmp_path / "out")
    where = {"train": [f"run.dir={out}"], "launch": ["--out", out], "rehearse": ["--dir", out, "--history", out]}
    code = main([*argv[:2], *where[argv[0]], *argv[2:]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"ferry: error: unrecognized argument {option}: ")
    assert suggestion in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()

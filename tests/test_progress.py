"""Long work says that it moves: a line at least every LINE_EVERY_S seconds where output goes to a file."""

from __future__ import annotations

import io
import json

from rich.console import Console

from ferry.cli.main import main
from ferry.metrics import ConsoleProgress
from ferry.metrics import progress as progress_module
from ferry.metrics.progress import WorkProgress
from ferry.train.trainer import train


def _file_console() -> tuple[Console, io.StringIO]:
    output = io.StringIO()
    return Console(file=output, force_terminal=False, width=200), output


def test_work_written_to_a_file_prints_a_line_once_its_silence_would_pass_the_limit():
    lines: list[str] = []
    console, _ = _file_console()
    with WorkProgress("scoring", 3, say=lines.append, unit="batches", every_s=0.0, console=console) as work:
        for _ in range(3):
            work.advance()
    assert [line.split(" after ")[0] for line in lines] == [f"ferry: scoring: {done}/3 batches" for done in (1, 2, 3)]
    quiet: list[str] = []
    with WorkProgress("scoring", 3, say=quiet.append, every_s=3600.0, console=console) as work:
        work.advance()
    assert quiet == [], "within the limit nothing is printed"
    with WorkProgress("scoring", 3, say=None, every_s=0.0, console=console) as work:
        work.advance()  # a rank other than 0: silent, and no error


def test_training_output_to_a_file_gets_a_step_line_at_least_every_limit_not_only_every_log_every():
    console, output = _file_console()
    record = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": 0.1}
    sparse = ConsoleProgress(total_steps=100, every=25, console=console, every_s=3600.0)
    for step in range(1, 5):
        sparse.update({**record, "step": step})
    assert output.getvalue().count("step ") == 1, "only step 1 within the limit"
    console, output = _file_console()
    timely = ConsoleProgress(total_steps=100, every=25, console=console, every_s=0.0)
    for step in range(1, 5):
        timely.update({**record, "step": step})
    assert [line.split()[1] for line in output.getvalue().splitlines()] == ["1/100", "2/100", "3/100", "4/100"]


def test_ferry_eval_reports_its_progress_on_stderr_and_keeps_stdout_for_the_figures(
    make_config, stdlib_dataset, monkeypatch, capsys
):
    result = train(make_config("train.steps=1"))
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                str(result.run_dir),
                "--data",
                str(stdlib_dataset),
                "--batches",
                "2",
                "--batch-size",
                "4",
                "--micro-batch",
                "2",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    figures = json.loads(captured.out)["datasets"][str(stdlib_dataset)]
    assert figures["kind"] == "tokens" and figures["tokens"] > 0
    progress = [line for line in captured.err.splitlines() if line.startswith("ferry: eval: ")]
    assert [line.split(" after ")[0] for line in progress] == [f"ferry: eval: {n}/4 forwards" for n in (1, 2, 3, 4)]


def test_a_held_out_evaluation_during_training_reports_its_progress(make_config, stdlib_dataset, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    train(make_config("train.steps=2", f"eval.sources=[{{name: held_out, path: {stdlib_dataset}}}]", "eval.batches=2"))
    lines = [
        line.split(" after ")[0]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("ferry: held-out evaluation at step 2:")
    ]
    # 2 batches of train.global_batch 8 in micro-batches of 4: 4 forwards
    assert lines == [f"ferry: held-out evaluation at step 2: {n} forwards" for n in (1, 2, 3, 4)]


def test_a_leg_a_parent_command_starts_is_followed_in_lines_when_the_parent_writes_to_a_file(
    make_config, monkeypatch, tmp_path
):
    """A rehearsal's or drill's leg runs in a child process that writes to its own log: the parent says how many
    of the leg's steps are done, so its own output is never silent for minutes."""
    from ferry.portability.comparison.environment import load_environment
    from ferry.portability.rehearsal.legs import run_leg

    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    said: list[str] = []
    result = run_leg(
        "source", load_environment("cpu"), make_config("train.steps=3"), tmp_path / "work", said.append, steps=3
    )
    assert result.ok
    follows = [line for line in said if line.startswith("ferry: source leg: ")]
    assert follows and all(line.split(" after ")[0].endswith("/3 steps") for line in follows)
    assert said[-1].startswith("ferry: source done in ")

"""`ferry data prepare --engine ray` on a real local Ray (started by the command with this machine's CPUs, no
dashboard): the dataset one process writes, byte for byte, with the manifest saying where it ran and Ray's driver
log beside it (`libraries.log`, off the console); a malformed
line exits 2 naming the file and the line, leaving nothing; a task whose worker is killed (SIGKILL, found by
the process title Ray gives a worker running a task) runs again and the dataset is still the same; with
`--retries 0` the kill is final and reported naming the input file; `--address` joins a running cluster
(`ray start --head`, with Ray's default token authentication). Each case runs the command as a user would, in
its own process, as Ray's driver."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from text_corpora import directory_files, json_lines, text_rows, write_mixed_corpus

from ferry.cli.main import main

_TASK_TITLE = b"ray::_tokenize_part_task"  # what Ray names a worker process while it runs a part's task


def _ferry(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_ray_writes_the_dataset_one_process_writes(tmp_path, capsys):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    flags = ["--tokenizer", "byte", "--shard-tokens", "700"]
    assert main(["data", "prepare", str(corpus), "--output", str(tmp_path / "alone"), *flags]) == 0
    ran = _ferry("data", "prepare", str(corpus), "--output", str(tmp_path / "ray"), *flags, "--engine", "ray")
    assert ran.returncode == 0, ran.stderr
    assert "tokenised by Ray" in ran.stdout and "1 node(s), " in ran.stdout
    alone, on_ray = directory_files(tmp_path / "alone"), directory_files(tmp_path / "ray")
    ray_log = on_ray.pop("libraries.log").decode()  # what Ray's driver logged: kept in the dataset, off the console
    assert "WARNING ray." in ray_log and "Token authentication" in ray_log
    assert "Token authentication" not in ran.stdout + ran.stderr
    assert len([name for name in alone if name.startswith("shard-")]) > 5
    manifest = json.loads(on_ray.pop("manifest.json"))
    where = manifest.pop("prepared_by")
    assert where["engine"] == "ray" and where["address"] == "local" and where["nodes"] == 1
    assert where["cpus"] == os.cpu_count()
    assert manifest == json.loads(alone.pop("manifest.json"))
    assert on_ray == alone

    capsys.readouterr()
    with_tasks = ["--engine", "ray", "--tasks", "2", "--task", "1"]
    assert main(["data", "prepare", str(corpus), "--output", "x", *with_tasks]) == 2
    assert "--engine ray schedules every part itself" in capsys.readouterr().err
    assert main(["data", "prepare", str(corpus), "--output", "x", "--retries", "2"]) == 2
    assert "--retries is a setting of --engine ray" in capsys.readouterr().err


def test_a_malformed_line_read_by_a_ray_task_exits_2_naming_it_and_leaves_nothing(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text(json_lines(text_rows(0, 30)), encoding="utf-8")
    (inputs / "b.jsonl").write_text(json_lines(text_rows(0, 40)) + '{"text": "cut short\n', encoding="utf-8")
    ran = _ferry(
        "data",
        "prepare",
        str(inputs),
        "--output",
        str(tmp_path / "out"),
        "--tokenizer",
        "byte",
        "--engine",
        "ray",
        "--workers",
        "1",
    )
    assert ran.returncode == 2
    assert f"{inputs / 'b.jsonl'}:41: not valid JSON" in ran.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["inputs"]


def test_address_joins_a_running_cluster_and_an_address_where_none_answers_is_refused(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    flags = ["--tokenizer", "byte", "--shard-tokens", "700", "--engine", "ray"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray = [str(Path(sys.executable).with_name("ray"))]
    started = subprocess.run(
        [
            *ray,
            "start",
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            "1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        address = f"127.0.0.1:{port}"
        joined = _ferry(
            "data",
            "prepare",
            str(corpus),
            "--output",
            str(tmp_path / "joined"),
            *flags,
            "--address",
            address,
            env={"RAY_AUTH_MODE": "token"},
        )
        assert joined.returncode == 0, joined.stderr
        assert f"tokenised by Ray {__import__('ray').__version__} at {address}: 1 node(s), 1 CPU(s)" in joined.stdout
    finally:
        subprocess.run([*ray, "stop"], capture_output=True, timeout=120)
    assert main(["data", "prepare", str(corpus), "--output", str(tmp_path / "alone"), *flags[:4]]) == 0
    on_cluster = directory_files(tmp_path / "joined")
    on_cluster.pop("libraries.log", None)  # what Ray's driver logged, if anything: not the dataset's
    assert json.loads(on_cluster.pop("manifest.json"))["prepared_by"]["address"] == address
    alone = directory_files(tmp_path / "alone")
    alone.pop("manifest.json")
    assert on_cluster == alone

    nowhere = _ferry("data", "prepare", str(corpus), "--output", str(tmp_path / "x"), *flags, "--address", address)
    assert nowhere.returncode == 2
    assert f"--address {address}: no Ray cluster answers there" in nowhere.stderr


@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """Two files whose tasks take about a second each with a BPE tokenizer, long enough to be caught running;
    and that tokenizer (trained on a sample, so training is quick)."""
    directory = tmp_path_factory.mktemp("slow")
    inputs = directory / "inputs"
    inputs.mkdir()
    rows = text_rows(0, 12_000)
    for index in range(2):
        (inputs / f"part{index}.jsonl").write_text(json_lines(rows[index::2] * 4), encoding="utf-8")
    sample = directory / "sample"
    sample.mkdir()
    (sample / "s.jsonl").write_text(json_lines(rows[:2000]), encoding="utf-8")
    assert main(["data", "prepare", str(sample), "--output", str(directory / "bpe"), "--vocab-size", "400"]) == 0
    return inputs, directory / "bpe" / "tokenizer.json"


def _kill_tasks(proc: subprocess.Popen, kills: int, killed: list[int]) -> None:
    """SIGKILL the worker processes running a part's task, `kills` of them, while `proc` runs."""
    while proc.poll() is None and len(killed) < kills:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in killed:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    title = handle.read()
            except OSError:
                continue
            if title.startswith(_TASK_TITLE):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
                break
        threading.Event().wait(0.01)


def _prepare_while_killing(inputs: Path, tokenizer: Path, output: Path, kills: int, *flags: str) -> tuple:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ferry",
            "data",
            "prepare",
            str(inputs),
            "--output",
            str(output),
            "--tokenizer",
            str(tokenizer),
            "--engine",
            "ray",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed: list[int] = []
    killer = threading.Thread(target=_kill_tasks, args=(proc, kills, killed))
    killer.start()
    out, err = proc.communicate(timeout=300)
    killer.join()
    return proc.returncode, out, err, killed


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds Ray's workers through /proc")
def test_a_task_whose_worker_is_killed_runs_again_and_a_final_failure_names_the_file(slow_corpus, tmp_path):
    inputs, tokenizer = slow_corpus
    alone = ["data", "prepare", str(inputs), "--output", str(tmp_path / "alone"), "--tokenizer", str(tokenizer)]
    assert main(alone) == 0
    code, out, err, killed = _prepare_while_killing(inputs, tokenizer, tmp_path / "ray", 1)
    assert code == 0, err
    assert len(killed) == 1  # a task really died, and was run again
    on_ray = directory_files(tmp_path / "ray")
    on_ray.pop("libraries.log")  # what Ray's driver logged: not the dataset's
    manifest = json.loads(on_ray.pop("manifest.json"))
    manifest.pop("prepared_by")
    alone = directory_files(tmp_path / "alone")
    assert manifest == json.loads(alone.pop("manifest.json")) and on_ray == alone

    code, out, err, killed = _prepare_while_killing(inputs, tokenizer, tmp_path / "final", 1, "--retries", "0")
    assert code == 2 and len(killed) == 1
    assert "ferry: error: the Ray task tokenising " in err and "failed after 0 retries (WorkerCrashedError" in err
    named = err.split("the Ray task tokenising ")[1].split(" failed")[0]
    assert named in {str(inputs / "part0.jsonl"), str(inputs / "part1.jsonl")}
    assert not (tmp_path / "final").exists() and not list(tmp_path.glob(".final*"))

"""`ferry data prepare --workers N` and `--task I --tasks N` + `ferry data merge` write the dataset one process
writes, byte for byte (shards, tokenizer, manifest with its digests); a malformed file read by a worker exits 2
naming the file and the line, leaving nothing behind; the Slurm array and the Kubernetes Indexed Job `--render`
writes do the same when run. The corpus (`text_corpora.py`): several JSON-lines files, a gzip one, a Parquet
file of several row groups and an empty file."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from text_corpora import directory_files, json_lines, text_rows, write_mixed_corpus

from ferry.cli.main import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_mixed_corpus(tmp_path_factory.mktemp("corpus"))


def _prepare(corpus: Path, output: Path, *flags: str) -> int:
    return main(["data", "prepare", str(corpus), "--output", str(output), "--shard-tokens", "700", *flags])


def test_one_and_two_workers_write_the_dataset_one_process_writes(corpus, tmp_path, capsys):
    assert _prepare(corpus, tmp_path / "alone", "--vocab-size", "300") == 0
    assert _prepare(corpus, tmp_path / "one", "--vocab-size", "300", "--workers", "1") == 0
    assert _prepare(corpus, tmp_path / "two", "--vocab-size", "300", "--workers", "2") == 0
    alone = directory_files(tmp_path / "alone")
    assert len([name for name in alone if name.startswith("shard-")]) > 5
    assert directory_files(tmp_path / "one") == alone
    assert directory_files(tmp_path / "two") == alone
    manifest = json.loads(alone["manifest.json"])
    assert [entry["source"] for entry in manifest["source_hashes"]] == [
        str(corpus / name) for name in ("a0.jsonl", "a1.jsonl", "a2.jsonl", "b.jsonl.gz", "c.parquet")
    ]
    capsys.readouterr()
    assert _prepare(corpus, tmp_path / "alone", "--vocab-size", "300", "--workers", "2") == 0
    assert "dataset up to date" in capsys.readouterr().out


def test_two_tasks_merged_equal_one_process(corpus, tmp_path, capsys):
    assert _prepare(corpus, tmp_path / "trained", "--vocab-size", "300") == 0
    tokenizer = str(tmp_path / "tokenizer.json")
    Path(tokenizer).write_bytes((tmp_path / "trained" / "tokenizer.json").read_bytes())
    assert _prepare(corpus, tmp_path / "alone", "--tokenizer", tokenizer) == 0
    capsys.readouterr()
    assert _prepare(corpus, tmp_path / "task0", "--tokenizer", tokenizer, "--task", "0", "--tasks", "2") == 0
    assert _prepare(corpus, tmp_path / "task1", "--tokenizer", tokenizer, "--task", "1", "--tasks", "2") == 0
    out = capsys.readouterr().out
    assert "task 0 of 2" in out and "task 1 of 2" in out
    assert not (tmp_path / "task0" / "manifest.json").exists()  # nothing trains on a partial dataset
    held = [json.loads((tmp_path / task / "partial.json").read_text())["part_files"] for task in ("task0", "task1")]
    assert held[0] and held[1]

    assert main(["data", "merge", str(tmp_path / "task0"), "--output", str(tmp_path / "lone")]) == 2
    assert "task(s) 1 of 2 missing" in capsys.readouterr().err
    assert not (tmp_path / "lone").exists()
    merged = tmp_path / "merged"
    assert main(["data", "merge", str(tmp_path / "task1"), str(tmp_path / "task0"), "--output", str(merged)]) == 0
    assert directory_files(merged) == directory_files(tmp_path / "alone")

    part = tmp_path / "task0" / held[0][0]["file"]
    data = bytearray(part.read_bytes())
    data[3] ^= 1
    part.write_bytes(bytes(data))
    partials = [str(tmp_path / "task0"), str(tmp_path / "task1")]
    assert main(["data", "merge", *partials, "--output", str(tmp_path / "m2")]) == 2
    assert f"{part} does not match what its task recorded" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists() and not list(tmp_path.glob(".m2*"))

    assert _prepare(corpus, tmp_path / "task2", "--task", "0", "--tasks", "2") == 2
    assert "--tokenizer PATH" in capsys.readouterr().err


def test_a_malformed_file_read_by_a_worker_exits_2_naming_it_and_leaves_nothing(corpus, tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name in ("a0.jsonl", "a1.jsonl", "c.parquet"):
        (inputs / name).write_bytes((corpus / name).read_bytes())
    malformed = json_lines(text_rows(0, 40)) + '{"text": "cut short\n' + json_lines(text_rows(40, 5))
    (inputs / "b.jsonl").write_text(malformed, encoding="utf-8")
    for flags in (["--workers", "2"], ["--task", "0", "--tasks", "1"]):
        assert _prepare(inputs, tmp_path / "out", "--tokenizer", "byte", *flags) == 2
        assert f"{inputs / 'b.jsonl'}:41: not valid JSON" in capsys.readouterr().err
        assert sorted(path.name for path in tmp_path.iterdir()) == ["inputs"]


def test_the_rendered_slurm_array_prepares_and_merges_the_same_dataset(corpus, tmp_path, monkeypatch, capsys):
    """The scripts run as Slurm would run them, every array index and then the merge: bash expands each
    script's `ferry` command line (the #SBATCH lines are comments to it), which runs here, in this process."""
    monkeypatch.chdir(tmp_path)
    assert _prepare(corpus, tmp_path / "alone", "--tokenizer", "byte") == 0
    flags = ["--tokenizer", "byte", "--shard-tokens", "700", "--tasks", "2", "--render", "job"]
    assert main(["data", "prepare", str(corpus), "--output", "dataset", *flags]) == 0
    assert "2 task(s) of 1 worker(s)" in capsys.readouterr().out
    script = (tmp_path / "job" / "prepare.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and '--task "$SLURM_ARRAY_TASK_ID" --tasks 2' in script
    for name, index in (("prepare", "0"), ("prepare", "1"), ("merge", "")):
        expanded = subprocess.run(
            ["bash", "-c", f'ferry() {{ printf "%s\\0" "$@"; }}; source job/{name}.sbatch'],
            check=True,
            capture_output=True,
            env={**os.environ, "SLURM_ARRAY_TASK_ID": index},
        ).stdout
        assert main(expanded.decode().split("\0")[:-1]) == 0
    assert sorted(path.name for path in (tmp_path / "dataset.tasks").iterdir()) == ["task-0", "task-1"]
    assert directory_files(tmp_path / "dataset") == directory_files(tmp_path / "alone")


def test_preparing_data_imports_no_torch():
    """A preparation's processes (every worker among them) import `ferry.data` and the preparation's modules, not
    torch: about a second a process that `import torch` cost them (docs/performance.md)."""
    import sys

    modules = "ferry.data, ferry.data.prepare, ferry.data.workers, ferry.data.partial, ferry.cli.main"
    check = f"import sys, {modules}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    shown = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "['numpy']", shown


def test_the_rendered_kubernetes_indexed_job_validates_and_prepares_the_same_dataset(
    corpus, tmp_path, monkeypatch, capsys
):
    """The manifests pass the Kubernetes schema (strict); each pod's command, its `$(TASK)` replaced by the index as
    Kubernetes does from the container's environment, runs here, and the merge pod's after them."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(corpus, tmp_path / "corpus")  # on the claim: a link out of it would not be there in a pod
    assert _prepare(Path("corpus"), tmp_path / "alone", "--tokenizer", "byte") == 0
    flags = ["--tokenizer", "byte", "--shard-tokens", "700", "--tasks", "2", "--workers", "2", "--render", "job"]
    assert main(["data", "prepare", "corpus", "--output", "dataset", *flags, "--render-for", "kubernetes"]) == 0
    assert "2 task(s) of 2 worker(s), then a merge Job into dataset" in capsys.readouterr().out
    prepare_job, merge_job = (
        yaml.safe_load((tmp_path / "job" / name).read_text()) for name in ("prepare-job.yaml", "merge-job.yaml")
    )
    for job in (prepare_job, merge_job):
        kubernetes_validate.validate(job, "1.33.0", strict=True)
    assert prepare_job["spec"]["completionMode"] == "Indexed" and prepare_job["spec"]["completions"] == 2
    container = prepare_job["spec"]["template"]["spec"]["containers"][0]
    assert container["env"][0]["name"] == "TASK" and container["workingDir"] == str(tmp_path.resolve())
    assert container["volumeMounts"][0]["mountPath"] == str(tmp_path.resolve())
    assert container["command"] == ["ferry"] and container["resources"]["requests"]["cpu"] == "2"
    for index in ("0", "1"):
        assert main([word.replace("$(TASK)", index) for word in container["args"]]) == 0
    assert main(merge_job["spec"]["template"]["spec"]["containers"][0]["args"]) == 0
    assert directory_files(tmp_path / "dataset") == directory_files(tmp_path / "alone")
    assert "kubectl apply -f merge-job.yaml" in (tmp_path / "job" / "submit.sh").read_text()

    capsys.readouterr()
    outside = ["data", "prepare", str(corpus), "--output", "d2", *flags[:-1], "job2", "--render-for", "kubernetes"]
    assert main(outside) == 2
    assert f"{corpus} lies outside {tmp_path.resolve()}, the directory the pods mount" in capsys.readouterr().err
    assert main(["data", "prepare", "corpus", "--output", "d3", "--tokenizer", "byte", "--image", "x:1"]) == 2
    assert "--image is a setting of the job --render DIR writes" in capsys.readouterr().err

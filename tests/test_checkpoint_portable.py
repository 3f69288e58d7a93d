"""(b) A checkpoint is readable and verifiable by `safetensors`, `json` and `hashlib` alone: no ferry, no torch."""

import hashlib
import json
import subprocess
import sys

from ferry.train import Trainer

# Runs in `python -I` with an empty environment: only the interpreter's own site-packages.
_READER = """
import hashlib, json, sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

checkpoint, expected_path = Path(sys.argv[1]), Path(sys.argv[2])
manifest = json.loads((checkpoint / "manifest.json").read_text())
body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
assert hashlib.sha256(canonical).hexdigest() == manifest["manifest_sha256"], "the manifest's own digest"
for file, record in manifest["files"].items():
    assert hashlib.sha256((checkpoint / file).read_bytes()).hexdigest() == record["sha256"], file
files = {}

def logical(name):
    entry = manifest["tensors"][name]
    out = np.empty(entry["shape"], dtype=entry["dtype"])
    for piece in entry["pieces"]:
        tensors = files.setdefault(piece["file"], load_file(checkpoint / piece["file"]))
        out[tuple(slice(o, o + n) for o, n in zip(piece["offset"], piece["shape"]))] = tensors[name]
    return out

found = {}
for name in json.loads(expected_path.read_text()):
    array = np.ascontiguousarray(logical(name))
    found[name] = [list(array.shape), hashlib.sha256(array.tobytes()).hexdigest()]
assert "torch" not in sys.modules and "ferry" not in sys.modules, sorted(sys.modules)
print(json.dumps(found))
"""


def test_a_checkpoint_is_read_without_ferry_or_torch(make_config, tmp_path):
    trainer = Trainer(make_config("train.steps=2", run_dir=tmp_path / "run"))
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    expected = {}
    for name, param in trainer.model.named_parameters():
        state = trainer.optimizer.state[param]
        for logical, tensor in (
            (f"model.{name}", param),
            (f"optim.exp_avg.{name}", state["exp_avg"]),
            (f"optim.exp_avg_sq.{name}", state["exp_avg_sq"]),
        ):
            data = tensor.detach().contiguous().numpy()
            expected[logical] = [list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]
    (tmp_path / "expected.json").write_text(json.dumps(list(expected)))

    result = subprocess.run(
        [sys.executable, "-I", "-c", _READER, str(checkpoint), str(tmp_path / "expected.json")],
        env={},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected
    assert len(expected) == 3 * len(list(trainer.model.parameters()))


def test_a_muon_checkpoint_is_read_without_ferry_or_torch(make_config, tmp_path):
    """Muon's momentum of each matrix (the experts' one 3D tensor a layer) and AdamW's moments of the rest, under
    their logical names, read by the same few lines."""
    trainer = Trainer(make_config("optim.name=muon", "train.steps=2", run_dir=tmp_path / "run"))
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    expected = {}
    for name, param in trainer.model.named_parameters():
        state = trainer.optimizer.state[param]
        keys = ["momentum_buffer"] if "momentum_buffer" in state else ["exp_avg", "exp_avg_sq"]
        for logical, tensor in [(f"model.{name}", param), *((f"optim.{key}.{name}", state[key]) for key in keys)]:
            data = tensor.detach().contiguous().numpy()
            expected[logical] = [list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]
    assert any(name.startswith("optim.momentum_buffer.") and len(shape) == 3 for name, (shape, _) in expected.items())
    (tmp_path / "expected.json").write_text(json.dumps(list(expected)))
    result = subprocess.run(
        [sys.executable, "-I", "-c", _READER, str(checkpoint), str(tmp_path / "expected.json")],
        env={},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected

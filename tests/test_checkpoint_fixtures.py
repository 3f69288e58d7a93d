"""Checkpoints an earlier ferry wrote (tests/fixtures/checkpoints, kept unchanged) load into today's: every weight
and every optimizer tensor arrives bit for bit, in one process whatever layout wrote them, and training goes on."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from ferry.checkpoint.reader import verify_checkpoint
from ferry.train import Hook, Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"


class StateAtStart(Hook):
    """The trainer's weights and optimizer state as restored, before its first step."""

    def __init__(self):
        self.trainer = None
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, torch.Tensor] = {}

    def before_training(self) -> None:
        model, optimizer = self.trainer.model, self.trainer.optimizer
        self.weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        for name, param in model.named_parameters():
            for key, value in optimizer.state.get(param, {}).items():
                self.optimizer[f"optim.{key}.{name}"] = value.clone()


@pytest.mark.parametrize(("name", "overrides"), [("adamw", ()), ("muon", ("optim.name=muon",)), ("ep2-zero", ())])
def test_a_checkpoint_of_an_earlier_ferry_loads_bit_for_bit_and_trains_on(name, overrides, make_config, tmp_path):
    checkpoint = Path(shutil.copytree(FIXTURES / name, tmp_path / "step-00000002"))
    stored = verify_checkpoint(checkpoint)
    hook = StateAtStart()
    trainer = Trainer(
        make_config(*overrides, "train.steps=3", f"resume={checkpoint}", run_dir=tmp_path / "run"), hooks=[hook]
    )
    hook.trainer = trainer
    result = trainer.fit()
    model_names = stored.names("model.")
    assert model_names and {f"model.{key}" for key in hook.weights} == set(model_names)
    for logical in model_names:
        assert torch.equal(hook.weights[logical.removeprefix("model.")], stored.read(logical)), logical
    optimizer_names = stored.names("optim.")
    assert optimizer_names and set(hook.optimizer) == set(optimizer_names)
    for logical in optimizer_names:
        assert torch.equal(hook.optimizer[logical], stored.read(logical)), logical
    assert len(result.losses) == 1 and math.isfinite(result.losses[0])

"""ferry's truncated normal: a seed gives the same initial weights under any PyTorch version."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.model.initialisation import truncated_normal_

STD, BOUND = 0.02, 0.06


def _drawn(n: int = 4096) -> torch.Tensor:
    torch.manual_seed(0)
    return truncated_normal_(torch.empty(n), STD, BOUND)


def test_values_outside_the_bounds_are_redrawn_and_the_rest_kept():
    values = _drawn()
    torch.manual_seed(0)
    first_draw = torch.empty(4096).normal_(0.0, STD)
    outside = first_draw.abs() > BOUND
    assert outside.sum() > 0  # the seed's first draw has some to redraw
    assert values.abs().max() <= BOUND
    assert torch.equal(values[~outside], first_draw[~outside])
    assert not torch.equal(values[outside], first_draw[outside])


def test_the_draw_is_pinned_so_a_change_of_torch_cannot_change_initial_weights_unseen():
    """The values for seed 0, as drawn under torch 2.13 (and torch's own `trunc_normal_` there): a torch whose
    normal generator drew otherwise would start every run from other weights; this says so first."""
    values = _drawn()
    expected = [-0.022516796365380287, -0.023047203198075294, -0.005011571571230888, -0.00867757573723793]
    assert values[:4].tolist() == expected
    assert abs(values.double().sum().item() - (-1.2161183512207572)) < 1e-9


def test_the_spread_is_a_normals_cut_at_three_standard_deviations():
    values = _drawn(1_000_000)
    assert abs(values.mean().item()) < 1e-4
    assert abs(values.std().item() / STD - 0.9866) < 0.005  # a normal truncated at +-3 sd keeps 98.66% of its sd


def _rejection_sampler_(tensor: torch.Tensor, std: float, bound: float) -> torch.Tensor:
    """The sampler as torch 2.13's `trunc_normal_` runs it: whole-tensor rounds of compare, draw and select."""
    values = tensor.normal_(0.0, std)
    while True:
        outside = (values < -bound) | (values > bound)
        if not outside.any():
            return tensor.copy_(values)
        values = torch.where(outside, torch.empty_like(values).normal_(0.0, std), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 17, 4096, 65_537, 2_000_000])
def test_redrawing_only_the_positions_outside_draws_what_the_whole_tensor_sampler_draws(numel, dtype):
    """The same values, and the generator left where the sampler leaves it (the next weight's draws)."""
    torch.manual_seed(numel)
    expected = _rejection_sampler_(torch.empty(numel, dtype=dtype), STD, BOUND), torch.rand(4)
    torch.manual_seed(numel)
    drawn = truncated_normal_(torch.empty(numel, dtype=dtype), STD, BOUND), torch.rand(4)
    assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[1], expected[1])


def test_a_strided_view_is_filled_within_the_bounds():
    base = torch.zeros(64, 48)
    truncated_normal_(base.t(), STD, BOUND)
    assert base.abs().max() <= BOUND and base.std() > STD / 2


def test_weights_drawn_on_the_runs_device_are_the_hosts_on_a_cpu_and_recorded(make_config, tmp_path):
    """`run.init_device: run` draws the weights after the move, by the run's device: on a CPU that is the
    host's generator, so the run starts from the same weights (digest and losses) and says how it drew them."""
    from ferry.train import Trainer

    host = Trainer(make_config("train.steps=3", run_dir=tmp_path / "host"))
    drawn = Trainer(make_config("train.steps=3", "run.init_device=run", run_dir=tmp_path / "drawn"))
    assert drawn.initial_weights == host.initial_weights
    for name, tensor in host.model.state_dict().items():
        assert torch.equal(drawn.model.state_dict()[name], tensor), name
    assert drawn.fit().losses == host.fit().losses
    record = json.loads((tmp_path / "drawn" / "run.json").read_text())
    assert record["config"]["run"]["init_device"] == "run"
    assert record["initial_weights_xxh3"] == host.initial_weights


def test_weights_drawn_on_a_gpu_keep_the_bounds_and_the_spread(make_config, tmp_path):
    """On a GPU the device's generator draws them (the point: seconds, not the host's serial minutes for
    billions of parameters): still within three standard deviations, with the norms at one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ferry.train import Trainer

    config = make_config("run.device=cuda", "run.init_device=run", "model.init_std=0.02")
    model = Trainer(config).model
    for name, param in model.named_parameters():
        assert param.device.type == "cuda", name
        if name.endswith("norm.weight"):
            assert torch.all(param == 1.0), name
        else:
            assert param.abs().max().item() <= 3 * 0.02 + 1e-7, name
    expert = next(param for name, param in model.named_parameters() if "w_up" in name or "w_gate" in name)
    assert 0.015 < expert.float().std().item() < 0.02


def test_a_run_started_from_a_checkpoints_weights_draws_none_first(make_config, tmp_path, monkeypatch):
    """`init_from` loads every weight, strictly, so the trainer draws none first (minutes for billions of
    parameters on the host) and records no digest of a random start; the loaded weights are the parent's."""
    import ferry.model.transformer as transformer
    from ferry.train import Trainer
    from ferry.train.restore import initialize_from

    parent = Trainer(make_config("train.steps=2", "checkpoint.interval=2", run_dir=tmp_path / "parent"))
    parent.fit()
    checkpoint = tmp_path / "parent" / "checkpoints" / "step-00000002"
    draws = []
    monkeypatch.setattr(transformer, "truncated_normal_", lambda *args, **kwargs: draws.append(args[0].shape))
    child = Trainer(make_config("train.steps=2", f"init_from={checkpoint}", run_dir=tmp_path / "child"))
    assert draws == [] and child.initial_weights is None
    initialize_from(child.parts.job, child.parts.model, checkpoint)
    for name, tensor in parent.model.state_dict().items():
        assert torch.equal(child.model.state_dict()[name], tensor), name
    Trainer(make_config("train.steps=2", run_dir=tmp_path / "drawn"))
    assert len(draws) > 0, "a run from scratch draws its weights"


def test_a_resume_that_finds_nothing_draws_what_a_run_from_scratch_draws(make_config, tmp_path, monkeypatch):
    """A run asked to resume builds its model undrawn and draws the seed's weights only once it finds no
    checkpoint: the same weights, digest, generator state after them, and so the same losses."""
    import ferry.model.transformer as transformer
    from ferry.train import Trainer
    from ferry.train.restore import draw_deferred_weights

    scratch = Trainer(make_config("train.steps=3", run_dir=tmp_path / "scratch"))
    generator_after_draw = torch.get_rng_state()
    drawn = []
    real_draw = transformer.truncated_normal_

    def counted_draw(tensor: torch.Tensor, std: float, bound: float) -> torch.Tensor:
        drawn.append(tensor.shape)
        return real_draw(tensor, std, bound)

    monkeypatch.setattr(transformer, "truncated_normal_", counted_draw)
    resumed = Trainer(make_config("train.steps=3", "resume=latest", run_dir=tmp_path / "resumed"))
    assert drawn == [] and resumed.initial_weights is None
    progress = []
    assert (
        draw_deferred_weights(
            resumed.parts.job, resumed.parts.numerics.kernels, resumed.parts.model, lambda: progress.append(len(drawn))
        )
        == scratch.initial_weights
    )
    parameters = len(list(resumed.model.parameters()))
    assert len(drawn) > 0 and len(progress) == parameters + 1, "told after each parameter and at the end"
    assert torch.equal(torch.get_rng_state(), generator_after_draw)
    for name, tensor in scratch.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    restarted = Trainer(make_config("train.steps=3", "resume=latest", run_dir=tmp_path / "restarted"))
    assert restarted.fit().losses == scratch.fit().losses
    record = json.loads((tmp_path / "restarted" / "run.json").read_text())
    assert record["initial_weights_xxh3"] == scratch.initial_weights


def test_a_resume_that_finds_its_checkpoint_draws_nothing(make_config, tmp_path, monkeypatch):
    """The checkpoint replaces every weight, so nothing is drawn first, and the run continues as the
    uninterrupted one does."""
    import ferry.model.transformer as transformer
    from ferry.train import Trainer

    straight = Trainer(make_config("train.steps=4", run_dir=tmp_path / "straight")).fit().losses
    stopped = make_config("train.steps=4", "train.stop_at=2", "checkpoint.interval=2", run_dir=tmp_path / "stopped")
    assert Trainer(stopped).fit().losses == straight[:2]
    drawn = []
    monkeypatch.setattr(transformer, "truncated_normal_", lambda *args, **kwargs: drawn.append(args[0].shape))
    resumed = make_config("train.steps=4", "resume=latest", "checkpoint.interval=2", run_dir=tmp_path / "stopped")
    assert Trainer(resumed).fit().losses == straight[2:]
    assert drawn == []

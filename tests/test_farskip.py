"""`model.skip: farskip`: a different function, decoded and recomputed like any model; under expert parallelism
the same numbers as on one process with the combine in flight during the next attention; resumed and rehearsed
between layouts; a standard checkpoint may start it (said so), the reverse is refused; export is refused.

Tolerance: as tests/test_distributed_training.py (1e-5 relative over the steps; a 2-rank run differs from one
process only in the order of floating-point sums).
"""

from __future__ import annotations

import distributed_training as runs
import pytest
import torch
from conftest import TINY_RUN, rehearse_ep2_to_one, tiny_config

from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.config import ConfigError
from ferry.model import KVCache, ModelConfig, Transformer
from ferry.train import Trainer

LAYOUT_TOLERANCE = 1e-5
THREE_LAYERS = ("model.n_layers=3", "train.steps=4")  # two MoE layers: the first one's combine meets an attention


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _models(recompute: str = "none") -> tuple[Transformer, Transformer]:
    config = ModelConfig.model_validate(
        {
            **TINY_RUN["model"],
            "n_layers": 3,
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "shared_expert_ffn_dim": 16},
        }
    )
    torch.manual_seed(0)
    standard = Transformer(config)
    farskip = Transformer(config.model_copy(update={"skip": "farskip"}), initialise=False, recompute=recompute)
    farskip.load_state_dict(standard.state_dict())
    return standard, farskip


def test_farskip_is_another_function_of_the_same_weights_and_decodes_with_a_cache():
    standard, farskip = _models()
    tokens_BS = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_BSV = farskip(tokens_BS).logits_BSV
        assert (full_BSV - standard(tokens_BS).logits_BSV).abs().max() > 1e-3
        cache = KVCache(farskip.config, torch.zeros(2, dtype=torch.long), 20, torch.float32, torch.device("cpu"))
        pieces = [farskip(tokens_BS[:, :8], cache).logits_BSV]
        pieces += [farskip(tokens_BS[:, slot : slot + 1], cache).logits_BSV for slot in range(8, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_BSV, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_farskip_block_gives_the_plain_gradients_bit_for_bit(mode):
    tokens_BS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    gradients = []
    for recompute in ("none", mode):
        _, farskip = _models(recompute)
        farskip(tokens_BS).logits_BSV.square().mean().backward()
        gradients.append([param.grad.clone() for param in farskip.parameters()])
    assert all(torch.equal(plain, again) for plain, again in zip(*gradients))


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("farskip-single")
    config = runs.tiny_config(
        str(stdlib_dataset), str(run_dir), "model.skip=farskip", *THREE_LAYERS, "checkpoint.interval=2"
    )
    return {"losses": Trainer(config).fit().losses, "dir": run_dir}


@pytest.mark.parametrize("exchange", [(), ("parallel.ep_overlap=chunked",)], ids=["one-exchange", "chunked"])
def test_farskip_under_expert_parallelism_trains_as_one_process_with_the_combine_in_flight_over_an_attention(
    single, stdlib_dataset, tmp_path, exchange
):
    """Of the two MoE layers' combines a forward issues, the first is in flight while the next block's attention
    runs (issued before it, completed after it); the last joins the stream before the final norm, with no attention
    between. Checked by the order of the events on rank 0, not by timings."""
    ep2 = run_on_ranks(
        runs.train_recording_overlap,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        "model.skip=farskip",
        "parallel.ep=2",
        *THREE_LAYERS,
        *exchange,
    )[0]
    assert _relative(ep2["losses"], single["losses"]) < LAYOUT_TOLERANCE
    events = ep2["events"]
    issued = {handle: index for index, (event, handle) in enumerate(events) if event == "issue ep_combine"}
    completed = {handle: index for index, (event, handle) in enumerate(events) if event == "complete ep_combine"}
    overlapped = [
        any(events[between][0] == "attention" for between in range(issued[handle], completed[handle]))
        for handle in issued
    ]
    parts = 2 if exchange else 1
    assert len(overlapped) == 4 * 2 * parts, "4 steps, 2 MoE layers, each combine in its parts"
    assert sum(overlapped) == len(overlapped) // 2


def test_the_standard_wiring_waits_for_every_combine_before_the_next_attention(stdlib_dataset, tmp_path):
    """The same model and exchange with the standard wiring: its single exchange each way is synchronous, and with
    chunks every part's combine completes before the next block's attention."""
    chunked = run_on_ranks(
        runs.train_recording_overlap,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        "parallel.ep=2",
        *THREE_LAYERS,
        "parallel.ep_overlap=chunked",
    )[0]
    events = chunked["events"]
    issued = {handle: index for index, (event, handle) in enumerate(events) if event == "issue ep_combine"}
    completed = {handle: index for index, (event, handle) in enumerate(events) if event == "complete ep_combine"}
    assert len(issued) == 4 * 2 * 2
    assert not any(
        events[between][0] == "attention" for handle in issued for between in range(issued[handle], completed[handle])
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_farskip_blocks_under_expert_parallelism_issue_no_exchange_again(stdlib_dataset, tmp_path, mode):
    """A block's recompute waits again for the previous layer's combine and runs the next layer's dispatch again:
    both come from the first run (no all-to-all reaches the process group twice), the losses bit for bit."""
    plain, recomputed = (
        run_on_ranks(
            runs.train_counting_exchanges,
            2,
            str(stdlib_dataset),
            str(tmp_path / name),
            "model.skip=farskip",
            "parallel.ep=2",
            *THREE_LAYERS,
            f"train.activation_checkpointing={name}",
        )[0]
        for name in ("none", mode)
    )
    assert recomputed["losses"] == plain["losses"]
    assert recomputed["exchanges"] == plain["exchanges"] > 0


def test_a_farskip_ep2_checkpoint_resumes_on_one_process(single, stdlib_dataset, tmp_path):
    ep_dir = tmp_path / "ep2"
    run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(ep_dir),
        "model.skip=farskip",
        "parallel.ep=2",
        "optim.zero=true",
        *THREE_LAYERS,
        "checkpoint.interval=2",
    )
    config = runs.tiny_config(
        str(stdlib_dataset),
        str(tmp_path / "resumed"),
        "model.skip=farskip",
        *THREE_LAYERS,
        f"resume={ep_dir / 'checkpoints' / 'step-00000002'}",
    )
    assert _relative(Trainer(config).fit().losses, single["losses"][2:]) < LAYOUT_TOLERANCE


def test_a_standard_checkpoint_starts_farskip_saying_so_and_farskip_cannot_pass_for_standard(
    single, stdlib_dataset, tmp_path, capsys
):
    standard_dir = tmp_path / "standard"
    Trainer(tiny_config(stdlib_dataset, standard_dir, "model.n_layers=3", "train.steps=2")).fit()
    converted = tiny_config(
        stdlib_dataset,
        tmp_path / "converted",
        "model.n_layers=3",
        "train.steps=2",
        "model.skip=farskip",
        f"init_from={standard_dir / 'checkpoints'}",
    )
    Trainer(converted).fit()
    assert "model.skip: standard -> farskip" in capsys.readouterr().out
    back = tiny_config(
        stdlib_dataset,
        tmp_path / "back",
        "model.n_layers=3",
        "train.steps=2",
        f"init_from={single['dir'] / 'checkpoints'}",
    )
    with pytest.raises(ConfigError, match="model.skip: checkpoint 'farskip', this run 'standard'"):
        Trainer(back).fit()


def test_export_of_a_farskip_model_is_refused_naming_the_field(single, tmp_path, capsys):
    code = main(["export", str(single["dir"] / "checkpoints"), str(tmp_path / "hf")])
    assert code == 2 and "model.skip: farskip" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_farskip_model_rehearses_from_two_ranks_to_one(stdlib_dataset, tmp_path):
    code, verdict = rehearse_ep2_to_one(stdlib_dataset, tmp_path, "model.skip=farskip", "model.n_layers=3")
    assert code == 0 and verdict["verdict"] == "PASS" and verdict["profile"] == "same-hardware"


def test_fsdp_is_refused_naming_the_wiring_it_cannot_follow(stdlib_dataset, tmp_path):
    """Found by the layout fuzzer: under FSDP a FarSkip run crashed in its backward (a block's weights released),
    FSDP's re-gathering hooks never seeing the unfinished FFN output the block hands on."""
    with pytest.raises(ConfigError, match="mode fsdp: model.skip farskip hands each block's FFN output on unfinished"):
        tiny_config(stdlib_dataset, tmp_path, "model.skip=farskip", "parallel.mode=fsdp")

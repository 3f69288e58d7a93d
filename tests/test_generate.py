"""Decoding with the key/value cache: logits with and without it agree (padded batches, GQA, dense
layers), a padded batch gives what each prompt gives alone, greedy tokens equal transformers'
`generate(do_sample=False)` on the export, sampling follows its options and seed, EOS and stop strings
end a completion, and `ferry generate` works on a trained checkpoint and refuses bad input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_interop import BASE, CASES, _random_model
from transformers import AutoModelForCausalLM

from ferry.cli.main import main
from ferry.config import UserError
from ferry.inference import GenerationConfig, generate
from ferry.inference.sampling import filter_scores, next_tokens
from ferry.interop.architectures import hf_config, to_hf_state
from ferry.model import KVCache, ModelConfig
from ferry.train import Trainer

GREEDY = GenerationConfig(max_new_tokens=12, temperature=0.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_logits_equal_the_full_forward_for_left_padded_rows(case):
    config = ModelConfig.model_validate({**BASE, **CASES[case][1]})
    model = _random_model(config)
    tokens_BS = torch.randint(0, config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(2))
    pad_B = torch.tensor([0, 4, 7])
    padded_BS = torch.zeros_like(tokens_BS)
    for row, pad in enumerate(pad_B.tolist()):
        padded_BS[row, pad:] = tokens_BS[row, : 21 - pad]
    cache = KVCache(config, pad_B, 21, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        full_BSV = model(tokens_BS).logits_BSV
        pieces = [model(padded_BS[:, :9], cache).logits_BSV]
        pieces += [model(padded_BS[:, slot : slot + 1], cache).logits_BSV for slot in range(9, 21)]
    cached_BSV = torch.cat(pieces, dim=1)
    for row, pad in enumerate(pad_B.tolist()):
        torch.testing.assert_close(cached_BSV[row, pad:], full_BSV[row, : 21 - pad], rtol=1e-5, atol=1e-5)
    assert cache.length == 21
    with pytest.raises(ValueError, match="overflow"):
        model(padded_BS[:, :1], cache)


def test_a_pipeline_stage_caches_only_its_own_blocks():
    """A stage's model (its blocks kept, the others absent) decodes with a cache of its blocks alone: a quarter
    of the buffers for one block of four; asking it for another block is an error that names what it keeps."""
    config = ModelConfig.model_validate({**BASE, "n_layers": 4})
    model = _random_model(config)
    model.keep_only({2}, embedding=False, head=False)
    assert model.held_blocks() == [2]
    whole = KVCache(config, torch.tensor([0, 1]), 8, torch.float32, torch.device("cpu"))
    stage = KVCache(config, torch.tensor([0, 1]), 8, torch.float32, torch.device("cpu"), layers=model.held_blocks())
    assert [4 * buffer.numel() for buffer in stage.buffers] == [buffer.numel() for buffer in whole.buffers]
    assert stage.bytes_per_token == whole.bytes_per_token, "the model's figure, every stage's layers together"
    step = stage.begin(1)
    assert stage.layer(2, step).buffers[0].shape == whole.layer(2, step).buffers[0].shape
    with pytest.raises(ValueError, match=r"block 0 is not cached here \(this cache keeps blocks \[2\]\)"):
        stage.layer(0, step)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers_generate_on_the_export(case):
    arch, overrides = CASES[case]
    config = ModelConfig.model_validate({**BASE, **overrides})
    ours = _random_model(config)
    theirs = AutoModelForCausalLM.from_config(hf_config(config, arch, 0, "float32"))
    theirs.load_state_dict(to_hf_state(ours.state_dict(), config), strict=False)
    theirs.eval()
    prompts = [[5, 17, 33, 2, 9, 41, 8], [60, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    result = generate(ours, prompts, GREEDY)
    for prompt, completion in zip(prompts, result.completions):
        expected = theirs.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.tokens == expected, f"{case}: prompt {prompt}"
        assert completion.finish_reason == "length"
    assert result.prefill_tokens == 20 and result.decode_tokens == 36


def test_a_padded_batch_gives_what_each_prompt_gives_alone():
    config = ModelConfig.model_validate({**BASE, **CASES["qwen3-dense-first-renorm"][1]})
    model = _random_model(config)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40], [7, 7, 7, 7]]
    sampled = GenerationConfig(max_new_tokens=10, temperature=0.0, seed=3)
    batch = generate(model, prompts, sampled).completions
    for prompt, completion in zip(prompts, batch):
        alone = generate(model, [prompt], sampled).completions[0]
        assert completion.tokens == alone.tokens
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_sampling_follows_its_seed_and_options():
    model = _random_model(ModelConfig.model_validate({**BASE, **CASES["olmoe-gqa-top1"][1]}))
    prompts = [[3, 4, 5], [9, 8]]

    def tokens(**options) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=16, **options)
        return [completion.tokens for completion in generate(model, prompts, config).completions]

    greedy = tokens(temperature=0.0)
    assert tokens(temperature=1.0, seed=1) == tokens(temperature=1.0, seed=1)
    assert tokens(temperature=1.0, seed=1) != tokens(temperature=1.0, seed=2)
    assert tokens(temperature=1.5, top_k=1, seed=4) == greedy
    assert tokens(temperature=1.5, top_p=1e-6, seed=4) == greedy
    assert tokens(temperature=1e-4, seed=5) == greedy


def test_top_k_and_top_p_keep_the_right_tokens():
    scores_BV = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = torch.isfinite(filter_scores(scores_BV, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = torch.isfinite(filter_scores(scores_BV, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = torch.isfinite(filter_scores(scores_BV, top_k=0, top_p=0.81))
    assert kept.tolist() == [[True, True, True, False], [False, True, True, True]]
    tokens_B, logprobs_B = next_tokens(scores_BV, GenerationConfig(temperature=0.0), torch.Generator())
    assert tokens_B.tolist() == [0, 3]
    assert logprobs_B.tolist() == pytest.approx([torch.log(torch.tensor(0.5)).item()] * 2)


def test_eos_and_stop_strings_end_a_completion():
    model = _random_model(ModelConfig.model_validate({**BASE, **CASES["olmoe-gqa-top1"][1]}))
    prompt = [[3, 4, 5]]
    free = generate(model, prompt, GREEDY).completions[0].tokens
    eos = free[4]
    ended = generate(model, prompt, GREEDY, end_ids=[eos]).completions[0]
    assert ended.tokens == free[: free.index(eos) + 1] and ended.finish_reason == "eos"
    first, second = free[4], free[2]  # either of two end tokens ends it, whichever comes first
    ended = generate(model, prompt, GREEDY, end_ids=[first, second]).completions[0]
    assert ended.tokens == free[: min(free.index(first), free.index(second)) + 1] and ended.finish_reason == "eos"

    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + token % 26) for token in ids)

    stop = decode(free[2:4])
    stopped = generate(model, prompt, GREEDY.model_copy(update={"stop": [stop]}), decode=decode).completions[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == decode(free)[: decode(free).index(stop)]
    assert stopped.tokens == free[: len(stopped.tokens)] and len(stopped.tokens) <= 4


def test_generation_stops_at_max_seq_len():
    config = ModelConfig.model_validate({**BASE, **CASES["olmoe-gqa-top1"][1], "max_seq_len": 16})
    model = _random_model(config)
    completion = generate(model, [[1] * 10], GenerationConfig(max_new_tokens=50, temperature=0.0)).completions[0]
    assert len(completion.tokens) == 7 and completion.finish_reason == "length"
    full = generate(model, [[1] * 16], GREEDY).completions[0]  # a prompt that fills the model still predicts one
    assert len(full.tokens) == 1 and full.finish_reason == "length"
    with pytest.raises(UserError, match="a prompt of 17 tokens exceeds model.max_seq_len"):
        generate(model, [[1] * 17], GREEDY)


@pytest.fixture(scope="module")
def trained_run(stdlib_dataset, tmp_path_factory):
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("generate") / "run"
    Trainer(
        tiny_config(stdlib_dataset, run_dir, "model.qk_norm=true", "model.qk_norm_scope=head", "train.steps=2")
    ).fit()
    return run_dir


def test_ferry_generate_on_a_run_matches_transformers_on_its_export(trained_run, tmp_path, capsys):
    prompt = "def main():\n    return"
    assert (
        main(
            ["generate", str(trained_run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8", "--json"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert "prefill" in err and "tok/s" in err and "checkpoints/step-00000002" in err
    assert main(["export", str(trained_run / "checkpoints" / "step-00000002"), str(tmp_path / "hf")]) == 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1] :].tolist()
    assert record["tokens"] == expected
    assert record["completion"] == tokenizer.decode([t for t in expected if t != tokenizer.eos_token_id])
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(tmp_path / "hf"),
                "--prompt",
                prompt,
                "--temperature",
                "0",
                "--max-new-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == expected


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        ([], "--prompt"),
        (["--prompt", "x", "--tokenizer", "/nonexistent/tokenizer.json"], "/nonexistent/tokenizer.json"),
        (["--prompt", "x " * 400], "max_seq_len"),
    ],
)
def test_bad_generate_input_exits_2_naming_it(trained_run, argv, named, capsys):
    assert main(["generate", str(trained_run), *argv]) == 2
    assert named in capsys.readouterr().err


def test_generate_refuses_a_missing_source(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "nothing" in capsys.readouterr().err


def test_a_tokenizer_that_encodes_otherwise_than_the_runs_is_refused_wherever_it_is_found(
    trained_run, tmp_path, capsys
):
    """The run's data directory is looked up by its recorded path, which may hold another tokenizer by now: the
    checkpoint's encoding digest decides, for a given `--tokenizer` as for the found one, in generate and export."""
    import shutil

    from conftest import rewrite_manifest

    from ferry.data.tokenizer import BPETokenizer

    checkpoint = trained_run / "checkpoints" / "step-00000002"
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(BPETokenizer.train(["while True:\n    pass\n" * 50, "import sys\n" * 50], 500).to_json())
    assert main(["generate", str(checkpoint), "--prompt", "x", "--tokenizer", str(other)]) == 2
    assert f"tokenizer {other} encodes text otherwise than the one {checkpoint} was trained with" in (
        capsys.readouterr().err
    )
    moved = tmp_path / "moved" / "step-00000002"
    shutil.copytree(checkpoint, moved)
    rewrite_manifest(
        moved, lambda manifest: manifest["run_config"]["data"]["sources"][0].update(path=str(other.parent))
    )
    for command in (["generate", str(moved), "--prompt", "x"], ["export", str(moved), str(tmp_path / "hf")]):
        assert main(command) == 2
        assert f"tokenizer {other} encodes text otherwise" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    right = tmp_path / "right-tokenizer.json"
    data = json.loads((checkpoint / "manifest.json").read_text())["run_config"]["data"]["sources"][0]["path"]
    shutil.copyfile(Path(data) / "tokenizer.json", right)
    assert main(["generate", str(moved), "--prompt", "x", "--tokenizer", str(right), "--max-new-tokens", "2"]) == 0


def test_a_sampled_prompt_gets_the_same_tokens_alone_and_batched(trained_run, capsys):
    sampled = ["--temperature", "1", "--max-new-tokens", "8", "--seed", "7", "--json"]

    def tokens(*prompts: str) -> list[list[int]]:
        assert main(["generate", str(trained_run), *(arg for p in prompts for arg in ("--prompt", p)), *sampled]) == 0
        return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]

    alone = tokens("class A:")
    assert tokens("def f(x):", "class A:")[1] == alone[0]
    assert tokens("class A:", "class A:") == [alone[0], alone[0]]  # one seed per prompt, as a server's request

"""Fine-tuning in a model's own chat template: conversations rendered with the template transformers would render
(its ids equal `apply_chat_template`'s, and with `{% generation %}` marks its trained tokens equal transformers'
assistant mask); without marks, each assistant turn's tokens derived by rendering with and without it (GPT-OSS's
harmony format: the final channel of every turn, and the analysis channel and `<|return|>` of the last); a template
that rewrites earlier text is refused naming the turn. End to end, on a tiny GPT-OSS directory written by
transformers with a tiny tokenizer and the harmony template shipped as fixtures: `ferry import`, `ferry data
prepare --chat` (and `--preferences`, `--prompts`) in the imported template, SFT and DPO from the import, `ferry
export`, and transformers prompting the export with the template exactly as ferry did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import PreTrainedTokenizerFast

from ferry.cli.main import main
from ferry.config import UserError
from ferry.data.chat import Message
from ferry.data.chat_template import TemplateChat, read_chat_template
from ferry.data.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
TOKENIZER = FIXTURES / "tokenizer.json"
CONVERSATIONS = [
    [Message("user", "What is 2+2?"), Message("assistant", "4.")],
    [
        Message("system", "Be brief."),
        Message("user", "What is 2+2?"),
        Message("assistant", "4.", "Add them."),
        Message("user", "And 3+3?"),
        Message("assistant", "Six, as 3 and 3 make 6.", "Add again."),
    ],
    [Message("user", "Say <|end|> twice."), Message("assistant", "<|end|> <|end|>")],
]


def _chat(template: str) -> TemplateChat:
    return TemplateChat(load_tokenizer(TOKENIZER), read_chat_template(FIXTURES / template), template)


def _theirs(template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>", chat_template=read_chat_template(FIXTURES / template)
    )


def _as_dicts(messages: list[Message]) -> list[dict]:
    return [{"role": m.role, "content": m.content} | ({"thinking": m.thinking} if m.thinking else {}) for m in messages]


def _trained_text(chat: TemplateChat, messages: list[Message]) -> list[str]:
    """The trained tokens' text, one string per run of trained tokens, special tokens spelled out."""
    rendered = chat.render_many([messages])[0]
    spelled = {added["id"]: added["content"] for added in json.loads(TOKENIZER.read_text())["added_tokens"]}
    runs, current = [], []
    for token, trained in zip(rendered.ids.tolist(), rendered.trained):
        if trained:
            current.append(spelled.get(token) or chat.tokenizer.decode([token]))
        elif current:
            runs.append("".join(current))
            current = []
    return runs + (["".join(current)] if current else [])


@pytest.mark.parametrize("template", ["harmony.jinja", "chatml-generation.jinja"])
def test_the_rendering_is_transformers_apply_chat_template_token_for_token(template):
    ours, theirs = _chat(template), _theirs(template)
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(_as_dicts(messages), tokenize=True, return_dict=True)["input_ids"]
        assert ours.render_many([messages])[0].ids.tolist() == expected
        asking = theirs.apply_chat_template(
            _as_dicts(messages[:-1]), tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert ours.prompt(messages[:-1]).tolist() == asking


def test_generation_marks_train_what_transformers_masks_as_the_assistants():
    ours, theirs = _chat("chatml-generation.jinja"), _theirs("chatml-generation.jinja")
    assert ours.marked
    for messages in CONVERSATIONS[:2]:
        mask = theirs.apply_chat_template(
            _as_dicts(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]
        assert ours.render_many([messages])[0].trained.tolist() == [bool(flag) for flag in mask]
    assert _trained_text(ours, CONVERSATIONS[1]) == ["4.<|im_end|>", "Six, as 3 and 3 make 6.<|im_end|>"]


def test_harmony_without_marks_trains_every_final_channel_and_the_last_turns_analysis_and_return():
    chat = _chat("harmony.jinja")
    assert not chat.marked
    assert _trained_text(chat, CONVERSATIONS[1]) == [
        "<|channel|>final<|message|>4.",
        "<|channel|>analysis<|message|>Add again.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Six, as 3 and 3 make 6.<|return|>",
    ]
    spelled = {added["content"]: added["id"] for added in json.loads(TOKENIZER.read_text())["added_tokens"]}
    assert chat.end_ids == [spelled["<|return|>"]]
    prompt = CONVERSATIONS[1][:4]
    completion = chat.completion(prompt, "6.")
    assert (
        np.concatenate([chat.prompt(prompt), completion]).tolist()
        == chat.render_many([[*prompt, Message("assistant", "6.")]])[0].ids.tolist()
    )


def test_the_answer_a_grpo_verifier_reads_is_what_stands_where_the_template_puts_an_answers_content():
    harmony, chatml = _chat("harmony.jinja"), _chat("chatml-generation.jinja")
    written = harmony.render_many([[Message("user", "What is 2+4?"), Message("assistant", "6.", "Add 2 and 4.")]])[0]
    completion = written.ids[written.trained].tolist()  # what the model writes after the prompt
    assert harmony.answer_text(completion) == "6."
    spelled = chatml.render_many([[Message("user", "What is 2+4?"), Message("assistant", "6.")]])[0]
    assert chatml.answer_text(spelled.ids[spelled.trained].tolist()) == "6."


def test_text_that_spells_a_special_token_becomes_it_as_in_transformers():
    chat = _chat("harmony.jinja")
    end = load_tokenizer(TOKENIZER).token_id("<|end|>")
    ids = chat.render_many([CONVERSATIONS[2]])[0].ids.tolist()
    assert ids.count(end) >= 4  # two closing turns, two in the user's text, two in the answer's


def test_a_template_that_rewrites_earlier_text_by_what_follows_is_refused_naming_the_turn(tmp_path):
    counting = tmp_path / "counting.jinja"
    counting.write_text(
        "{{ messages | length }} messages{% for m in messages %}|{{ m.role }}: {{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}|assistant: {% endif %}"
    )
    chat = TemplateChat(load_tokenizer(TOKENIZER), counting.read_text(), str(counting))
    with pytest.raises(UserError, match="the conversation before assistant turn 1 renders otherwise on its own"):
        chat.render_many([CONVERSATIONS[0]])


def test_an_older_directorys_template_is_read_from_tokenizer_config_json(tmp_path):
    template = read_chat_template(FIXTURES / "harmony.jinja")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert read_chat_template(tmp_path) == template
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}
        )
    )
    assert read_chat_template(named) == template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    with pytest.raises(UserError, match="has no chat_template"):
        read_chat_template(tmp_path / "tokenizer_config.json")


GPT_OSS_TINY = dict(
    vocab_size=448,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    max_seq_len=128,
    attention_bias=True,
    attention_sinks=True,
    sliding_window=16,
    rope_theta=150000.0,
    moe=dict(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=16,
        score_func="softmax",
        renormalize=True,
        router_bias=True,
        expert_biases=True,
        activation="clamped_swiglu",
    ),
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """A tiny GPT-OSS directory as transformers writes it: random weights, the fixture tokenizer and the harmony
    template (`chat_template.jinja`)."""
    from transformers import GptOssForCausalLM

    from ferry.interop.architectures import hf_config
    from ferry.model import ModelConfig

    out = tmp_path_factory.mktemp("gpt-oss-chat") / "hf"
    config = ModelConfig.model_validate(GPT_OSS_TINY)
    torch.manual_seed(0)
    GptOssForCausalLM(hf_config(config, "gpt_oss", None, "float32")).save_pretrained(out)
    _theirs("harmony.jinja").save_pretrained(out)
    assert (out / "chat_template.jinja").is_file()
    return out


def _conversations_file(path: Path) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a}+{b}?"},
                {"role": "assistant", "content": f"{a + b}.", "thinking": f"Add {a} and {b}."},
            ]
        }
        for a in range(6)
        for b in range(6)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_import_then_sft_dpo_and_export_in_the_models_own_template(gpt_oss_dir, tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import", str(gpt_oss_dir), str(imported)]) == 0
    out = capsys.readouterr().out
    assert f"chat template: {imported / 'chat_template.jinja'}" in out
    assert (imported / "chat_template.jinja").read_text() == (gpt_oss_dir / "chat_template.jinja").read_text()

    sft_data = tmp_path / "data" / "sft"
    argv = [
        "data",
        "prepare",
        "--chat",
        str(_conversations_file(tmp_path / "chat.jsonl")),
        "--seq-len",
        "64",
        "--tokenizer",
        str(imported / "tokenizer.json"),
        "--output",
        str(sft_data),
    ]
    assert main(argv) == 0
    manifest = json.loads((sft_data / "manifest.json").read_text())
    assert manifest["chat"]["template"].startswith("jinja:") and (sft_data / "chat_template.jinja").is_file()
    assert manifest["tokenizer"]["vocab_size"] == load_tokenizer(TOKENIZER).vocab_size, "no tokens added"

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a}+1?", "chosen": f"{a + 1}.", "rejected": f"{a}."}) + "\n"
            for a in range(8)
        )
    )
    assert (
        main(
            [
                "data",
                "prepare",
                "--preferences",
                str(pairs),
                "--tokenizer",
                str(imported / "tokenizer.json"),
                "--output",
                str(tmp_path / "data" / "pairs"),
            ]
        )
        == 0
    )
    capsys.readouterr()

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {a}+2?", "answer": str(a + 2)} for a in range(8)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert (
        main(
            [
                "data",
                "prepare",
                "--prompts",
                str(prompts),
                "--tokenizer",
                str(imported / "tokenizer.json"),
                "--output",
                str(tmp_path / "data" / "prompts"),
            ]
        )
        == 0
    )
    common = [
        "configs/tiny.yaml",
        "--model",
        str(imported / "model.yaml"),
        "data.seq_len=64",
        "train.global_batch=4",
        "train.micro_batch=4",
        "train.log_every=1",
        "optim.warmup_steps=1",
    ]
    sft_run, dpo_run = tmp_path / "runs" / "sft", tmp_path / "runs" / "dpo"
    assert (
        main(
            [
                "train",
                *common,
                f"data.sources=[{{name: sft, path: {sft_data}}}]",
                f"run.dir={sft_run}",
                "train.steps=3",
                f"init_from={imported / 'checkpoints' / 'step-00000000'}",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < record["trained_share"] < 1 for record in records), "only the assistant's tokens train"
    assert (
        main(
            [
                "train",
                *common,
                f"data.sources=[{{name: pairs, path: {tmp_path / 'data' / 'pairs'}}}]",
                f"run.dir={dpo_run}",
                "train.steps=2",
                "train.objective=dpo",
                f"init_from={sft_run / 'checkpoints' / 'step-00000003'}",
            ]
        )
        == 0
    )
    grpo_run = tmp_path / "runs" / "grpo"
    assert (
        main(
            [
                "train",
                *common,
                f"data.sources=[{{name: prompts, path: {tmp_path / 'data' / 'prompts'}}}]",
                f"run.dir={grpo_run}",
                "train.steps=1",
                "train.objective=grpo",
                "grpo.group_size=2",
                "grpo.max_new_tokens=12",
                f"init_from={sft_run / 'checkpoints' / 'step-00000003'}",
            ]
        )
        == 0
    )
    grpo = json.loads((grpo_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < grpo["completion_length"] <= 12 and 0 <= grpo["reward"] <= 1
    capsys.readouterr()

    hf_out = tmp_path / "hf-out"
    assert main(["export", str(dpo_run), str(hf_out)]) == 0
    assert "as gpt_oss" in capsys.readouterr().out
    exported = PreTrainedTokenizerFast.from_pretrained(hf_out)
    asked = [{"role": "user", "content": "What is 2+3?"}]
    theirs = exported.apply_chat_template(asked, tokenize=True, add_generation_prompt=True, return_dict=True)
    ours = _chat("harmony.jinja").prompt([Message("user", "What is 2+3?")])
    assert theirs["input_ids"] == ours.tolist()
    generation = json.loads((hf_out / "generation_config.json").read_text())
    assert exported.convert_tokens_to_ids("<|return|>") in generation["eos_token_id"]
    assert yaml.safe_load((imported / "model.yaml").read_text())["model"]["attention_sinks"] is True


def test_a_ferry_exports_chatml_template_comes_back_as_ferrys_own_chatml(tmp_path):
    """An export of a ChatML run ships ChatML in Jinja; imported, it renders as ferry's ChatML did (the mask leaves
    the newline after <|im_end|> untrained, text spelling a chat token stays text)."""
    from ferry.data.chat import CHAT_TEMPLATE_JINJA, ChatEncoder
    from ferry.data.chat_template import chat_encoder, template_label

    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE_JINJA)
    encoder = chat_encoder(load_tokenizer(TOKENIZER), tmp_path / "chat_template.jinja")
    assert isinstance(encoder, ChatEncoder) and template_label(tmp_path / "chat_template.jinja") == "chatml"
    assert template_label(FIXTURES / "harmony.jinja").startswith("jinja:")

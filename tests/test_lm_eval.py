"""An independent evaluator: lm-evaluation-harness, offline, on an exported checkpoint, runs the
recipe's local tasks (recipes/lm-eval) and finds the log-likelihoods ferry's own model computes:
each choice of the multiple-choice task, so the same accuracy, and each snippet of the rolling task,
so the same bits per byte (every snippet fits one window of the model's 256 tokens, so the harness's
rolling windows are one per snippet, predicted from its end-of-text prefix token)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_config

from ferry.cli.main import main
from ferry.inference import load_model
from ferry.train import Trainer

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed: pip install 'ferry-moe[lm-eval]'")

RECIPE = REPO / "recipes" / "lm-eval"


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _sum_logprob(model, context: list[int], continuation: list[int]) -> float:
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs_SV = torch.log_softmax(model(tokens[:, :-1]).logits_BSV[0].float(), dim=-1)
    targets = torch.tensor(continuation)
    return logprobs_SV[len(context) - 1 :].gather(1, targets[:, None]).sum().item()


def test_lm_eval_on_the_export_finds_ferrys_log_likelihoods(stdlib_dataset, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(
        tiny_config(
            stdlib_dataset,
            run_dir,
            "model.qk_norm=true",
            "model.qk_norm_scope=head",
            "model.max_seq_len=256",
            "train.steps=3",
        )
    ).fit()
    export = tmp_path / "hf"
    assert main(["export", str(run_dir / "checkpoints" / "step-00000003"), str(export)]) == 0
    offline = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={export},dtype=float32",
            "--tasks",
            "ferry_code_choice,ferry_code_rolling",
            "--include_path",
            "recipes/lm-eval",
            "--device",
            "cpu",
            "--batch_size",
            "4",
            "--output_path",
            str(tmp_path / "lm-eval"),
            "--log_samples",
        ],
        cwd=REPO,
        env=offline,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = (tmp_path / "lm-eval").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {
        task: _read_jsonl(next((tmp_path / "lm-eval").rglob(f"samples_{task}_*.jsonl")))
        for task in ("ferry_code_choice", "ferry_code_rolling")
    }

    loaded = load_model(run_dir, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = tokenizer.eos_id

    choice_docs = _read_jsonl(RECIPE / "code_choice.jsonl")
    assert len(samples["ferry_code_choice"]) == len(choice_docs)
    correct = 0
    for sample in samples["ferry_code_choice"]:
        doc = choice_docs[sample["doc_id"]]
        ours = []
        for choice in doc["choices"]:
            # the harness's split: trailing spaces of the context move to the continuation, then the
            # continuation's tokens are those of context + continuation after the context's
            text, spaces = doc["context"].rstrip(" "), len(doc["context"]) - len(doc["context"].rstrip(" "))
            context = tokenizer.encode(text).tolist()
            whole = tokenizer.encode(text + " " * spaces + choice).tolist()
            ours.append(_sum_logprob(model, context, whole[len(context) :]))
        theirs = [float(response[0]) for response in sample["filtered_resps"]]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-4)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == doc["answer"])
    assert results["ferry_code_choice"]["acc,none"] == pytest.approx(correct / len(choice_docs))

    total_logprob = total_bytes = 0.0
    for sample in samples["ferry_code_rolling"]:
        text = sample["doc"]["text"]
        ours = _sum_logprob(model, [eos], tokenizer.encode(text).tolist())
        assert ours == pytest.approx(float(sample["filtered_resps"][0]), rel=1e-4)
        total_logprob += ours
        total_bytes += len(text.encode("utf-8"))
    bits_per_byte = -total_logprob / total_bytes / math.log(2)
    assert results["ferry_code_rolling"]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-4)

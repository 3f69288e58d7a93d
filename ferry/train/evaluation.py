"""`ferry eval`: a checkpoint's held-out figures on prepared datasets, with the run's own evaluation settings
unless the request says otherwise, so that on the run's checkpoint the figures are the ones it recorded.

Token datasets give loss and perplexity (`ferry.inference.HeldOutEvaluation`), record datasets the figures of
the objective that reads them (`ferry.train.objectives.record_evaluation`): solve rates of prompts, the ranking
of preference pairs (and the DPO rewards against a reference). Each bad setting is named by the flag the
request came with, or by the recorded setting it was taken from.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.config import UserError
from ferry.config.loader import validate_named
from ferry.metrics.progress import WorkProgress

Say = Callable[[str], None]


@dataclass(frozen=True)
class EvalRequest:
    """What `ferry eval` was asked: the model, the datasets, and the settings given (None: the run's)."""

    source: str
    data: list[str]
    device: str = "auto"
    dtype: str = "fp32"
    tokenizer: str | None = None
    seq_len: int | None = None
    batches: int | None = None
    batch_size: int | None = None
    micro_batch: int | None = None
    document_masking: str = "run"
    verifier: str | None = None
    reference: str | None = None


@dataclass(frozen=True)
class EvalReport:
    """The figures of each dataset, by path, and the windows token datasets were read in (empty without any)."""

    origin: str
    step: int | None
    windows: dict[str, int]
    figures: dict[str, dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.origin, "step": self.step, **self.windows, "datasets": self.figures}


def evaluate_checkpoint(request: EvalRequest, say: Say) -> EvalReport:
    """Every dataset of the request evaluated once; `say` gets the progress lines."""
    from ferry.inference import load_model

    repeated = sorted({path for path in request.data if request.data.count(path) > 1})
    if repeated:
        raise UserError(f"--data {repeated[0]!r} is given twice; each dataset is evaluated once")
    loaded = load_model(request.source, request.device, request.dtype, request.tokenizer)
    kinds = {path: _dataset_kind(path) for path in request.data}
    token_paths = [path for path, kind in kinds.items() if kind is None]
    token_figures, windows = _token_figures(request, loaded, token_paths, say)
    figures = {
        path: token_figures[path] if kind is None else _record_figures(request, loaded, path, kind, say)
        for path, kind in kinds.items()
    }
    return EvalReport(loaded.origin, loaded.step, windows, figures)


def _dataset_kind(path: str) -> str | None:
    """`prompts` or `preferences` for a record dataset; None for a token dataset (or anything unreadable,
    which the token reader then names)."""
    from ferry.data.manifest import MANIFEST_NAME, record_kind

    try:
        return record_kind(json.loads((Path(path) / MANIFEST_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return None


def _record_figures(request: EvalRequest, loaded, path: str, kind: str, say: Say) -> dict:
    """Solve rates of a prompt set, or the ranking of a pair set's answers (and the DPO rewards against the
    reference), with the run's `grpo` / `dpo` settings."""
    from ferry.data.records import RecordDataset
    from ferry.train.objectives.config import DPOConfig, GRPOConfig
    from ferry.train.objectives.record_evaluation import preference_figures, prompt_figures

    run = loaded.run_config
    dataset = RecordDataset(path, f"--data {path}", kind)
    _check_record_tokenizer(loaded, dataset)
    if kind == "prompts":
        settings = dict(run.get("grpo") or {})
        if request.verifier is not None:
            settings["verifier"] = request.verifier
        names = {key: "--verifier" if key == "verifier" else f"the run's grpo.{key}" for key in settings}
        config = validate_named(GRPOConfig, {key: (names[key], value) for key, value in settings.items()})
        return prompt_figures(loaded.model, dataset, config, seed=(run.get("run") or {}).get("seed", 0))
    config = DPOConfig.model_validate(run.get("dpo") or {})
    reference_path = request.reference
    if reference_path is None and (run.get("train") or {}).get("objective") == "dpo":
        reference_path = run.get("init_from")
    reference = None
    if reference_path is not None and reference_path != "none":
        from ferry.inference import load_model

        flag = "--reference" if request.reference is not None else "the run's init_from (the DPO reference)"
        try:
            reference = load_model(reference_path, request.device, request.dtype, request.tokenizer).model
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if reference.config.vocab_size != loaded.model.config.vocab_size:
            raise UserError(
                f"{flag}: {reference_path} has a vocabulary of {reference.config.vocab_size} tokens, the model "
                f"{loaded.model.config.vocab_size}: a reference scores the same token ids, so it is of the same model"
            )
    batches = -(-len(dataset) // config.score_batch)
    with WorkProgress(f"eval {path}", batches, say=say, unit=f"batches of {config.score_batch} pairs") as work:
        return preference_figures(loaded.model, dataset, config, reference, progress=work.advance)


def _check_record_tokenizer(loaded, dataset) -> None:
    """The records must be tokenized as the model's data was, and fit its vocabulary."""
    from ferry.data.tokenizer import encoding_digest
    from ferry.inference.evaluation import check_dataset_tokenizer

    digest = None if loaded.tokenizer is None else encoding_digest(loaded.tokenizer)
    expected_from = f"the model's tokenizer ({loaded.tokenizer_path})"
    check_dataset_tokenizer(dataset, digest, loaded.model.config.vocab_size, expected_from)


def _token_figures(request: EvalRequest, loaded, paths: list[str], say: Say) -> tuple[dict[str, dict], dict[str, int]]:
    """Loss and perplexity of every token dataset, with the run's evaluation settings unless the request says
    otherwise; and those settings (window length, batches and their size)."""
    from ferry.data.tokenizer import encoding_digest
    from ferry.inference import EvalConfig, HeldOutEvaluation
    from ferry.inference.scoring import score_with

    if not paths:
        return {}, {}
    model = loaded.model
    if loaded.tokenizer is None:
        raise UserError(
            f"eval: no tokenizer found for {request.source}; pass --tokenizer (the one its data was prepared with)"
        )
    run = loaded.run_config
    recorded = run.get("eval") or {}
    seq_len = request.seq_len if request.seq_len is not None else (run.get("data") or {}).get("seq_len")
    if seq_len is None:
        raise UserError(f"eval: {request.source} records no data.seq_len; pass --seq-len")
    if not 1 <= seq_len <= model.config.max_seq_len:
        raise UserError(f"--seq-len {seq_len}: choose 1 to model.max_seq_len ({model.config.max_seq_len})")
    batches = request.batches if request.batches is not None else recorded.get("batches", 4)
    batch_size = (
        request.batch_size
        if request.batch_size is not None
        else (recorded.get("batch_size") or (run.get("train") or {}).get("global_batch") or 16)
    )
    config = validate_named(
        EvalConfig,
        {
            "sources": ("--data", [{"name": path, "path": path} for path in paths]),
            "batches": ("--batches", batches),
            "batch_size": ("--batch-size", batch_size),
        },
    )
    micro_batch = request.micro_batch if request.micro_batch is not None else batch_size
    if micro_batch < 1 or batch_size % micro_batch:
        raise UserError(f"--micro-batch {micro_batch} must divide --batch-size {batch_size}")
    if request.document_masking == "run":
        masking = (run.get("data") or {}).get("document_masking", False)
    else:
        masking = request.document_masking == "on"
    evaluation = HeldOutEvaluation(
        config,
        seq_len,
        batch_size,
        micro_batch,
        document_eos=loaded.tokenizer.eos_id if masking else None,
        labels=[f"--data {path}" for path in paths],
        count_names=f"--batches {batches} x --batch-size {batch_size}",
        seq_len_name="--seq-len" if request.seq_len is not None else "--seq-len (the run's data.seq_len)",
        loss_chunk=(run.get("train") or {}).get("loss_chunk", 0),
    )
    evaluation.check_tokenizer(
        encoding_digest(loaded.tokenizer), model.config.vocab_size, f"the model's tokenizer ({loaded.tokenizer_path})"
    )
    forwards = sum(-(-len(source.windows) // micro_batch) for source in evaluation.sources)
    with WorkProgress("eval", forwards, say=say, unit="forwards") as progress:
        losses = evaluation.run(score_with(model), next(model.parameters()).device, progress=progress.advance)
    figures = {
        name: {"kind": "tokens", "loss": r.loss, "perplexity": r.perplexity, "tokens": r.tokens}
        for name, r in losses.items()
    }
    return figures, {"seq_len": seq_len, "batches": batches, "batch_size": batch_size}

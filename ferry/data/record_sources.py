"""Preference pairs and RL prompts read from rows (JSON lines, plain or compressed, Parquet, Arrow; or an
embedded task) and written as record datasets.

A preference row: `{"prompt": ..., "chosen": ..., "rejected": ...}`; a prompt row:
`{"prompt": ..., "answer": ...}`. A prompt is plain text (one user message) or a
`messages` list (system and user turns); a completion is text or a one-message list
`[{"role": "assistant", "content": ...}]`. Prompts are rendered with the chat template up
to the assistant header and completions as the assistant's content plus `<|im_end|>`, so
prompt + completion is token for token what SFT trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.chat import ChatEncoder, Message, parse_messages
from ferry.data.chat_template import TemplateChat
from ferry.data.corpus import Document
from ferry.data.formats import Part, read_records
from ferry.data.records import ANSWERS_NAME, RECORD_FIELDS, SPANS_NAME, TOKENS_NAME


def read_record_rows(part: Part, kind: str) -> Iterator[Document]:
    """The rows of `kind` in a part of an input file, each a document whose text is the row's JSON."""
    for line, row, record in read_records(part, list(_required(kind)), kind):
        yield Document(str(part.path), json.dumps(record), line=line, row=row)


def write_records(documents: Iterator[Document], kind: str, encoder: ChatEncoder | TemplateChat, staging: Path) -> dict:
    """Encode every row and write the record files into `staging`; the manifest's `records` entry."""
    fields = RECORD_FIELDS[kind]
    pieces: list[np.ndarray] = []
    spans: list[list[list[int]]] = []
    answers: list[str] = []
    offset = 0
    for document in documents:
        where = document.where
        row = json.loads(document.text)
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object with {', '.join(_required(kind))}")
        missing = [name for name in _required(kind) if name not in row]
        if missing:
            raise UserError(f"{where}: the row lacks {', '.join(repr(name) for name in missing)}")
        prompt = _prompt_messages(row["prompt"], where)
        encoded = [encoder.prompt(prompt)]
        encoded += [_completion(encoder, prompt, row[name], where, name) for name in fields[1:]]
        spans.append([])
        for ids in encoded:
            spans[-1].append([offset, offset + len(ids)])
            pieces.append(ids)
            offset += len(ids)
        if kind == "prompts":
            answers.append(_answer(row["answer"], where))
    if not spans:
        raise UserError(f"no {kind} rows to prepare")
    dtype = np.uint16 if encoder.tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    np.save(staging / TOKENS_NAME, np.concatenate(pieces).astype(dtype))
    np.save(staging / SPANS_NAME, np.asarray(spans, dtype=np.int64))
    files = [TOKENS_NAME, SPANS_NAME]
    if kind == "prompts":
        (staging / ANSWERS_NAME).write_text(json.dumps(answers), encoding="utf-8")
        files.append(ANSWERS_NAME)
    return {"kind": kind, "fields": list(fields), "count": len(spans), "files": files, "tokens": offset}


def _required(kind: str) -> tuple[str, ...]:
    return RECORD_FIELDS[kind] + (("answer",) if kind == "prompts" else ())


def _prompt_messages(value: object, where: str) -> list[Message]:
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: 'prompt' is empty")
        return [Message("user", value)]
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: 'prompt' must be text or a non-empty list of messages")
    # parse_messages wants an assistant turn to train; a prompt ends where the assistant would begin
    messages = parse_messages([*value, {"role": "assistant", "content": ""}], where)[:-1]
    if messages[-1].role != "user":
        raise UserError(f"{where}: the prompt's last message must be the user's, not {messages[-1].role!r}")
    return messages


def _completion(
    encoder: ChatEncoder | TemplateChat, prompt: list[Message], value: object, where: str, name: str
) -> np.ndarray:
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
            raise UserError(f"{where}: {name!r} must be text or one assistant message")
        value = value[0].get("content")
    if not isinstance(value, str):
        raise UserError(f"{where}: {name!r} must be text or one assistant message, not {type(value).__name__}")
    if not value.strip():
        raise UserError(f"{where}: {name!r} is empty: a completion needs text")
    return encoder.completion(prompt, value)


def _answer(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise UserError(f"{where}: 'answer' must be a non-empty string or a number")
    return str(value).strip()

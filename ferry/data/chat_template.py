"""Conversations rendered with a model's own chat template (Jinja, as transformers renders it), and the tokens the
fine-tuning loss trains.

An imported model is prompted, at inference, with the template its tokenizer ships (`chat_template.jinja`, or the
`chat_template` of an older directory's `tokenizer_config.json`), so it is fine-tuned on exactly that text. The
template is rendered with jinja2 in the sandbox, with the settings, filters and globals transformers'
`apply_chat_template` uses (`trim_blocks`, `lstrip_blocks`, loop controls, `tojson`, `raise_exception`,
`strftime_now`), and the text is tokenised whole, the template's special tokens mapped to their ids.

Which characters are the assistant's to learn:

- **`{% generation %}` marks**, where the template has them: what each marks is trained.
- **Otherwise, derived by rendering**: for each assistant turn, the conversation before it with the generation
  prompt (`add_generation_prompt`) must be a prefix of the whole rendering (else the template rewrites earlier
  text by what follows, and is refused, naming the turn); the turn's characters start there and end where the
  conversation up to and including the turn stops agreeing with the whole rendering. So a template that closes
  the last turn otherwise than earlier ones (GPT-OSS's harmony format: `<|return|>` last, `<|end|>` before) trains
  the last turn's closing token and not the earlier ones', which the model never writes at inference.

A token is trained when any of its characters is. Text in a message that spells a special token becomes that
token, as in transformers (ferry's own ChatML encoding keeps such text as text).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path

import numpy as np
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ferry.config.errors import UserError
from ferry.data.chat import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_JINJA,
    ChatEncoder,
    Message,
    RenderedConversation,
    with_chat_tokens,
)
from ferry.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer

TEMPLATE_FILE = "chat_template.jinja"
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around what a {% generation %} block renders
_ANSWER = "\ue002"  # a private-use character standing for an answer's content


class _GenerationMarks(Extension):
    """`{% generation %}...{% endgeneration %}`: its output, between two private-use marks found after rendering."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_marked"), [], [], body).set_lineno(lineno)

    def _marked(self, caller) -> str:
        return _OPEN + caller() + _CLOSE


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def read_chat_template(path: Path) -> str:
    """The template of `path`: a `.jinja` file, a `tokenizer_config.json` (its `chat_template`: text, or the
    `default` of a list of named templates), or a directory holding either."""
    if path.is_dir():
        found = [path / name for name in (TEMPLATE_FILE, "tokenizer_config.json") if (path / name).is_file()]
        if not found:
            raise UserError(f"chat template: {path} holds neither {TEMPLATE_FILE} nor tokenizer_config.json")
        path = found[0]
    if not path.is_file():
        raise UserError(f"chat template {str(path)!r} does not exist")
    if path.suffix != ".json":
        return path.read_text(encoding="utf-8")
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise UserError(f"chat template: {path} is not a JSON object: {exc}") from None
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise UserError(f"chat template: {path} has no chat_template (or no 'default' among its named ones)")
    return template


def template_beside(tokenizer_path: Path | None) -> Path | None:
    """The chat template that goes with a tokenizer file: `chat_template.jinja` in its directory (a dataset's, or
    what `ferry import` wrote), if there is one."""
    if tokenizer_path is None:
        return None
    candidate = Path(tokenizer_path).parent / TEMPLATE_FILE
    return candidate if candidate.is_file() else None


def chosen_template(given: str | None, tokenizer: str) -> Path | None:
    """The Jinja template conversations are rendered with: `given` (`--chat-template`: a file or a directory
    holding one; `chatml` for ferry's own), else the one beside the `tokenizer` file (an imported model's); None
    for ferry's ChatML."""
    if given == CHAT_TEMPLATE:
        return None
    if given is not None:
        path = Path(given)
        if not path.exists():
            raise UserError(f"--chat-template {given!r}: no such file or directory (or chatml)")
        return path
    return template_beside(Path(tokenizer)) if tokenizer not in ("bpe", "byte") else None


def keep_template(encoder: ChatEncoder | TemplateChat, directory: Path) -> str:
    """A model's own template written beside a dataset's tokenizer in `directory`, where training, generation and
    export find it; what the manifest records of it (`template_name`)."""
    if isinstance(encoder, TemplateChat):
        (directory / TEMPLATE_FILE).write_text(encoder.template_text, encoding="utf-8")
    return template_name(encoder)


def chat_encoder(tokenizer: Tokenizer, template: Path | None) -> ChatEncoder | TemplateChat:
    """The model's own template's renderer when `template` is given, else ferry's ChatML (its tokens added to the
    tokenizer where it lacks them), which is also what a ferry export's template (ChatML in Jinja) comes back as."""
    text = None if template is None else read_chat_template(template)
    if text is None or text == CHAT_TEMPLATE_JINJA:  # ferry's own, as its exports write it
        return ChatEncoder(with_chat_tokens(tokenizer))
    if not isinstance(tokenizer, BPETokenizer):
        raise UserError("a chat template renders text for a BPE tokenizer (a tokenizer.json); this one is bytes")
    return TemplateChat(tokenizer, text, str(template))


def template_label(template: Path | None) -> str:
    """What a dataset's settings record of the template at `template` (None: ChatML), as `template_name` would."""
    text = None if template is None else read_chat_template(template)
    return CHAT_TEMPLATE if text is None or text == CHAT_TEMPLATE_JINJA else jinja_name(text)


def chat_of(tokenizer_path: Path) -> ChatEncoder | TemplateChat:
    """How the conversations of the tokenizer at `tokenizer_path` (a dataset's, an import's) are rendered: its own
    template (the one beside it), else ChatML, whose tokens it must hold (a tokenizer without them is refused)."""
    tokenizer = load_tokenizer(tokenizer_path)
    template = template_beside(tokenizer_path)
    if template is not None and template_label(template) != CHAT_TEMPLATE:
        return chat_encoder(tokenizer, template)
    return ChatEncoder(tokenizer)


def template_name(encoder: ChatEncoder | TemplateChat) -> str:
    """What a manifest records of the template: `chatml`, or `jinja_name` of the model's own."""
    return CHAT_TEMPLATE if isinstance(encoder, ChatEncoder) else jinja_name(encoder.template_text)


def jinja_name(template: str) -> str:
    """`jinja:` and the sha256 of a template's text."""
    return f"jinja:{hashlib.sha256(template.encode('utf-8')).hexdigest()}"


class TemplateChat:
    """Renders conversations with a Jinja chat template into one tokenizer's ids and trained flags; what
    `ChatEncoder` does for ferry's ChatML, for a model's own template."""

    def __init__(self, tokenizer: BPETokenizer, template: str, origin: str):
        self.tokenizer = tokenizer
        self.origin = origin
        self.template_text = template
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationMarks, "jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            self._template = environment.from_string(template)
        except TemplateError as exc:
            raise UserError(f"chat template {origin}: {exc}") from None
        self.marked = _OPEN in self._render([Message("user", "?"), Message("assistant", "!")], False)
        special = HFTokenizer.from_str(tokenizer.to_json())
        special.encode_special_tokens = False  # the template's own special tokens are written as text
        self._encoder = special

    def render_many(self, conversations: Sequence[list[Message]]) -> list[RenderedConversation]:
        return [self._rendered(messages) for messages in conversations]

    def prompt(self, messages: list[Message]) -> np.ndarray:
        """The ids that ask the model for the next assistant message."""
        text = self._render(messages, True).replace(_OPEN, "").replace(_CLOSE, "")
        return np.asarray(self._encoder.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def completion(self, messages: list[Message], answer: str) -> np.ndarray:
        """The ids the model writes for `answer` as the assistant's turn after `messages`, through its last trained
        token (a preference pair's side, a GRPO answer): `prompt(messages)` followed by them is, token for token,
        what SFT trains on."""
        prompt = self.prompt(messages)
        rendered = self._rendered([*messages, Message("assistant", answer)])
        if not np.array_equal(rendered.ids[: len(prompt)], prompt) or not rendered.trained[len(prompt) :].any():
            raise UserError(
                f"chat template {self.origin}: the prompt with the generation prompt is not where the answer's "
                "rendering begins, so the answer's tokens cannot be cut from it"
            )
        last = len(prompt) + int(np.flatnonzero(rendered.trained[len(prompt) :])[-1])
        return rendered.ids[len(prompt) : last + 1]

    def answer_text(self, ids: list[int]) -> str:
        """The answer in a completion the model wrote after `prompt`: what stands where the template puts an
        answer's content (GPT-OSS: after the last `<|channel|>final<|message|>`, before `<|return|>`)."""
        text = self._encoder.decode(list(ids), skip_special_tokens=False)
        lead, trail = self._answer_frame
        if lead and lead in text:
            text = text[text.rindex(lead) + len(lead) :]
        return text.split(trail)[0] if trail else text

    @cached_property
    def _answer_frame(self) -> tuple[str, str]:
        """The trained text of an answer before and after its content (`<|channel|>final<|message|>`, `<|return|>`),
        found by rendering a one-character answer."""
        text, spans = self._spans([Message("user", "?"), Message("assistant", _ANSWER)])
        start, stop = spans[-1]
        lead, _, trail = text[start:stop].partition(_ANSWER)
        return lead, trail

    @cached_property
    def end_ids(self) -> list[int]:
        """The token a trained answer ends with (`<|im_end|>`, `<|return|>`): where generation stops."""
        rendered = self._rendered([Message("user", "?"), Message("assistant", "!")])
        return [int(rendered.ids[np.flatnonzero(rendered.trained)[-1]])]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        payload = [
            {"role": message.role, "content": message.content}
            | ({"thinking": message.thinking} if message.thinking else {})
            for message in messages
        ]
        try:
            return self._template.render(
                messages=payload,
                add_generation_prompt=add_generation_prompt,
                bos_token="",
                eos_token=self.tokenizer.decode([self.tokenizer.eos_id]),
            )
        except TemplateError as exc:
            raise UserError(f"chat template {self.origin}: {exc}") from None

    def _spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The whole rendering and the character spans the loss trains."""
        whole = self._render(messages, False)
        if self.marked:
            return _unmarked(whole)
        encoding = self._encoder.encode(whole, add_special_tokens=False)
        spans = []
        for turn, message in enumerate(messages):
            if message.role != "assistant":
                continue
            before = self._render(messages[:turn], True)
            if not whole.startswith(before):
                raise UserError(
                    f"chat template {self.origin}: the conversation before assistant turn {turn} renders otherwise "
                    "on its own than within the whole conversation, so the turn's tokens cannot be found; a template "
                    "with {% generation %} marks says them itself"
                )
            end = max(self._agreeing(encoding, whole, alone) for alone in self._alone(messages, turn))
            spans.append((len(before), end))
        return whole, spans

    def _agreeing(self, encoding, whole: str, alone: str) -> int:
        """Where the whole rendering's tokens (`encoding` of `whole`) stop agreeing with `alone`'s: by token, so
        that two closing tokens spelled alike at first (`<|return|>`, `<|end|>`) are told apart whole."""
        ids = self._encoder.encode(alone, add_special_tokens=False).ids
        for index, (ours, theirs) in enumerate(zip(encoding.ids, ids)):
            if ours != theirs:
                return encoding.offsets[index][0]
        shorter = min(len(encoding.ids), len(ids))
        return len(whole) if shorter == len(encoding.ids) else encoding.offsets[shorter][0]

    def _alone(self, messages: list[Message], turn: int) -> list[str]:
        """The conversation through assistant turn `turn` rendered on its own, with the turn's thinking and
        without: a template may show only the last turn's thinking (GPT-OSS drops earlier turns' analysis)."""
        through = messages[: turn + 1]
        renderings = [self._render(through, False)]
        if messages[turn].thinking is not None:
            thoughtless = Message("assistant", messages[turn].content)
            renderings.append(self._render([*messages[:turn], thoughtless], False))
        return renderings

    def _rendered(self, messages: list[Message]) -> RenderedConversation:
        text, spans = self._spans(messages)
        encoding = self._encoder.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        for index, (start, stop) in enumerate(encoding.offsets):
            end = max(stop, start + 1)  # a token of no characters (an added token's) still has its place
            trained[index] = any(start < span_stop and span_start < end for span_start, span_stop in spans)
        return RenderedConversation(ids, trained)


def _unmarked(text: str) -> tuple[str, list[tuple[int, int]]]:
    """`text` without the generation marks, and the spans they enclosed."""
    plain: list[str] = []
    spans: list[tuple[int, int]] = []
    length = opened = 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", text):
        if piece == _OPEN:
            opened = length
        elif piece == _CLOSE:
            spans.append((opened, length))
        else:
            plain.append(piece)
            length += len(piece)
    return "".join(plain), spans

"""The chat template ferry ships, and conversations turned into tokens with a loss mask.

The template is the ChatML layout (the one Qwen's tokenizers and many open models use),
so a model fine-tuned here is prompted the way inference servers already prompt them:

    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n

`<|im_start|>` and `<|im_end|>` are special tokens: a tokenizer without them gets them
appended to its vocabulary (the next free ids), and text that spells them is encoded as
text (`BPETokenizer` never maps text to a special token), so a message cannot forge a
turn. Only
what the model must learn to write is trained: the content of each assistant message
and the `<|im_end|>` that closes it. Headers, system and user messages and the newline
between messages are context. Each piece is encoded on its own, so the mask follows the
template exactly rather than wherever a merge happened to fall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ferry.config.errors import UserError
from ferry.data.tokenizer import BPETokenizer, Tokenizer

CHAT_TEMPLATE = "chatml"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
ROLES = ("system", "user", "assistant")
# The same template in the Jinja form transformers' `apply_chat_template` reads (written by `ferry export`).
CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Message:
    """One turn: `role` is system, user or assistant; an assistant's `thinking` (its reasoning before the answer)
    is rendered where a model's own template has a place for it (GPT-OSS's analysis channel)."""

    role: str
    content: str
    thinking: str | None = None


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation's token ids and, per token, whether it is a trained target."""

    ids: np.ndarray
    trained: np.ndarray


def parse_messages(value: object, where: str) -> list[Message]:
    """The `messages` of one conversation, checked: roles known, a system message only first, at least
    one assistant message (a conversation with nothing to learn trains nothing). `where` names it."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    messages = []
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise UserError(f"{where}: message {index} needs a string 'content'")
        role = item.get("role")
        if role not in ROLES:
            raise UserError(f"{where}: message {index} has role {role!r}; roles are {', '.join(ROLES)}")
        if role == "system" and index > 0:
            raise UserError(f"{where}: message {index} is a system message; only the first message may be one")
        thinking = item.get("thinking")
        if thinking is not None and (role != "assistant" or not isinstance(thinking, str)):
            raise UserError(f"{where}: message {index} has 'thinking'; only an assistant message may, as text")
        messages.append(Message(role, item["content"], thinking or None))
    if not any(message.role == "assistant" for message in messages):
        raise UserError(f"{where}: the conversation has no assistant message, so nothing in it would be trained")
    return messages


def with_chat_tokens(tokenizer: Tokenizer) -> BPETokenizer:
    """`tokenizer` with the template's special tokens (those it lacks are appended to its vocabulary)."""
    if not isinstance(tokenizer, BPETokenizer):
        raise UserError("chat data needs a BPE tokenizer (a tokenizer.json); the byte tokenizer has no special tokens")
    return tokenizer.with_special_tokens(CHAT_TOKENS)


class ChatEncoder:
    """Renders conversations with the template in one tokenizer that holds the chat tokens."""

    def __init__(self, tokenizer: Tokenizer):
        if not isinstance(tokenizer, BPETokenizer):
            raise UserError("the chat template needs a BPE tokenizer holding the chat tokens; this one is bytes")
        self.tokenizer = tokenizer
        ids = [tokenizer.token_id(token) for token in CHAT_TOKENS]
        if None in ids:
            raise UserError(f"the tokenizer lacks the chat tokens {', '.join(CHAT_TOKENS)}")
        self.im_start_id, self.im_end_id = ids

    def render_many(self, conversations: Sequence[list[Message]]) -> list[RenderedConversation]:
        """Every conversation's ids and trained flags; the pieces of all of them are encoded in one batch."""
        pieces: list[str] = []
        for messages in conversations:
            for message in messages:
                if message.thinking is not None:
                    raise UserError(
                        "ChatML has no place for an assistant's 'thinking': prepare with the model's own template "
                        "(--chat-template), or leave 'thinking' out"
                    )
                pieces.extend((f"{message.role}\n", message.content, "\n"))
        encoded = iter(self.tokenizer.encode_batch(pieces))
        rendered = []
        for messages in conversations:
            ids: list[np.ndarray] = []
            trained: list[np.ndarray] = []
            for message in messages:
                header, content, newline = next(encoded), next(encoded), next(encoded)
                learn = message.role == "assistant"
                ids += [np.asarray([self.im_start_id]), header, content, np.asarray([self.im_end_id]), newline]
                trained += [
                    np.zeros(1 + len(header), dtype=bool),
                    np.full(len(content) + 1, learn),
                    np.zeros(len(newline), dtype=bool),
                ]
            rendered.append(RenderedConversation(np.concatenate(ids), np.concatenate(trained)))
        return rendered

    def completion(self, messages: list[Message], answer: str) -> np.ndarray:
        """The ids the model writes for `answer` after `prompt(messages)`: the content and `<|im_end|>`."""
        return np.concatenate([self.tokenizer.encode(answer), [self.im_end_id]]).astype(np.int64)

    @property
    def end_ids(self) -> list[int]:
        """Where a chat answer ends: `<|im_end|>`."""
        return [self.im_end_id]

    def answer_text(self, ids: list[int]) -> str:
        """The answer in a completion the model wrote after `prompt`: its text without the `<|im_end|>` that
        ended it."""
        return self.tokenizer.decode([token for token in ids if token != self.im_end_id])

    def prompt(self, messages: list[Message]) -> np.ndarray:
        """The ids that ask the model for the next assistant message: the conversation so far, then the
        assistant header. Generation stops at `im_end_id`."""
        context = self.render_many([messages])[0].ids if messages else np.zeros(0, dtype=np.int64)
        header = self.tokenizer.encode("assistant\n")
        return np.concatenate([context, [self.im_start_id], header]).astype(np.int64)

"""Conversations to fine-tune on: rows with `messages` (JSON lines, plain or compressed, Parquet, Arrow),
or the embedded `stdlib-chat` set.

`stdlib-chat` is made offline from the standard library's own sources (read with `ast`,
nothing imported): for each public function, class and method with a docstring, a user
asks what it does and the assistant answers with the docstring's first paragraph; for
functions a second turn asks for the signature. Phrasings and the presence of a system
message vary with a hash of the name, so the set is the same on every run of one Python
version (the dataset manifest records its sha256, as for the `stdlib` corpus).
"""

from __future__ import annotations

import ast
import inspect
import json
import zlib
from collections.abc import Iterator

from ferry.config.errors import UserError
from ferry.data.corpus import Document, position, stdlib_sources, within_budget
from ferry.data.formats import Part, read_records

EMBEDDED_CONVERSATIONS = ("stdlib-chat",)
_SYSTEM = "You answer questions about Python's standard library in a sentence or two."
_ASK_FUNCTION = ("What does `{name}` do?", "Explain `{name}` briefly.", "What is `{name}` for?")
_ASK_CLASS = ("What is `{name}`?", "Explain the class `{name}`.", "What is `{name}` used for?")
_ASK_SIGNATURE = ("What is its signature?", "How do I call it?")
_LONGEST_ANSWER = 400


def embedded_conversations(name: str, max_bytes: int, skip_bytes: int = 0) -> Iterator[Document]:
    """The named embedded conversation set, each conversation a document whose text is its messages
    as JSON; `max_bytes` and `skip_bytes` count that text, as for the embedded corpus."""
    if name not in EMBEDDED_CONVERSATIONS:
        raise UserError(f"unknown embedded conversation set {name!r}; available: {', '.join(EMBEDDED_CONVERSATIONS)}")
    return within_budget(_stdlib_conversations(), max_bytes, skip_bytes)


def read_conversations(part: Part) -> Iterator[Document]:
    """The conversations of a part of an input file, one object (row) with a `messages` list each."""
    for line, row, record in read_records(part, ["messages"], "conversation"):
        if not isinstance(record, dict) or "messages" not in record:
            raise UserError(f"{position(str(part.path), line, row)}: expected an object with a 'messages' list")
        yield Document(str(part.path), json.dumps(record["messages"]), line=line, row=row)


def _stdlib_conversations() -> Iterator[Document]:
    found = False
    for relative, text in stdlib_sources():
        module = _module_name(relative)
        if module is None:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for qualified, node in _documented(tree, module):
            found = True
            messages = _conversation(qualified, node)
            yield Document(f"embedded:stdlib-chat/{relative}", json.dumps(messages))
    if not found:
        raise UserError("the embedded conversation set 'stdlib-chat' found no documented definitions")


def _module_name(relative: str) -> str | None:
    """`json/decoder.py` -> `json.decoder`, `json/__init__.py` -> `json`; None for private modules."""
    parts = relative.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(part.startswith("_") for part in parts):
        return None
    return ".".join(parts)


def _documented(tree: ast.Module, module: str) -> Iterator[tuple[str, ast.FunctionDef | ast.ClassDef]]:
    """Public top-level functions and classes with a docstring, and the public methods of those classes."""
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if _answer(node):
            yield f"{module}.{node.name}", node
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and not member.name.startswith("_") and _answer(member):
                    yield f"{module}.{node.name}.{member.name}", member


def _answer(node: ast.FunctionDef | ast.ClassDef) -> str | None:
    """The docstring's first paragraph on one line, if it says something and is short enough to answer with."""
    docstring = ast.get_docstring(node)
    if not docstring:
        return None
    paragraph = " ".join(inspect.cleandoc(docstring).split("\n\n")[0].split())
    return paragraph if 12 <= len(paragraph) <= _LONGEST_ANSWER else None


def _conversation(qualified: str, node: ast.FunctionDef | ast.ClassDef) -> list[dict[str, str]]:
    choice = zlib.crc32(qualified.encode("utf-8"))
    is_class = isinstance(node, ast.ClassDef)
    asks = _ASK_CLASS if is_class else _ASK_FUNCTION
    messages = [{"role": "system", "content": _SYSTEM}] if choice % 3 == 0 else []
    messages += [
        {"role": "user", "content": asks[choice % len(asks)].format(name=qualified)},
        {"role": "assistant", "content": _answer(node)},
    ]
    if not is_class and choice % 2 == 0:
        signature = f"`{node.name}({ast.unparse(node.args)})`"
        messages += [
            {"role": "user", "content": _ASK_SIGNATURE[(choice >> 4) % len(_ASK_SIGNATURE)]},
            {"role": "assistant", "content": signature},
        ]
    return messages

"""The embedded corpus: text every Python installation carries, so training needs no network.

`stdlib` is the standard library's own documentation (the pydoc topic pages) followed
by its module sources in sorted order, up to a byte budget. Its content depends on
the Python version; the dataset manifest records the sha256 of every piece.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ferry.config.errors import UserError

EMBEDDED_CORPORA = ("stdlib",)
_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


@dataclass(frozen=True)
class Document:
    """One unit of text and where it came from: a file (and line, for JSONL) or an `embedded:` name."""

    source: str
    text: str
    line: int | None = None


def embedded_documents(name: str, max_bytes: int, skip_bytes: int = 0) -> Iterator[Document]:
    """Documents of the named embedded corpus, stopping once `max_bytes` of text were produced.

    With `skip_bytes`, the documents a budget of `skip_bytes` would produce are passed over
    first: a held-out set that shares no document with a dataset prepared with that budget.
    """
    if name not in EMBEDDED_CORPORA:
        raise UserError(f"unknown embedded corpus {name!r}; available: {', '.join(EMBEDDED_CORPORA)}")
    skipped = produced = 0
    for document in _stdlib_documents():
        size = len(document.text.encode("utf-8"))
        if skipped < skip_bytes:
            skipped += size
            continue
        if produced >= max_bytes:
            return
        produced += size
        yield document


def _stdlib_documents() -> Iterator[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for topic in sorted(topics):
        yield Document(f"embedded:stdlib/pydoc/{topic}", topics[topic])
    root = Path(sysconfig.get_paths()["stdlib"])
    found = bool(topics)
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(relative.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found = True
        yield Document(f"embedded:stdlib/{relative.as_posix()}", text)
    if not found:
        raise UserError(f"the embedded corpus 'stdlib' found no text under {root}")

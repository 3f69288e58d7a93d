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
    """One unit of text and where it came from: a file (and its line, for JSON lines, or its row,
    counted from 0, for a table) or an `embedded:` name."""

    source: str
    text: str
    line: int | None = None
    row: int | None = None

    @property
    def where(self) -> str:
        """`file:line`, `file row N` or the source alone: how a message about this document names it."""
        return position(self.source, self.line, self.row)


def position(source: str, line: int | None = None, row: int | None = None) -> str:
    if line is not None:
        return f"{source}:{line}"
    return source if row is None else f"{source} row {row}"


def embedded_documents(name: str, max_bytes: int, skip_bytes: int = 0) -> Iterator[Document]:
    """Documents of the named embedded corpus, stopping once `max_bytes` of text were produced.

    With `skip_bytes`, the documents a budget of `skip_bytes` would produce are passed over
    first: a held-out set that shares no document with a dataset prepared with that budget.
    """
    if name not in EMBEDDED_CORPORA:
        raise UserError(f"unknown embedded corpus {name!r}; available: {', '.join(EMBEDDED_CORPORA)}")
    return within_budget(_stdlib_documents(), max_bytes, skip_bytes)


def within_budget(documents: Iterator[Document], max_bytes: int, skip_bytes: int) -> Iterator[Document]:
    """The documents after the first `skip_bytes` of text, until `max_bytes` of text were produced."""
    skipped = produced = 0
    for document in documents:
        size = len(document.text.encode("utf-8"))
        if skipped < skip_bytes:
            skipped += size
            continue
        if produced >= max_bytes:
            return
        produced += size
        yield document


def stdlib_sources() -> Iterator[tuple[str, str]]:
    """(path relative to the standard library, text) of its module sources in sorted order, tests,
    IDLE and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(relative.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield relative.as_posix(), text


def _stdlib_documents() -> Iterator[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for topic in sorted(topics):
        yield Document(f"embedded:stdlib/pydoc/{topic}", topics[topic])
    found = bool(topics)
    for relative, text in stdlib_sources():
        found = True
        yield Document(f"embedded:stdlib/{relative}", text)
    if not found:
        raise UserError(f"the embedded corpus 'stdlib' found no text under {sysconfig.get_paths()['stdlib']}")

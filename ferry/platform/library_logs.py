"""Other libraries' log records kept off ferry's console: a library a feature stands on (MLflow creating its
tables, Ray warning of its token authentication) logs through Python's `logging`, to its own console handler or, with
none, to the last-resort one; between ferry's step lines these say nothing the user acts on, yet they are kept, in a
file beside the run's records, for when a library misbehaves."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LIBRARY_LOG_FILE = "libraries.log"


@contextmanager
def library_logs_in(path: Path, loggers: tuple[str, ...], unhandled: bool = False) -> Iterator[None]:
    """Inside, the records of the named loggers (and their children) go to `path`, appended, and not to the console;
    after, the loggers are as they were. The levels are the libraries' own. With `unhandled`, so do the warnings of
    any logger left with no handler at all, which Python would print through its last-resort handler: Ray's
    `ray.init(configure_logging=False)` clears its logger's handlers, leaving them to the application, before it
    warns."""
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    last_resort = logging.lastResort
    if unhandled:
        logging.lastResort = handler
    saved = []
    for name in loggers:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [handler]
        logger.propagate = False
    try:
        yield
    finally:
        logging.lastResort = last_resort
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate
        handler.close()

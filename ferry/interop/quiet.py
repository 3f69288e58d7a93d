"""transformers without its progress bars: ferry says in one line what an export or an import did, and a bar
per shard written or read between ferry's lines (six of them in a release) says nothing the line does not; and
without its load report where ferry reads what the report calls unexpected."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' (and the Hub library's) progress bars off inside, as they were after."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging

    shown, hub_shown = logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()
        (enable_progress_bars if hub_shown else disable_progress_bars)()


@contextmanager
def quiet_loading(quiet: bool) -> Iterator[None]:
    """transformers' warnings (its load report among them) off inside when `quiet`: for an import that reads
    itself what transformers' model leaves out (DeepSeek-V3's MTP layers, which its report lists as unexpected)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    if quiet:
        logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)

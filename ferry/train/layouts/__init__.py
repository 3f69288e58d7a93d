"""Layouts as kinds: each way of placing a model over ranks is one file (expert-resident, FSDP, ZeRO-1, pipeline,
context parallel) answering its refusals, memory terms, collectives, step context, figures and console lines
(`base.py`); a run composes the kinds its config turns on (`run_layout.py`), and what composes is answered in one
place (`composition.py`)."""

from ferry.train.layouts.base import LayoutKind, MemoryTerms, RankShare, Traffic
from ferry.train.layouts.composition import config_refusals, job_refusals
from ferry.train.layouts.run_layout import LAYOUT_KINDS, RunLayout

__all__ = [
    "LAYOUT_KINDS",
    "LayoutKind",
    "MemoryTerms",
    "RankShare",
    "RunLayout",
    "Traffic",
    "config_refusals",
    "job_refusals",
]

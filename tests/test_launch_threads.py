"""Ranks that share a node get one thread each unless the user chose a count; an empty OMP_NUM_THREADS is no
choice (libgomp rejects it and takes every core), so it counts as unset."""

from __future__ import annotations

import os

import pytest

from ferry.launch.local import _one_thread_per_rank


@pytest.mark.parametrize("given", [None, "", "  "])
def test_unset_or_empty_omp_num_threads_gives_each_rank_one_thread(given, monkeypatch):
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    with _one_thread_per_rank(2):
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ.get("OMP_NUM_THREADS") == given


def test_a_chosen_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with _one_thread_per_rank(2):
        assert os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with _one_thread_per_rank(1):
        assert "OMP_NUM_THREADS" not in os.environ

"""The tensor forms of reduce-scatter and all-gather under the names the installed torch keeps: torch 2.13 renamed
them (`reduce_scatter_single`, `all_gather_single`) and warns, once per call and rank, on the old names, which
torch 2.11 alone has. Both forms give the same results; the current one warns nothing."""

from __future__ import annotations

from types import SimpleNamespace

import distributed_cases as cases
import pytest
import torch.distributed as dist

from ferry.comm.collectives import newest_collective
from ferry.comm.spawn import run_on_ranks


def test_the_current_name_is_taken_where_torch_has_it_and_the_former_one_where_it_does_not():
    both = SimpleNamespace(reduce_scatter_single="current", reduce_scatter_tensor="former")
    only_former = SimpleNamespace(reduce_scatter_tensor="former")
    assert newest_collective(both, "reduce_scatter_single", "reduce_scatter_tensor") == "current"
    assert newest_collective(only_former, "reduce_scatter_single", "reduce_scatter_tensor") == "former"


@pytest.mark.skipif(not hasattr(dist, "reduce_scatter_single"), reason="this torch has only the former names")
def test_two_ranks_reduce_scatter_and_gather_alike_under_both_names_and_the_current_ones_warn_nothing():
    current = run_on_ranks(cases.tensor_collectives_without_warnings, 2, False)
    former = run_on_ranks(cases.tensor_collectives_without_warnings, 2, True)
    assert [result[:3] for result in current] == [result[:3] for result in former]
    scattered, gathered, raw, _ = current[1]
    assert scattered == [3.0 * 2, 3.0 * 3] and gathered == [0.0, 0.0, 1.0, 1.0] and raw == [[[0.0] * 3], [[1.0] * 3]]
    assert all(result[3] == [] for result in current), [result[3] for result in current]
    assert any("deprecated" in message for result in former for message in result[3]), "the former names warn"

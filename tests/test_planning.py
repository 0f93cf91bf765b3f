"""plan_chunks and plan_expert_groups: examples, errors and properties."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.errors import InvalidInputError
from rowcache.planning import plan_chunks, plan_expert_groups


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.int64)


def test_empty_topk_gives_no_chunks_and_no_groups() -> None:
    empty = torch.empty(0, 4, dtype=torch.int64)
    assert plan_chunks(empty, 2) == []
    assert plan_expert_groups(empty, 2) == []


def test_everything_fits_in_one_chunk() -> None:
    assert plan_chunks(ids([0, 1], [1, 2], [2, 0]), 3) == [(0, 3)]


def test_greedy_chunks_example() -> None:
    topk = ids([0, 1], [1, 2], [3, 4], [4, 3], [0, 4])
    # rows 0-1 need {0,1,2}; row 2 would make 5; rows 2-4 need {0,3,4}.
    assert plan_chunks(topk, 3) == [(0, 2), (2, 5)]
    assert plan_chunks(topk, 2) == [(0, 1), (1, 2), (2, 4), (4, 5)]


def test_duplicate_ids_in_a_row_count_once() -> None:
    assert plan_chunks(ids([5, 5], [5, 5], [6, 6]), 1) == [(0, 2), (2, 3)]


def test_row_wider_than_capacity_named() -> None:
    topk = ids([0, 0], [2, 3], [4, 4])
    message = "plan_chunks: token row 1 routes to 2 distinct experts but capacity is 1"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        plan_chunks(topk, 1)


def test_expert_groups_example() -> None:
    topk = ids([7, 1], [3, 1], [0, 9])
    assert plan_expert_groups(topk, 2) == [[0, 1], [3, 7], [9]]
    assert plan_expert_groups(topk, 5) == [[0, 1, 3, 7, 9]]


def test_expert_groups_serve_rows_wider_than_capacity() -> None:
    assert plan_expert_groups(ids([0, 1, 2, 3]), 1) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("capacity", [0, -2, True, 2.0])
@pytest.mark.parametrize("plan", [plan_chunks, plan_expert_groups])
def test_bad_capacity_rejected(capacity: object, plan: object) -> None:
    with pytest.raises(InvalidInputError, match="capacity"):
        plan(ids([0]), capacity)  # type: ignore[operator]


@pytest.mark.parametrize("plan", [plan_chunks, plan_expert_groups])
def test_bad_topk_rejected(plan: object) -> None:
    with pytest.raises(InvalidInputError, match="integer dtype"):
        plan(torch.zeros(2, 2), 2)  # type: ignore[operator]
    with pytest.raises(InvalidInputError, match="rank 2"):
        plan(torch.zeros(2, dtype=torch.int64), 2)  # type: ignore[operator]


# -- properties ----------------------------------------------------------------

NUM_EXPERTS = 12


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    top_k = draw(st.integers(1, 4))
    capacity = draw(st.integers(top_k, NUM_EXPERTS))
    rows = draw(
        st.lists(
            st.lists(st.integers(0, NUM_EXPERTS - 1), min_size=top_k, max_size=top_k),
            max_size=24,
        )
    )
    topk = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), top_k)
    return topk, capacity


def distinct(topk: torch.Tensor, start: int, stop: int) -> int:
    return len(set(topk[start:stop].flatten().tolist()))


@settings(max_examples=200, deadline=None)
@given(routings())
def test_chunks_cover_rows_in_order_fit_and_are_maximal(case: tuple[torch.Tensor, int]) -> None:
    topk, capacity = case
    chunks = plan_chunks(topk, capacity)
    num_rows = topk.shape[0]
    # Cover: contiguous, non-empty, in order, from 0 to the last row.
    bounds = [start for start, _ in chunks] + [num_rows]
    assert bounds[0] == 0 if chunks else num_rows == 0
    for (start, stop), following in zip(chunks, bounds[1:], strict=True):
        assert start < stop == following
    # Fit.
    assert all(distinct(topk, start, stop) <= capacity for start, stop in chunks)
    # Greedy maximal: one more row would not fit.
    assert all(distinct(topk, start, stop + 1) > capacity for start, stop in chunks[:-1])


@settings(max_examples=100, deadline=None)
@given(routings())
def test_row_wider_than_capacity_always_rejected(case: tuple[torch.Tensor, int]) -> None:
    topk, _ = case
    if topk.shape[0] == 0:
        return
    widest = max(len(set(row)) for row in topk.tolist())
    if widest > 1:
        with pytest.raises(InvalidInputError, match="distinct experts but capacity is"):
            plan_chunks(topk, widest - 1)


@settings(max_examples=200, deadline=None)
@given(routings())
def test_groups_partition_sorted_experts(case: tuple[torch.Tensor, int]) -> None:
    topk, capacity = case
    groups = plan_expert_groups(topk, capacity)
    flat = [e for group in groups for e in group]
    assert flat == sorted(set(topk.flatten().tolist()))
    assert all(len(group) == capacity for group in groups[:-1])
    assert all(0 < len(group) <= capacity for group in groups)

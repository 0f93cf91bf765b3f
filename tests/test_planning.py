"""plan_chunks and plan_expert_groups: examples, errors and properties."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.errors import InvalidInputError
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.validation import SMALL_ROUTING


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


def test_padding_is_not_counted_by_chunks() -> None:
    topk = ids([0, -1], [-1, -1], [1, -1], [-1, 2])
    assert plan_chunks(topk, 3) == [(0, 4)]
    # One slot: every row fits (padding takes none), and a row of only padding joins its chunk.
    assert plan_chunks(topk, 1) == [(0, 2), (2, 3), (3, 4)]
    assert plan_chunks(ids([-1, -1], [-1, -1], [-1, -1]), 1) == [(0, 3)]


def test_padding_is_not_grouped() -> None:
    assert plan_expert_groups(ids([7, -1], [-1, 1]), 1) == [[1], [7]]
    assert plan_expert_groups(ids([-1, -1], [-1, -1]), 1) == []


def test_planning_counts_other_negative_ids() -> None:
    # Only -1 is padding; planning does not range-check, prepare rejects -2 for every piece.
    with pytest.raises(InvalidInputError, match="token row 0 routes to 2 distinct experts"):
        plan_chunks(ids([-2, 0], [0, 0]), 1)
    assert plan_expert_groups(ids([-2, 0]), 1) == [[-2], [0]]


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
            # -1 is padding
            st.lists(st.integers(-1, NUM_EXPERTS - 1), min_size=top_k, max_size=top_k),
            max_size=24,
        )
    )
    topk = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), top_k)
    return topk, capacity


def experts(rows: object) -> set[int]:
    """The experts of a tensor of ids or of a row (a list), padding (-1) dropped."""
    values = rows.flatten().tolist() if isinstance(rows, torch.Tensor) else rows
    assert isinstance(values, list)
    return set(values) - {-1}


def distinct(topk: torch.Tensor, start: int, stop: int) -> int:
    return len(experts(topk[start:stop]))


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
    widest = max(len(experts(row)) for row in topk.tolist())
    if widest > 1:
        with pytest.raises(InvalidInputError, match="distinct experts but capacity is"):
            plan_chunks(topk, widest - 1)


@settings(max_examples=200, deadline=None)
@given(routings())
def test_groups_partition_sorted_experts(case: tuple[torch.Tensor, int]) -> None:
    topk, capacity = case
    groups = plan_expert_groups(topk, capacity)
    flat = [e for group in groups for e in group]
    assert flat == sorted(experts(topk))
    assert all(len(group) == capacity for group in groups[:-1])
    assert all(0 < len(group) <= capacity for group in groups)


# -- the fast paths agree with the definition -------------------------------------------------


def reference_chunks(rows: list[list[int]], capacity: int) -> list[tuple[int, int]]:
    """The greedy front-to-back cut, written out directly."""
    chunks: list[tuple[int, int]] = []
    start, seen = 0, set[int]()
    for index, row in enumerate(rows):
        if len(seen | experts(row)) > capacity:
            chunks.append((start, index))
            start, seen = index, set()
        seen |= experts(row)
    return [*chunks, (start, len(rows))] if rows else []


@pytest.mark.parametrize("entries", [SMALL_ROUTING - 8, SMALL_ROUTING + 8, 3 * SMALL_ROUTING])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_small_and_large_routings_plan_alike(entries: int, dtype: torch.dtype) -> None:
    # Below SMALL_ROUTING a CPU routing is reduced with a Python set, above it with
    # torch.unique; both must give the plans the definition gives.
    top_k, num = 8, 64
    generator = torch.Generator().manual_seed(entries)
    topk = torch.randint(0, num, (entries // top_k, top_k), generator=generator, dtype=dtype)
    topk[::7, 0] = -1  # padding
    rows = topk.tolist()
    for capacity in (top_k, 20, num):
        assert plan_chunks(topk, capacity) == reference_chunks(rows, capacity)
        distinct = sorted({e for row in rows for e in row} - {-1})
        groups = [distinct[i : i + capacity] for i in range(0, len(distinct), capacity)]
        assert plan_expert_groups(topk, capacity) == groups
    # A non-contiguous view plans as its contiguous copy.
    view = topk.t().contiguous().t()
    assert not view.is_contiguous()
    assert plan_chunks(view, 20) == plan_chunks(topk, 20)
    assert plan_expert_groups(view, 20) == plan_expert_groups(topk, 20)


def test_decode_sized_routing_does_not_call_torch_unique(monkeypatch: pytest.MonkeyPatch) -> None:
    def unique(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.unique called for a decode-sized CPU routing")

    monkeypatch.setattr(torch, "unique", unique)
    topk = ids([0, 1], [1, 2], [3, 4], [4, 3], [0, 4])
    assert plan_chunks(topk, 3) == [(0, 2), (2, 5)]
    assert plan_chunks(topk, 5) == [(0, 5)]
    assert plan_expert_groups(topk, 2) == [[0, 1], [2, 3], [4]]


def test_as_many_slots_as_entries_fits_without_reading_values() -> None:
    # A meta tensor has no values: planning it proves the check reads none (on a GPU it
    # would otherwise copy them to the host).
    topk = torch.empty(2, 4, dtype=torch.int64, device="meta")
    assert plan_chunks(topk, 8) == [(0, 2)]

"""requested_experts: what a prepare request means and which requests are rejected."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.errors import InvalidInputError, RowCacheError
from rowcache.validation import SMALL_ROUTING, check_topk_ids, is_integer_dtype, requested_experts

E = 8


def ids(*rows: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=dtype)


def rejected(match: str) -> pytest.RaisesExc[InvalidInputError]:
    return pytest.raises(InvalidInputError, match=re.escape(match))


def test_distinct_routed_experts_sorted() -> None:
    assert requested_experts(ids([5, 1], [1, 3]), None, E, 4) == [1, 3, 5]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_dtypes_accepted(dtype: torch.dtype) -> None:
    assert requested_experts(ids([2, 0], dtype=dtype), None, E, 4) == [0, 2]


def test_empty_topk_requests_nothing() -> None:
    assert requested_experts(torch.empty(0, 2, dtype=torch.int64), None, E, 1) == []


def test_errors_are_value_errors_and_rowcache_errors() -> None:
    with pytest.raises(ValueError) as info:
        requested_experts(ids([9]), None, E, 4)
    assert isinstance(info.value, RowCacheError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_non_integer_dtype_rejected(dtype: torch.dtype) -> None:
    with rejected(f"prepare: topk_ids must have an integer dtype, got {dtype}"):
        requested_experts(torch.zeros(2, 2, dtype=dtype), None, E, 4)


@pytest.mark.parametrize("shape", [(4,), (1, 2, 2), ()])
def test_wrong_rank_rejected(shape: tuple[int, ...]) -> None:
    with rejected(f"topk_ids must have rank 2 [tokens, k], got rank {len(shape)}"):
        requested_experts(torch.zeros(shape, dtype=torch.int64), None, E, 4)


def test_non_tensor_rejected() -> None:
    with rejected("topk_ids must be a torch.Tensor, got list"):
        requested_experts([[1, 2]], None, E, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-2, -7, E, E + 3])
def test_out_of_range_id_rejected(value: int) -> None:
    with rejected(f"prepare: topk_ids holds expert id {value}, outside [0, {E}) (-1 is padding)"):
        requested_experts(ids([0, value]), None, E, 4)


# -- -1 is padding -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_padding_is_not_an_expert_and_not_counted(dtype: torch.dtype) -> None:
    # Two experts and padding fit two slots: -1 takes none.
    assert requested_experts(ids([5, -1], [-1, 1], dtype=dtype), None, E, 2) == [1, 5]


def test_a_routing_of_only_padding_requests_nothing() -> None:
    assert requested_experts(ids([-1, -1], [-1, -1]), None, E, 1) == []


def test_padding_beside_a_bad_id_does_not_hide_it() -> None:
    with rejected(f"prepare: topk_ids holds expert id -3, outside [0, {E})"):
        requested_experts(ids([-1, -3], [-1, 2]), None, E, 4)


@pytest.mark.parametrize("unique", [[-1, 5, -1], torch.tensor([5, -1]), (-1, 5)])
def test_padding_in_unique_ids_is_dropped(unique: list[int] | torch.Tensor) -> None:
    assert requested_experts(ids([1, 5, -1]), unique, E, 1) == [5]


def test_unique_ids_of_only_padding_requests_nothing() -> None:
    assert requested_experts(ids([1, 5]), [-1, -1], E, 1) == []


@pytest.mark.parametrize("entries", [SMALL_ROUTING - 8, SMALL_ROUTING + 8])
def test_padding_is_dropped_on_both_reductions(entries: int) -> None:
    # Below SMALL_ROUTING a CPU routing is reduced with a Python set, above it with torch.unique.
    topk = torch.arange(entries, dtype=torch.int64).remainder(E).view(-1, 4)
    topk[::3, 1] = -1
    assert requested_experts(topk, None, E, E) == list(range(E))
    topk[topk >= 2] = -1
    assert requested_experts(topk, None, E, 2) == [0, 1]
    topk[0, 0] = -5
    with rejected(f"topk_ids holds expert id -5, outside [0, {E})"):
        requested_experts(topk, None, E, E)


def test_too_many_experts_names_count_and_capacity() -> None:
    with rejected("prepare: 5 unique experts requested but capacity is 4"):
        requested_experts(ids([0, 1, 2, 3, 4]), None, E, 4)


def test_op_names_the_caller() -> None:
    with rejected("custom: 3 unique experts requested but capacity is 2"):
        requested_experts(ids([0, 1, 2]), None, E, 2, op="custom")


def test_device_other_than_cpu_or_provider_rejected() -> None:
    meta = torch.zeros(1, 2, dtype=torch.int64, device="meta")
    with rejected("topk_ids is on meta but the provider is on cpu"):
        requested_experts(meta, None, E, 4, device=torch.device("cpu"))


def test_cpu_topk_accepted_for_any_provider_device() -> None:
    cpu_ids = ids([1])
    assert check_topk_ids(cpu_ids, "prepare", torch.device("cuda:1")) is cpu_ids


# -- unique_ids ----------------------------------------------------------------


@pytest.mark.parametrize(
    "unique", [[3, 1], (1, 3), torch.tensor([3, 1]), torch.tensor([1, 3], dtype=torch.int32)]
)
def test_unique_ids_forms_give_the_exact_set(unique: list[int] | torch.Tensor) -> None:
    assert requested_experts(ids([1, 3], [5, 6]), unique, E, 2) == [1, 3]


def test_unique_ids_may_be_a_group_of_a_wider_routing() -> None:
    # The expert split: topk routes to more experts than capacity, one group at a time.
    topk = ids([0, 1, 2, 3], [4, 5, 6, 7])
    assert requested_experts(topk, [6, 2], E, 2) == [2, 6]


def test_unique_ids_empty_requests_nothing() -> None:
    assert requested_experts(ids([0, 1, 2]), [], E, 1) == []


def test_unique_ids_duplicate_named() -> None:
    with rejected("prepare: unique_ids names expert 3 more than once"):
        requested_experts(ids([1, 3]), [3, 1, 3], E, 4)


@pytest.mark.parametrize("value", [-2, E])
def test_unique_ids_out_of_range_named(value: int) -> None:
    with rejected(f"prepare: unique_ids holds expert id {value}, outside [0, {E}) (-1 is"):
        requested_experts(ids([1]), [1, value], E, 4)


def test_unique_ids_not_routed_rejected() -> None:
    with rejected("prepare: unique_ids names expert 4, which no entry of topk_ids routes to"):
        requested_experts(ids([1, 3]), [1, 4], E, 4)


def test_unique_ids_over_capacity_named() -> None:
    with rejected("prepare: 3 unique experts requested but capacity is 2"):
        requested_experts(ids([0, 1, 2]), [0, 1, 2], E, 2)


def test_topk_checked_in_full_even_with_unique_ids() -> None:
    with rejected(f"prepare: topk_ids holds expert id {E}, outside [0, {E})"):
        requested_experts(ids([1, E]), [1], E, 4)


@pytest.mark.parametrize(
    ("unique", "message"),
    [
        (torch.tensor([1.0]), "unique_ids must have an integer dtype, got torch.float32"),
        (torch.tensor([[1]]), "unique_ids must have rank 1, got rank 2"),
        ([[1]], "unique_ids must be a flat sequence of ints, found [1] (list)"),
        ([1, True], "unique_ids must be a flat sequence of ints, found True (bool)"),
        ([1.0], "unique_ids must be a flat sequence of ints, found 1.0 (float)"),
        ("1", "unique_ids must be an integer tensor or a sequence of ints, got str"),
        ({1}, "unique_ids must be an integer tensor or a sequence of ints, got set"),
    ],
)
def test_unique_ids_malformed_rejected(unique: object, message: str) -> None:
    with rejected(message):
        requested_experts(ids([1]), unique, E, 4)  # type: ignore[arg-type]


def test_is_integer_dtype() -> None:
    assert is_integer_dtype(torch.int32)
    assert not is_integer_dtype(torch.bool)
    assert not is_integer_dtype(torch.float16)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(-1, E - 1), min_size=1, max_size=3), min_size=1, max_size=6
    ).filter(lambda r: len({len(x) for x in r}) == 1),
    capacity=st.integers(1, E),
)
def test_matches_set_semantics(rows: list[list[int]], capacity: int) -> None:
    expected = sorted({e for row in rows for e in row} - {-1})  # -1 is padding
    topk = torch.tensor(rows)
    if len(expected) <= capacity:
        assert requested_experts(topk, None, E, capacity) == expected
        assert requested_experts(topk, expected[::-1], E, capacity) == expected
        assert requested_experts(topk, [-1, *expected, -1], E, capacity) == expected
    else:
        with pytest.raises(InvalidInputError, match="unique experts requested"):
            requested_experts(topk, None, E, capacity)

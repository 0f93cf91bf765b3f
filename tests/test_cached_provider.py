"""CachedWeightProvider, what only it does: LFRU eviction (examples and an independent model),
a stats dict without ownership counters, invalidate clearing the exposed map entry.

The contract it shares with every provider (slot contents, padding, stats, bad input, source
ownership, the thread guard) is ``tests/test_provider_contract.py``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_provider_contract import assert_serves, ids, sources

from rowcache.cached import CachedWeightProvider
from rowcache.errors import InvalidInputError
from rowcache.vllm import expert_cache_counter_problems

E = 8
CPU = torch.device("cpu")
STATS_KEYS = {
    "hits",
    "misses",
    "evictions",
    "resident",
    "capacity",
    "prepare_calls",
    "owner_changes",
    "invalidations",
    "last_copies",
    "last_copy_bytes",
    "slot_bytes",
    "host_bytes",
}


def make(capacity: int = 3, split: str = "token", **overrides: Any) -> CachedWeightProvider:
    kwargs: dict[str, Any] = {**sources(), **overrides}
    return CachedWeightProvider(capacity=capacity, split=split, device=CPU, **kwargs)  # type: ignore[arg-type]


def test_stats() -> None:
    p = make(capacity=2)
    src = sources()
    p.prepare(ids([0, 1]))
    p.prepare(ids([1, 2]))
    stats = p.stats()
    assert stats.keys() == STATS_KEYS
    assert stats == {
        "hits": 1,
        "misses": 3,
        "evictions": 1,
        "resident": 2,
        "capacity": 2,
        "prepare_calls": 2,
        "owner_changes": 0,
        "invalidations": 0,
        "last_copies": 1,
        "last_copy_bytes": sum(t[0].nbytes for t in src.values()),
        "slot_bytes": sum(2 * t[0].nbytes for t in src.values()),
        "host_bytes": sum(t.nbytes for t in src.values()),
    }


# -- LFRU ------------------------------------------------------------------------


def run_calls(p: CachedWeightProvider, calls: list[list[int]]) -> None:
    for call in calls:
        p.prepare(ids(call))


def test_frequency_beats_recency() -> None:
    # At call 5: expert 0 scores 3/2, expert 1 scores 1/1; LRU would evict 0.
    p = make(capacity=2)
    run_calls(p, [[0], [0], [0], [1], [2]])
    assert p.resident_experts().keys() == {0, 2}


def test_age_beats_frequency() -> None:
    # At call 8: 0 scores 2/6, 1 scores 1/1, 2 scores 4/2; LFU would evict 1.
    p = make(capacity=3)
    run_calls(p, [[0], [0], [2], [2], [2], [2], [1], [3]])
    assert p.resident_experts().keys() == {1, 2, 3}


def test_tie_goes_to_lowest_expert_id() -> None:
    p = make(capacity=2)
    run_calls(p, [[1, 0], [2]])
    assert p.resident_experts().keys() == {1, 2}


def test_requested_experts_are_never_victims() -> None:
    # 0 and 1 are the coldest residents but requested again with a miss.
    p = make(capacity=3)
    run_calls(p, [[0], [1], [2], [2], [2]])
    result = p.prepare(ids([0, 1, 3]))
    assert p.resident_experts().keys() == {0, 1, 3}
    assert_serves(p, result.expert_map, {0, 1, 3})


def test_free_slots_are_used_before_evicting() -> None:
    p = make(capacity=3)
    run_calls(p, [[0], [1]])
    assert p.stats()["evictions"] == 0
    p.prepare(ids([2]))
    assert p.stats()["evictions"] == 0 and p.stats()["resident"] == 3


class LfruModel:
    """The eviction rule restated independently, with exact fractions."""

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.frequency = [0] * E
        self.last = [0] * E
        self.now = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0}
        self.last_copies = 0

    def prepare(self, request: set[int]) -> None:
        self.now += 1
        for e in request:
            self.frequency[e] += 1
            self.last[e] = self.now
        misses = sorted(request - self.slot_of.keys())
        self.last_copies = len(misses)
        self.counts["hits"] += len(request) - len(misses)
        self.counts["misses"] += len(misses)
        candidates = sorted(
            (e for e in self.slot_of if e not in request),
            key=lambda e: (
                Fraction(self.frequency[e], max(1, self.now - self.last[e])),
                self.last[e],
                e,
            ),
        )
        for victim in candidates[: max(0, len(misses) - len(self.free))]:
            self.free.append(self.slot_of.pop(victim))
            self.counts["evictions"] += 1
        for e in misses:
            self.slot_of[e] = self.free.pop()

    def invalidate(self, e: int) -> None:
        if e in self.slot_of:
            self.free.append(self.slot_of.pop(e))


operations = st.lists(
    st.one_of(
        # -1 is padding: the model is given the request without it.
        st.tuples(st.just("prepare"), st.lists(st.integers(-1, E - 1), min_size=1, max_size=4)),
        st.tuples(st.just("invalidate"), st.integers(0, E - 1)),
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(1, E), ops=operations)
def test_matches_the_lfru_model(capacity: int, ops: list[tuple[str, Any]]) -> None:
    p = make(capacity=capacity)
    model = LfruModel(capacity)
    for op, arg in ops:
        if op == "invalidate":
            p.invalidate(arg)
            model.invalidate(arg)
            continue
        request = set(arg) - {-1}
        if len(request) > capacity:
            with pytest.raises(InvalidInputError):
                p.prepare(ids(arg))
            continue
        result = p.prepare(ids(arg))
        model.prepare(request)
        assert p.resident_experts() == model.slot_of
        assert_serves(p, result.expert_map, request)
        stats = p.stats()
        assert {k: stats[k] for k in model.counts} == model.counts
        assert stats["last_copies"] == model.last_copies
        assert stats["resident"] == len(model.slot_of) <= capacity


# -- invalidate ------------------------------------------------------------------


def test_invalidate_frees_the_slot_and_the_next_use_copies_again() -> None:
    p = make(capacity=2)
    result = p.prepare(ids([0, 1]))
    slot = p.resident_experts()[0]
    p.buf_w13[slot].fill_(-7.0)  # stale contents that a re-copy must overwrite
    p.invalidate(0)
    assert 0 not in p.resident_experts() and p.stats()["resident"] == 1
    assert result.expert_map[0] == -1 and result.expert_map[1] >= 0
    result = p.prepare(ids([0]))
    assert p.resident_experts()[0] == slot
    assert p.stats()["misses"] == 3 and p.stats()["evictions"] == 0
    assert p.stats()["invalidations"] == 1
    assert_serves(p, result.expert_map, {0})


def test_counters_stay_consistent_through_invalidations() -> None:
    """``resident == misses - evictions - invalidations`` (the check a live server's cache is
    read back with) holds for the LFRU provider too; a non-resident expert's invalidation is a
    no-op and is not counted."""
    p = make(capacity=2)
    p.prepare(ids([0, 1]))
    p.invalidate(0)
    p.invalidate(0)  # no longer resident: nothing to count
    p.prepare(ids([2, 3]))
    p.invalidate(3)
    stats = p.stats()
    assert stats["invalidations"] == 2
    assert expert_cache_counter_problems([{"layer": "l0", **stats}]) == []

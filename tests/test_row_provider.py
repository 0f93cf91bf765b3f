"""RowCacheWeightProvider on the CPU, what only it does: LRU placement against the reference
host semantics, the recording backend, the packed layout's copies, a failed schedule.

The contract it shares with every provider (slot contents, padding, stats, bad input, source
ownership, the thread guard) is ``tests/test_provider_contract.py``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_provider_contract import BAD_CALLS, assert_serves, ids, sources

from model_check.table.reference import (
    Bounds,
    Counters,
    initial_host,
    plan_invalidate,
    plan_prepare,
)
from rowcache import InvalidInputError, RowCacheWeightProvider
from rowcache.backends import CpuBackend, RecordingBackend
from rowcache.packing import PACK_ALIGN

E = 8
CPU = torch.device("cpu")


def make(capacity: int = 3, split: str = "token", **overrides: Any) -> RowCacheWeightProvider:
    kwargs: dict[str, Any] = {**sources(), "device": CPU, **overrides}
    return RowCacheWeightProvider(capacity=capacity, split=split, **kwargs)  # type: ignore[arg-type]


# -- surface (the shared contract is tests/test_provider_contract.py) --------------------


def test_picks_the_cpu_backend() -> None:
    p = make()
    assert isinstance(p.backend, CpuBackend)
    assert p.resident_experts() == {} and p.lru_order() == () and p.owner is None


def test_stats_and_lru_placement() -> None:
    p = make(capacity=2)
    src = sources()
    p.prepare(ids([0, 1]))  # 0 -> slot 0, 1 -> slot 1
    p.prepare(ids([1, 2]))  # evicts 0 (least recent, not requested): 2 -> slot 0
    assert p.resident_experts() == {1: 1, 2: 0}
    assert p.lru_order() == (1, 2)
    p.invalidate(1)
    assert p.stats() == {
        "hits": 1,
        "misses": 3,
        "evictions": 1,
        "resident": 1,
        "capacity": 2,
        "prepare_calls": 2,
        "owner_changes": 0,
        "invalidations": 1,
        "last_copies": 1,
        "last_copy_bytes": sum(t[0].nbytes for t in src.values()),
        "slot_bytes": sum(2 * t[0].nbytes for t in src.values()),
        "host_bytes": sum(t.nbytes for t in src.values()),
    }


def test_invalidate_then_reuse_takes_the_lowest_free_slot() -> None:
    p = make(capacity=3)
    p.prepare(ids([0, 1, 2]))
    p.invalidate(2)
    p.invalidate(0)
    result = p.prepare(ids([5, 6]))  # slots 0 then 2, the lowest free first
    assert p.resident_experts() == {1: 1, 5: 0, 6: 2}
    assert p.lru_order() == (1, 5, 6)
    assert_serves(p, result.expert_map, {5, 6})


def test_packed_layout_reports_one_range_per_copy() -> None:
    p = make(capacity=2, layout="packed")
    p.prepare(ids([0, 1]))
    range_bytes = p.stats()["host_bytes"] // E  # the packed host buffer is [E, P]
    assert range_bytes % PACK_ALIGN == 0
    assert p.stats()["last_copy_bytes"] == 2 * range_bytes
    assert p.stats()["last_copies"] == 2


def test_share_sources_cannot_be_packed() -> None:
    message = "share_sources=True cannot be combined with layout='packed'"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        make(layout="packed", share_sources=True)


# -- data after every prepare, against the reference host semantics --------------------

operations = st.lists(
    st.one_of(
        # -1 is padding: the reference is given the request without it.
        st.tuples(st.just("prepare"), st.lists(st.integers(-1, E - 1), min_size=0, max_size=5)),
        st.tuples(st.just("invalidate"), st.integers(0, E - 1)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, E), ops=operations)
def test_slots_hold_their_experts_after_every_call(
    capacity: int, ops: list[tuple[str, Any]]
) -> None:
    p = make(capacity=capacity)
    bounds = Bounds(num_experts=E, capacity=capacity)
    host, counters = initial_host(bounds), Counters()
    for op, arg in ops:
        if op == "invalidate":
            p.invalidate(arg)
            effect = plan_invalidate(host, counters, bounds, (arg,), 0)
            host, counters = effect.host, effect.counters
            continue
        request = sorted(set(arg) - {-1})
        if len(request) > capacity:
            with pytest.raises(InvalidInputError):
                p.prepare(ids(arg))
            continue
        topk = ids(arg) if arg else torch.empty(0, 1, dtype=torch.int64)
        result = p.prepare(topk)
        effect = plan_prepare(host, counters, bounds, (tuple(request),), 0)
        host, counters = effect.host, effect.counters
        assert_serves(p, result.expert_map, set(request))
        assert p.slot_of() == host.slot_of and p.lru_order() == host.lru
        stats = p.stats()
        assert {k: stats[k] for k in Counters._fields} == counters._asdict()
        assert stats["last_copies"] == len(effect.copies)


# -- bad input -----------------------------------------------------------------------


def test_rejected_call_records_no_device_step() -> None:
    backend = RecordingBackend()
    p = make(backend=backend)
    p.prepare(ids([0]))
    backend.take()
    for _name, bad_call, _message in BAD_CALLS:  # the contract's, shared by every provider
        with pytest.raises(InvalidInputError):
            bad_call(p)
    assert backend.take() == []


def test_constructor_rejects_a_device_without_a_backend() -> None:
    with pytest.raises(InvalidInputError, match=re.escape("no backend for device meta")):
        make(device="meta")


# -- a failed schedule ------------------------------------------------------------


def test_failed_schedule_forgets_the_copied_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make()
    p.prepare(ids([0]))

    def broken(stream: object, copies: Sequence[tuple[int, int]]) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(p.backend, "copy_rows", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        p.prepare(ids([0, 1]))
    assert p.resident_experts() == {0: 0}  # 1 was never made resident
    monkeypatch.undo()
    result = p.prepare(ids([0, 1]))
    assert_serves(p, result.expert_map, {0, 1})

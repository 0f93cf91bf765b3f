"""CachedWeightProvider: LFRU behaviour, slot contents, bad input, the thread guard."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.cached import CachedWeightProvider
from rowcache.errors import ConcurrentCallError, InvalidInputError
from rowcache.guard import CallGuard
from rowcache.types import ExpertWeightProvider

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
    "slot_bytes",
    "host_bytes",
}


def sources(num_experts: int = E) -> dict[str, torch.Tensor]:
    """Every row of expert e holds e (offset per tensor), so slot contents are checkable."""
    e = torch.arange(num_experts, dtype=torch.float32)
    return {
        "w13": e.view(-1, 1, 1).expand(num_experts, 4, 2).clone(),
        "w2": (e + 100).view(-1, 1, 1).expand(num_experts, 2, 2).to(torch.bfloat16),
        "w13_scale": (e + 200).view(-1, 1).expand(num_experts, 4).to(torch.float16),
        "w2_scale": (e + 300).view(-1, 1).expand(num_experts, 2).clone(),
        "w13_scale_2": e + 400,
        "w2_scale_2": e + 500,
    }


def make(capacity: int = 3, split: str = "token", **overrides: Any) -> CachedWeightProvider:
    kwargs: dict[str, Any] = {**sources(), **overrides}
    return CachedWeightProvider(capacity=capacity, split=split, device=CPU, **kwargs)  # type: ignore[arg-type]


def ids(*rows: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)


def buffers(p: CachedWeightProvider) -> list[torch.Tensor]:
    bufs = [
        p.buf_w13,
        p.buf_w2,
        p.buf_w13_scale,
        p.buf_w2_scale,
        p.buf_w13_scale_2,
        p.buf_w2_scale_2,
    ]
    return [b for b in bufs if b is not None]


def assert_exposes_exactly(
    p: CachedWeightProvider, expert_map: torch.Tensor, req: set[int]
) -> None:
    src = sources()
    resident = p.resident_experts()
    for e, slot in enumerate(expert_map.tolist()):
        if e not in req:
            assert slot == -1, f"expert {e} exposed but not requested"
            continue
        assert resident[e] == slot
        for name, buf in zip(src, buffers(p), strict=True):
            assert torch.equal(buf[slot], src[name][e]), (name, e, slot)


# -- surface ---------------------------------------------------------------------


def test_satisfies_the_shared_protocol() -> None:
    p = make()
    assert isinstance(p, ExpertWeightProvider)
    assert (p.capacity, p.split, p.num_experts, p.device) == (3, "token", E, CPU)


def test_prepare_exposes_exactly_the_request_with_all_six_tensors() -> None:
    p = make()
    result = p.prepare(ids([5, 1], [1, 2]))
    assert_exposes_exactly(p, result.expert_map, {1, 2, 5})
    assert result.w1 is p.buf_w13 and result.w2 is p.buf_w2
    assert result.w1_scale is p.buf_w13_scale and result.w2_scale is p.buf_w2_scale
    assert result.expert_map.dtype == torch.int32 and result.expert_map.shape == (E,)


def test_unique_ids_expose_only_the_group() -> None:
    p = make(capacity=2)
    result = p.prepare(ids([0, 1, 2, 3]), unique_ids=[3, 1])
    assert_exposes_exactly(p, result.expert_map, {1, 3})


def test_map_narrows_to_each_call_even_when_more_is_resident() -> None:
    p = make()
    p.prepare(ids([0, 1, 2]))
    result = p.prepare(ids([2]))
    assert p.resident_experts().keys() == {0, 1, 2}
    assert_exposes_exactly(p, result.expert_map, {2})


def test_scales_optional() -> None:
    src = sources()
    p = CachedWeightProvider(src["w13"], src["w2"], capacity=2, device=CPU)
    result = p.prepare(ids([4]))
    assert result.w1_scale is None and result.w2_scale is None
    assert p.buf_w13_scale_2 is None and p.buf_w2_scale_2 is None
    assert torch.equal(p.buf_w13[result.expert_map[4]], src["w13"][4])


def test_buffers_keep_their_address() -> None:
    p = make(capacity=2)
    before = [b.data_ptr() for b in buffers(p)]
    map_ptr = p.prepare(ids([0])).expert_map.data_ptr()
    for step in range(20):
        result = p.prepare(ids([step % E, (step * 3 + 1) % E]))
        assert result.expert_map.data_ptr() == map_ptr
    p.invalidate(1)
    assert [b.data_ptr() for b in buffers(p)] == before


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
        "slot_bytes": sum(2 * t[0].nbytes for t in src.values()),
        "host_bytes": sum(t.nbytes for t in src.values()),
    }


def test_empty_request_is_accepted_and_exposes_nothing() -> None:
    p = make()
    p.prepare(ids([0]))
    result = p.prepare(torch.empty(0, 2, dtype=torch.int64))
    assert result.expert_map.tolist() == [-1] * E
    assert p.stats()["prepare_calls"] == 2


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
    assert_exposes_exactly(p, result.expert_map, {0, 1, 3})


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

    def prepare(self, request: set[int]) -> None:
        from fractions import Fraction

        self.now += 1
        for e in request:
            self.frequency[e] += 1
            self.last[e] = self.now
        misses = sorted(request - self.slot_of.keys())
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
        st.tuples(st.just("prepare"), st.lists(st.integers(0, E - 1), min_size=1, max_size=4)),
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
        request = set(arg)
        if len(request) > capacity:
            with pytest.raises(InvalidInputError):
                p.prepare(ids(arg))
            continue
        result = p.prepare(ids(arg))
        model.prepare(request)
        assert p.resident_experts() == model.slot_of
        assert_exposes_exactly(p, result.expert_map, request)
        stats = p.stats()
        assert {k: stats[k] for k in model.counts} == model.counts
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
    assert_exposes_exactly(p, result.expert_map, {0})


def test_invalidate_non_resident_is_a_noop() -> None:
    p = make()
    p.prepare(ids([0]))
    before = p.stats(), p.resident_experts()
    p.invalidate(5)
    assert (p.stats(), p.resident_experts()) == before


# -- bad input leaves everything unchanged ----------------------------------------------------

BAD_PREPARES: list[tuple[str, Callable[[CachedWeightProvider], object], str]] = [
    ("float ids", lambda p: p.prepare(torch.zeros(1, 2)), "integer dtype, got torch.float32"),
    ("rank 1", lambda p: p.prepare(torch.tensor([1, 2])), "must have rank 2"),
    ("rank 3", lambda p: p.prepare(torch.zeros(1, 1, 2, dtype=torch.int64)), "got rank 3"),
    ("not a tensor", lambda p: p.prepare([[1]]), "topk_ids must be a torch.Tensor"),  # type: ignore[arg-type]
    ("minus one", lambda p: p.prepare(ids([3, -1])), "expert id -1, outside [0, 8)"),
    ("id E", lambda p: p.prepare(ids([3, E])), f"expert id {E}, outside [0, 8)"),
    (
        "too many",
        lambda p: p.prepare(ids([4, 5, 6, 7])),
        "prepare: 4 unique experts requested but capacity is 3",
    ),
    (
        "wrong device",
        lambda p: p.prepare(torch.zeros(1, 1, dtype=torch.int64, device="meta")),
        "topk_ids is on meta",
    ),
    (
        "unique duplicate",
        lambda p: p.prepare(ids([4, 5]), unique_ids=[4, 4]),
        "names expert 4 more than once",
    ),
    ("unique range", lambda p: p.prepare(ids([4]), unique_ids=[9]), "expert id 9, outside"),
    ("unique unrouted", lambda p: p.prepare(ids([4]), unique_ids=[5]), "names expert 5, which"),
    (
        "unique too many",
        lambda p: p.prepare(ids([4, 5, 6, 7]), unique_ids=[4, 5, 6, 7]),
        "4 unique experts requested but capacity is 3",
    ),
    (
        "unique float",
        lambda p: p.prepare(ids([4]), unique_ids=torch.tensor([4.0])),
        "unique_ids must have an integer dtype",
    ),
    ("invalidate -1", lambda p: p.invalidate(-1), "invalidate: expert id -1 outside [0, 8)"),
    ("invalidate E", lambda p: p.invalidate(E), "invalidate: expert id 8 outside [0, 8)"),
    ("invalidate bool", lambda p: p.invalidate(True), "expert_id must be an int, got True"),
    ("invalidate float", lambda p: p.invalidate(1.0), "expert_id must be an int, got 1.0"),  # type: ignore[arg-type]
]

WARMUP = [[0, 1], [1], [2, 3], [1, 3]]
FOLLOW_UP = [[4], [5, 0], [2], [6, 7], [3], [0, 4, 5], [1]]


def observe(p: CachedWeightProvider, last_map: torch.Tensor) -> tuple[object, ...]:
    # The eviction bookkeeping is private but is exactly what a side effect
    # would corrupt, so it is compared too.
    return (
        p.stats(),
        p.resident_experts(),
        (p._frequency[:], p._last_use[:], p._free[:], set(p._exposed)),
        last_map.clone(),
        [b.clone() for b in buffers(p)],
    )


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    *plain_a, map_a, bufs_a = a
    *plain_b, map_b, bufs_b = b
    assert isinstance(map_a, torch.Tensor) and isinstance(map_b, torch.Tensor)
    assert isinstance(bufs_a, list) and isinstance(bufs_b, list)
    return (
        plain_a == plain_b
        and torch.equal(map_a, map_b)
        and all(torch.equal(x, y) for x, y in zip(bufs_a, bufs_b, strict=True))
    )


@pytest.mark.parametrize(
    ("bad_call", "message"), [c[1:] for c in BAD_PREPARES], ids=[c[0] for c in BAD_PREPARES]
)
def test_rejected_call_changes_nothing(
    bad_call: Callable[[CachedWeightProvider], object], message: str
) -> None:
    victim, twin = make(), make()
    for call in WARMUP:
        last_map = victim.prepare(ids(call)).expert_map
        twin_map = twin.prepare(ids(call)).expert_map
    before = observe(victim, last_map)

    with pytest.raises(InvalidInputError, match=re.escape(message)):
        bad_call(victim)

    # Counters, residency, eviction bookkeeping, the last map, every slot byte.
    assert same(observe(victim, last_map), before)
    # And the victim keeps behaving exactly like a twin that never saw the bad call.
    for call in FOLLOW_UP:
        last_map = victim.prepare(ids(call)).expert_map
        twin_map = twin.prepare(ids(call)).expert_map
        assert same(observe(victim, last_map), observe(twin, twin_map)), call


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"split": "rows"}, "split must be one of ['token', 'expert'], got 'rows'"),
        ({"capacity": 0}, "got capacity=0 with num_experts=8"),
        ({"capacity": E + 1}, "got capacity=9 with num_experts=8"),
        ({"w2_scale_2": None}, "w13_scale_2 was given without w2_scale_2"),
        ({"w2": torch.zeros(E - 1, 2, 2)}, "w2 has E=7"),
    ],
)
def test_constructor_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        make(**overrides)


# -- thread guard ----------------------------------------------------------------


def test_concurrent_call_from_another_thread_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make()
    inside, leave = threading.Event(), threading.Event()
    publish = p._publish

    def slow_publish(requested: list[int]) -> None:
        inside.set()
        assert leave.wait(10)
        publish(requested)

    monkeypatch.setattr(p, "_publish", slow_publish)
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(p.prepare(ids([1]))))
    worker.start()
    try:
        assert inside.wait(10)
        with pytest.raises(
            ConcurrentCallError,
            match=re.escape(
                "CachedWeightProvider.invalidate called from another thread while "
                "CachedWeightProvider.prepare was running"
            ),
        ):
            p.invalidate(1)
        with pytest.raises(
            ConcurrentCallError, match=re.escape("CachedWeightProvider.prepare called")
        ):
            p.prepare(ids([2]))
    finally:
        leave.set()
        worker.join(10)
    assert len(outcome) == 1
    # The rejected callers changed nothing; the first call completed normally.
    assert p.resident_experts().keys() == {1}
    assert p.stats()["prepare_calls"] == 1
    p.invalidate(1)


def test_reentry_from_the_same_thread_is_rejected_without_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = make()
    publish = p._publish
    errors: list[ConcurrentCallError] = []

    def reentrant_publish(requested: list[int]) -> None:
        with pytest.raises(ConcurrentCallError) as info:
            p.prepare(ids([2]))
        errors.append(info.value)
        publish(requested)

    monkeypatch.setattr(p, "_publish", reentrant_publish)
    p.prepare(ids([1]))
    assert "re-entered from the same thread" in str(errors[0])


def test_guard_released_after_an_exception() -> None:
    guard = CallGuard("Provider")
    with pytest.raises(KeyError), guard("prepare"):
        raise KeyError("boom")
    with guard("invalidate"):
        pass


def test_guard_sequential_calls_from_many_threads_all_succeed() -> None:
    p = make(capacity=E)
    lock = threading.Lock()

    def work(e: int) -> None:
        with lock:
            p.prepare(ids([e]))

    threads = [threading.Thread(target=work, args=(e,)) for e in range(E)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert p.stats()["prepare_calls"] == E

"""RowCacheWeightProvider on the CPU: slot contents, forwards, bad input, the thread guard."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_reference import cached_moe, make_layer, make_routing, reference_moe, term_magnitude

from model_check.reference import Bounds, Counters, initial_host, plan_invalidate, plan_prepare
from rowcache import (
    ConcurrentCallError,
    ExpertWeightProvider,
    InvalidInputError,
    RowCacheWeightProvider,
    plan_chunks,
    plan_expert_groups,
    run_with_expert_cache,
)
from rowcache.backends import CpuBackend, RecordingBackend
from rowcache.sources import SOURCE_NAMES

E = 8
CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


def sources(num_experts: int = E) -> dict[str, torch.Tensor]:
    """Distinct rows per expert in all six tensors (fp8 block scales, fp32 global scales)."""
    e = torch.arange(num_experts, dtype=torch.float32)
    w13 = e.view(-1, 1, 1) * 100 + torch.arange(8, dtype=torch.float32).view(1, 4, 2)
    w2 = (e.view(-1, 1, 1) + 0.5 + torch.arange(8, dtype=torch.float32).view(1, 2, 4) / 16).to(
        torch.bfloat16
    )
    # e4m3 holds (e + 1) / 4 * 2^j exactly for these small values: distinct per expert and row.
    pow2 = 2.0 ** torch.arange(4, dtype=torch.float32)
    w13_scale = ((e.view(-1, 1) + 1) / 4 * pow2.view(1, 4)).view(-1, 4, 1).to(FP8)
    w2_scale = ((e.view(-1, 1) + 1) / 4 * pow2[:2].view(1, 2)).view(-1, 2, 1).to(FP8)
    return {
        "w13": w13,
        "w2": w2,
        "w13_scale": w13_scale,
        "w2_scale": w2_scale,
        "w13_scale_2": e * 3 + 0.125,
        "w2_scale_2": e * 7 + 0.25,
    }


def make(capacity: int = 3, split: str = "token", **overrides: Any) -> RowCacheWeightProvider:
    kwargs: dict[str, Any] = {**sources(), "device": CPU, **overrides}
    return RowCacheWeightProvider(capacity=capacity, split=split, **kwargs)  # type: ignore[arg-type]


def ids(*rows: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)


def buffers(p: RowCacheWeightProvider) -> list[torch.Tensor | None]:
    return [
        p.buf_w13,
        p.buf_w2,
        p.buf_w13_scale,
        p.buf_w2_scale,
        p.buf_w13_scale_2,
        p.buf_w2_scale_2,
    ]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (fp8 has no equality on the CPU)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_slots_hold_their_experts(
    p: RowCacheWeightProvider, expert_map: torch.Tensor, requested: set[int]
) -> None:
    src = sources()
    resident = p.resident_experts()
    bufs = buffers(p)
    for e, slot in enumerate(expert_map.tolist()):
        if e not in requested:
            assert slot == -1, f"expert {e} exposed but not requested"
            continue
        assert resident[e] == slot
        for name, buf in zip(SOURCE_NAMES, bufs, strict=True):
            assert buf is not None
            assert torch.equal(raw(buf[slot]), raw(src[name][e])), (name, e, slot)
    # Every resident expert's slot holds it, exposed or not.
    for e, slot in resident.items():
        for name, buf in zip(SOURCE_NAMES, bufs, strict=True):
            assert buf is not None
            assert torch.equal(raw(buf[slot]), raw(src[name][e])), (name, e, slot)


# -- surface ---------------------------------------------------------------------


def test_satisfies_the_shared_protocol_and_picks_the_cpu_backend() -> None:
    p = make()
    assert isinstance(p, ExpertWeightProvider)
    assert isinstance(p.backend, CpuBackend)
    assert (p.capacity, p.split, p.num_experts, p.device) == (3, "token", E, CPU)
    assert all(b is not None for b in buffers(p))
    assert p.buf_w13_scale is not None and p.buf_w13_scale.dtype == FP8


def test_prepare_exposes_exactly_the_request_with_all_six_tensors() -> None:
    p = make()
    result = p.prepare(ids([5, 1], [1, 2]))
    assert_slots_hold_their_experts(p, result.expert_map, {1, 2, 5})
    assert result.w1 is p.buf_w13 and result.w2 is p.buf_w2
    assert result.w1_scale is p.buf_w13_scale and result.w2_scale is p.buf_w2_scale
    assert result.expert_map.dtype == torch.int32 and result.expert_map.shape == (E,)


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
        "slot_bytes": sum(2 * t[0].nbytes for t in src.values()),
        "host_bytes": sum(t.nbytes for t in src.values()),
    }


def test_buffers_keep_their_address() -> None:
    p = make(capacity=2)
    before = [b.data_ptr() for b in buffers(p) if b is not None]
    map_ptr = p.prepare(ids([0])).expert_map.data_ptr()
    for step in range(20):
        result = p.prepare(ids([step % E, (step * 3 + 1) % E]))
        assert result.expert_map.data_ptr() == map_ptr
    p.invalidate(1)
    assert [b.data_ptr() for b in buffers(p) if b is not None] == before


def test_scales_optional() -> None:
    src = sources()
    p = RowCacheWeightProvider(src["w13"], src["w2"], capacity=2, device=CPU)
    result = p.prepare(ids([4]))
    assert result.w1_scale is None and result.w2_scale is None
    assert p.buf_w13_scale_2 is None and p.buf_w2_scale_2 is None
    assert torch.equal(p.buf_w13[int(result.expert_map[4])], src["w13"][4])


def test_invalidate_then_reuse_copies_again() -> None:
    p = make(capacity=2)
    p.prepare(ids([0, 1]))
    slot = p.resident_experts()[0]
    p.buf_w13[slot].fill_(-7.0)  # stale contents that the re-copy must overwrite
    p.invalidate(0)
    p.invalidate(5)  # not resident: nothing happens
    assert p.resident_experts() == {1: 1}
    result = p.prepare(ids([0]))
    assert p.resident_experts()[0] == slot  # the lowest free slot
    assert_slots_hold_their_experts(p, result.expert_map, {0})
    assert p.stats()["misses"] == 3 and p.stats()["invalidations"] == 1


# -- data after every prepare, against the reference host semantics --------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("prepare"), st.lists(st.integers(0, E - 1), min_size=0, max_size=5)),
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
        request = sorted(set(arg))
        if len(request) > capacity:
            with pytest.raises(InvalidInputError):
                p.prepare(ids(arg))
            continue
        topk = ids(arg) if arg else torch.empty(0, 1, dtype=torch.int64)
        result = p.prepare(topk)
        effect = plan_prepare(host, counters, bounds, (tuple(request),), 0)
        host, counters = effect.host, effect.counters
        assert_slots_hold_their_experts(p, result.expert_map, set(request))
        assert p.slot_of() == host.slot_of and p.lru_order() == host.lru
        stats = p.stats()
        assert {k: stats[k] for k in Counters._fields} == counters._asdict()


# -- forwards through run_with_expert_cache ---------------------------------------------

HIDDEN, INTER, T = 16, 8, 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("split", "top_k", "capacity"), [("token", 2, 3), ("expert", 3, 2)])
def test_forward_matches_the_uncached_layer(
    dtype: torch.dtype, split: str, top_k: int, capacity: int
) -> None:
    layer = make_layer(E, HIDDEN, INTER, dtype=dtype, seed=3)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    topk_ids, topk_weights = make_routing(T, E, top_k, dtype=dtype, seed=5)
    assert len(set(topk_ids.flatten().tolist())) > capacity
    p = RowCacheWeightProvider(layer.w13, layer.w2, capacity=capacity, split=split, device=CPU)  # type: ignore[arg-type]
    ref = reference_moe(layer, x, topk_ids, topk_weights)
    for _ in range(2):  # the second pass starts from a warm, partly evicted cache
        out = cached_moe(p, layer, x, topk_ids, topk_weights)
        if split == "token":
            assert torch.equal(out, ref)
        else:
            unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
            bound = 3 * (top_k + 1) * unit * term_magnitude(layer, x, topk_ids, topk_weights)
            torch.testing.assert_close(out, ref, rtol=0.0, atol=bound)
    pieces = plan_chunks(topk_ids, capacity) if split == "token" else None
    groups = plan_expert_groups(topk_ids, capacity) if split == "expert" else None
    calls = len(pieces) if pieces is not None else len(groups or [])
    assert p.stats()["prepare_calls"] == 2 * calls > 2
    assert p.stats()["evictions"] > 0


# -- bad input leaves everything unchanged ----------------------------------------


def observe(p: RowCacheWeightProvider) -> tuple[object, ...]:
    return (
        p.stats(),
        p.lru_order(),
        p.slot_of(),
        p.owner,
        p.forward_pairs,
        list(p._free),
        p.backend.forward_map.clone(),
        p.backend.resident_map.clone(),
        [raw(b).clone() for b in buffers(p) if b is not None],
    )


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    *plain_a, fwd_a, res_a, bufs_a = a
    *plain_b, fwd_b, res_b, bufs_b = b
    assert isinstance(fwd_a, torch.Tensor) and isinstance(fwd_b, torch.Tensor)
    assert isinstance(res_a, torch.Tensor) and isinstance(res_b, torch.Tensor)
    assert isinstance(bufs_a, list) and isinstance(bufs_b, list)
    return (
        plain_a == plain_b
        and torch.equal(fwd_a, fwd_b)
        and torch.equal(res_a, res_b)
        and all(torch.equal(x, y) for x, y in zip(bufs_a, bufs_b, strict=True))
    )


def _plan_chunks_wide_row(p: RowCacheWeightProvider) -> object:
    return run_with_expert_cache(
        p,
        ids([0, 1, 0, 1], [2, 3, 4, 5]),
        lambda w, rows, shared: torch.zeros(rows.stop - rows.start),
    )


BAD_CALLS: list[tuple[str, Callable[[RowCacheWeightProvider], object], str]] = [
    (
        "more unique experts than capacity",
        lambda p: p.prepare(ids([4, 5], [6, 7])),
        "prepare: 4 unique experts requested but capacity is 3",
    ),
    (
        "one token routes to more experts than capacity",
        _plan_chunks_wide_row,
        "plan_chunks: token row 1 routes to 4 distinct experts but capacity is 3",
    ),
    (
        "unique_ids out of range",
        lambda p: p.prepare(ids([4]), unique_ids=[E]),
        f"unique_ids holds expert id {E}, outside [0, {E})",
    ),
    (
        "unique_ids negative",
        lambda p: p.prepare(ids([4]), unique_ids=[-1]),
        f"unique_ids holds expert id -1, outside [0, {E})",
    ),
    (
        "unique_ids duplicates",
        lambda p: p.prepare(ids([4, 5]), unique_ids=[4, 4]),
        "unique_ids names expert 4 more than once",
    ),
    (
        "topk_ids out of range",
        lambda p: p.prepare(ids([3, E])),
        f"topk_ids holds expert id {E}, outside [0, {E})",
    ),
    ("topk_ids negative", lambda p: p.prepare(ids([3, -1])), "expert id -1, outside"),
    (
        "float topk_ids",
        lambda p: p.prepare(torch.zeros(1, 2)),
        "topk_ids must have an integer dtype, got torch.float32",
    ),
    ("rank 1", lambda p: p.prepare(torch.tensor([1, 2])), "must have rank 2"),
    ("rank 3", lambda p: p.prepare(torch.zeros(1, 1, 2, dtype=torch.int64)), "got rank 3"),
    (
        "topk_ids on another device",
        lambda p: p.prepare(torch.zeros(1, 1, dtype=torch.int64, device="meta")),
        "topk_ids is on meta",
    ),
    ("invalidate -1", lambda p: p.invalidate(-1), f"invalidate: expert id -1 outside [0, {E})"),
    ("invalidate E", lambda p: p.invalidate(E), f"invalidate: expert id {E} outside [0, {E})"),
    ("invalidate bool", lambda p: p.invalidate(True), "expert_id must be an int, got True"),
]

WARMUP = [[0, 1], [1], [2, 3], [1, 3]]
FOLLOW_UP = [[4], [5, 0], [2], [6, 7], [3], [0, 4, 5], [1]]


@pytest.mark.parametrize(
    ("bad_call", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_rejected_call_changes_nothing(
    bad_call: Callable[[RowCacheWeightProvider], object], message: str
) -> None:
    victim, twin = make(), make()
    for call in WARMUP:
        victim.prepare(ids(call))
        twin.prepare(ids(call))
    victim.invalidate(2)
    twin.invalidate(2)
    before = observe(victim)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        bad_call(victim)
    assert same(observe(victim), before)
    for call in FOLLOW_UP:
        victim.prepare(ids(call))
        twin.prepare(ids(call))
        assert same(observe(victim), observe(twin)), call


def test_rejected_call_records_no_device_step() -> None:
    backend = RecordingBackend()
    p = make(backend=backend)
    p.prepare(ids([0]))
    backend.take()
    for _name, bad_call, _message in BAD_CALLS:
        with pytest.raises(InvalidInputError):
            bad_call(p)
    assert backend.take() == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"split": "rows"}, "split must be one of ['token', 'expert'], got 'rows'"),
        ({"capacity": 0}, "got capacity=0 with num_experts=8"),
        ({"capacity": -1}, "got capacity=-1 with num_experts=8"),
        ({"capacity": E + 1}, "got capacity=9 with num_experts=8"),
        ({"w2_scale_2": None}, "w13_scale_2 was given without w2_scale_2"),
        ({"w13_scale_2": None}, "w2_scale_2 was given without w13_scale_2"),
        ({"w2_scale_2": torch.zeros(E - 1)}, "w2_scale_2 has E=7"),
        ({"w2": torch.zeros(E - 1, 2, 4)}, "w2 has E=7"),
        ({"w13": torch.zeros(E, 4, 2, device="meta")}, "w13 is on meta"),
        ({"device": "meta"}, "no backend for device meta"),
    ],
)
def test_constructor_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        make(**overrides)


# -- thread guard ----------------------------------------------------------------


def test_concurrent_call_from_another_thread_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make()
    inside, leave = threading.Event(), threading.Event()
    copy_rows = p.backend.copy_rows

    def slow_copy_rows(stream: object, copies: Sequence[tuple[int, int]]) -> None:
        inside.set()
        assert leave.wait(10)
        copy_rows(stream, copies)

    monkeypatch.setattr(p.backend, "copy_rows", slow_copy_rows)
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(p.prepare(ids([1]))))
    worker.start()
    try:
        assert inside.wait(10)
        before = p.stats()
        with pytest.raises(
            ConcurrentCallError,
            match=re.escape(
                "RowCacheWeightProvider.invalidate called from another thread while "
                "RowCacheWeightProvider.prepare was running"
            ),
        ):
            p.invalidate(1)
        with pytest.raises(ConcurrentCallError, match=re.escape("RowCacheWeightProvider.prepare")):
            p.prepare(ids([2]))
        assert p.stats() == before
    finally:
        leave.set()
        worker.join(10)
    assert len(outcome) == 1
    assert p.resident_experts() == {1: 0}
    assert p.stats()["prepare_calls"] == 1


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
    assert_slots_hold_their_experts(p, result.expert_map, {0, 1})

"""The contract every expert-weight provider keeps, run over each provider.

One suite for the shared surface (``rowcache.types.ExpertWeightProvider`` plus the inspection
method ``resident_experts``): what a ``prepare`` exposes and what the slots hold, ``-1``
padding, ``stats()`` (``last_copies`` / ``last_copy_bytes``), who owns the host sources,
``invalidate``, bad input that must change nothing, constructor checks and the thread guard.
Each provider is one ``ProviderKind`` in ``KINDS``: a new provider joins the suite with one
entry there. Behaviour only one provider has (LRU placement against the model, LFRU eviction,
backends) stays in that provider's own test file.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
import torch
from moe_reference import cached_moe, make_layer, make_routing, reference_moe, term_magnitude

from rowcache import (
    CachedWeightProvider,
    ConcurrentCallError,
    ExpertWeightProvider,
    InvalidInputError,
    RowCacheWeightProvider,
    plan_chunks,
    plan_expert_groups,
    run_with_expert_cache,
)
from rowcache.guard import CallGuard
from rowcache.sources import SOURCE_NAMES

E = 8
CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


class Provider(Protocol):
    """What the suite reads: the shared surface, the slot buffers and ``resident_experts``."""

    capacity: int
    num_experts: int
    buf_w13: torch.Tensor
    buf_w2: torch.Tensor
    buf_w13_scale: torch.Tensor | None
    buf_w2_scale: torch.Tensor | None
    buf_w13_scale_2: torch.Tensor | None
    buf_w2_scale_2: torch.Tensor | None
    buf_w13_bias: torch.Tensor | None
    buf_w2_bias: torch.Tensor | None

    def prepare(self, topk_ids: torch.Tensor, unique_ids: Any = None) -> Any: ...

    def invalidate(self, expert_id: int) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def resident_experts(self) -> dict[int, int]: ...


def row_internals(p: Any) -> tuple[object, ...]:
    return (
        p.lru_order(),
        p.slot_of(),
        p.owner,
        p.forward_pairs,
        list(p._free),
        p.backend.forward_map.tolist(),
        p.backend.resident_map.tolist(),
    )


def cached_internals(p: Any) -> tuple[object, ...]:
    # The eviction bookkeeping is private but is exactly what a side effect would corrupt.
    return (p._frequency[:], p._last_use[:], p._free[:], set(p._exposed), p._host_map.tolist())


@dataclass(frozen=True)
class ProviderKind:
    """One provider under the contract.

    ``build`` takes the constructor's arguments (the six sources, ``capacity``, ``split``,
    ``device`` and keywords such as ``share_sources``); ``internals`` returns the private
    state a rejected call must leave alone, as plain comparable values; ``inside_prepare``
    names a method (object, attribute) that ``prepare`` calls after validation while it
    copies a miss, where the thread-guard tests hold a call open.
    """

    name: str
    build: Callable[..., Provider]
    internals: Callable[[Any], tuple[object, ...]]
    inside_prepare: Callable[[Any], tuple[object, str]]
    planner: str = "host"

    def host_only(self, why: str) -> None:
        """Skip, naming why and where the device planner's behaviour is tested instead."""
        if self.planner == "device":
            pytest.skip(f"device planner: {why} (tests/test_device_planner.py)")


def device_internals(p: Any) -> tuple[object, ...]:
    state = p.state
    return tuple(
        getattr(state, n).tolist()
        for n in ("resident", "owners", "stamps", "clock", "forward", "counters")
    )


def device_planned(*args: Any, split: str = "expert", **kwargs: Any) -> Provider:
    """The device planner splits by passes over expert groups: the suite's default "token"
    maps to that, anything else is passed on (and an unknown split is rejected)."""
    split = "expert" if split == "token" else split
    return RowCacheWeightProvider(*args, planner="device", split=split, **kwargs)  # type: ignore[return-value]


KINDS = [
    ProviderKind("row", RowCacheWeightProvider, row_internals, lambda p: (p.backend, "copy_rows")),
    ProviderKind(
        "device", device_planned, device_internals, lambda p: (p._kernels, "gather"), "device"
    ),
    ProviderKind("cached", CachedWeightProvider, cached_internals, lambda p: (p, "_publish")),
]


def sources(num_experts: int = E) -> dict[str, torch.Tensor]:
    """Distinct rows per expert in every source (fp8 block scales, fp32 global scales, bf16 and
    fp32 biases)."""
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
        "w13_bias": (e.view(-1, 1) - torch.arange(4, dtype=torch.float32) / 8).to(torch.bfloat16),
        "w2_bias": e.view(-1, 1) * 11 + torch.arange(2, dtype=torch.float32),
    }


def fp8_block_sources(num_experts: int = E) -> dict[str, torch.Tensor]:
    """vLLM's block-scaled FP8 experts (``Fp8MoEMethod``, docs/PLUGIN.md "FP8 experts"): e4m3
    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, float32 128 x 128 block scales
    ``[E, 2 ceil(I/128), ceil(H/128)]`` and ``[E, ceil(H/128), ceil(I/128)]``; H=384, I=128, so
    the w2 scale row is 12 bytes. Random bytes, distinct per expert."""
    gen = torch.Generator().manual_seed(13)

    def raw(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (num_experts, *shape), generator=gen, dtype=torch.uint8)

    return {
        "w13": raw(256, 384).view(FP8),
        "w2": raw(384, 128).view(FP8),
        "w13_scale": raw(2, 3 * 4).view(torch.float32),
        "w2_scale": raw(3, 1 * 4).view(torch.float32),
    }


def mxfp4_sources(num_experts: int = E) -> dict[str, torch.Tensor]:
    """gpt-oss's MXFP4 experts (``test_mxfp4_slots``): packed uint8 values, uint8 e8m0 scales,
    float32 biases."""
    from test_mxfp4_slots import mxfp4_sources as draw

    return draw(hidden=64, inter=32, experts=num_experts)


GEOMETRIES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "mixed": sources,
    "fp8_block": fp8_block_sources,
    "mxfp4": mxfp4_sources,
}
"""Expert geometries every provider serves: ``sources`` (eight tensors of mixed dtypes),
vLLM's block-scaled FP8 experts and gpt-oss's MXFP4 ones."""

EXPERT_BYTES = sum(t[0].nbytes for t in sources().values())
"""Bytes of one expert's rows of every source: what one miss copies."""

Make = Callable[..., Provider]


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def kind(request: pytest.FixtureRequest) -> ProviderKind:
    param: ProviderKind = request.param
    return param


@pytest.fixture
def make(kind: ProviderKind) -> Make:
    def build(capacity: int = 3, split: str = "token", **overrides: Any) -> Provider:
        kwargs: dict[str, Any] = {**sources(), "device": CPU, **overrides}
        return kind.build(capacity=capacity, split=split, **kwargs)

    return build


def ids(*rows: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)


def buffers(p: Provider) -> list[torch.Tensor | None]:
    return [
        p.buf_w13,
        p.buf_w2,
        p.buf_w13_scale,
        p.buf_w2_scale,
        p.buf_w13_scale_2,
        p.buf_w2_scale_2,
        p.buf_w13_bias,
        p.buf_w2_bias,
    ]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (fp8 has no equality on the CPU)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_serves(
    p: Provider,
    expert_map: torch.Tensor,
    requested: set[int],
    src: dict[str, torch.Tensor] | None = None,
) -> None:
    """The map exposes exactly ``requested``, and every resident expert's slot holds its rows
    of ``src`` (the original sources by default), every tensor."""
    src = sources() if src is None else src
    resident = p.resident_experts()
    bufs = buffers(p)
    assert expert_map.dtype == torch.int32 and expert_map.shape == (p.num_experts,)
    for e, slot in enumerate(expert_map.tolist()):
        if e not in requested:
            assert slot == -1, f"expert {e} exposed but not requested"
        else:
            assert resident[e] == slot, f"expert {e} exposed at {slot}, resident at {resident}"
    for e, slot in resident.items():
        for name, buf in zip(SOURCE_NAMES, bufs, strict=True):
            if name not in src:
                assert buf is None, name
                continue
            assert buf is not None
            assert torch.equal(raw(buf[slot]), raw(src[name][e])), (name, e, slot)


# -- surface ---------------------------------------------------------------------


def test_satisfies_the_shared_protocol(kind: ProviderKind, make: Make) -> None:
    p: Any = make()
    assert isinstance(p, ExpertWeightProvider)
    split = "expert" if kind.planner == "device" else "token"
    assert (p.capacity, p.split, p.num_experts, p.device) == (3, split, E, CPU)
    assert all(b is not None for b in buffers(p))
    assert p.buf_w13_scale is not None and p.buf_w13_scale.dtype == FP8
    assert p.share_sources is False


def test_prepare_exposes_exactly_the_request_with_every_tensor(make: Make) -> None:
    p = make()
    result = p.prepare(ids([5, 1], [1, 2]))
    assert_serves(p, result.expert_map, {1, 2, 5})
    assert result.w1 is p.buf_w13 and result.w2 is p.buf_w2
    assert result.w1_scale is p.buf_w13_scale and result.w2_scale is p.buf_w2_scale


def test_unique_ids_expose_only_the_group(kind: ProviderKind, make: Make) -> None:
    kind.host_only("groups are passes selected by pass_index, not unique_ids")
    p = make(capacity=2)
    result = p.prepare(ids([0, 1, 2, 3]), unique_ids=[3, 1])
    assert_serves(p, result.expert_map, {1, 3})
    assert p.resident_experts().keys() == {1, 3}


def test_map_narrows_to_each_call_even_when_more_is_resident(make: Make) -> None:
    p = make()
    p.prepare(ids([0, 1, 2]))
    result = p.prepare(ids([2]))
    assert p.resident_experts().keys() == {0, 1, 2}
    assert_serves(p, result.expert_map, {2})


def test_scales_optional(kind: ProviderKind) -> None:
    src = sources()
    p: Any = kind.build(src["w13"], src["w2"], capacity=2, device=CPU)
    result = p.prepare(ids([4]))
    assert result.w1_scale is None and result.w2_scale is None
    assert p.buf_w13_scale is None and p.buf_w2_scale is None
    assert p.buf_w13_scale_2 is None and p.buf_w2_scale_2 is None
    assert p.buf_w13_bias is None and p.buf_w2_bias is None
    slot = int(result.expert_map[4])
    assert torch.equal(p.buf_w13[slot], src["w13"][4])
    assert torch.equal(p.buf_w2[slot], src["w2"][4])
    assert p.stats()["last_copy_bytes"] == src["w13"][0].nbytes + src["w2"][0].nbytes


@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_every_geometry_is_served_byte_exact(
    kind: ProviderKind, geometry: str, layout: str
) -> None:
    if layout == "packed" and kind.name == "cached":
        pytest.skip("the cached baseline has the separate layout only")
    src = GEOMETRIES[geometry]()
    layout_kw = {} if kind.name == "cached" else {"layout": layout}
    p: Any = kind.build(**src, capacity=3, device=CPU, **layout_kw)
    if layout == "packed":
        expert_bytes = p.stats()["slot_bytes"] // 3
    else:
        expert_bytes = sum(t[0].nbytes for t in src.values())
    assert expert_bytes >= sum(t[0].nbytes for t in src.values())
    for step in ([5, 1], [1, 2], [7, 0], [2, 7], [3, 4], [6, 5], [1, 3]):
        resident = set(p.resident_experts())
        result = p.prepare(ids(step))
        assert_serves(p, result.expert_map, set(step), src)
        misses = len(set(step) - resident)
        assert p.stats()["last_copy_bytes"] == misses * expert_bytes


def test_buffers_keep_their_address(make: Make) -> None:
    p = make(capacity=2)
    before = [b.data_ptr() for b in buffers(p) if b is not None]
    map_ptr = p.prepare(ids([0])).expert_map.data_ptr()
    for step in range(20):
        result = p.prepare(ids([step % E, (step * 3 + 1) % E]))
        assert result.expert_map.data_ptr() == map_ptr
    p.invalidate(1)
    assert [b.data_ptr() for b in buffers(p) if b is not None] == before


def test_empty_request_is_accepted_and_exposes_nothing(make: Make) -> None:
    p = make()
    p.prepare(ids([0]))
    result = p.prepare(torch.empty(0, 2, dtype=torch.int64))
    assert result.expert_map.tolist() == [-1] * E
    assert p.resident_experts().keys() == {0}
    assert p.stats()["prepare_calls"] == 2


def test_invalidate_then_reuse_copies_again(make: Make) -> None:
    p = make(capacity=2)
    p.prepare(ids([0, 1]))
    slot = p.resident_experts()[0]
    p.buf_w13[slot].fill_(-7.0)  # stale contents that the re-copy must overwrite
    p.invalidate(0)
    assert p.resident_experts() == {1: 1} and p.stats()["resident"] == 1
    result = p.prepare(ids([0]))
    assert p.resident_experts()[0] == slot  # the freed slot, no eviction
    assert_serves(p, result.expert_map, {0})
    stats = p.stats()
    assert (stats["misses"], stats["evictions"], stats["last_copies"]) == (3, 0, 1)


def test_invalidate_non_resident_is_a_noop(kind: ProviderKind, make: Make) -> None:
    p = make()
    last_map = p.prepare(ids([0, 3])).expert_map
    before = observe(kind, p, last_map)
    p.invalidate(5)
    assert observe(kind, p, last_map) == before


def test_stats_count_hits_misses_evictions_and_bytes(make: Make) -> None:
    p = make(capacity=2)
    src = sources()
    p.prepare(ids([0, 1]))
    p.prepare(ids([1, 2]))  # 1 hits, 2 misses and evicts 0
    stats = p.stats()
    expected = {
        "hits": 1,
        "misses": 3,
        "evictions": 1,
        "resident": 2,
        "capacity": 2,
        "prepare_calls": 2,
        "owner_changes": 0,
        "last_copies": 1,
        "last_copy_bytes": EXPERT_BYTES,
        "slot_bytes": sum(2 * t[0].nbytes for t in src.values()),
        "host_bytes": sum(t.nbytes for t in src.values()),
    }
    assert {k: stats[k] for k in expected} == expected


# -- what the last prepare copied (stats: last_copies, last_copy_bytes) ----------------------


def test_last_copies_report_the_last_accepted_prepare(kind: ProviderKind, make: Make) -> None:
    p = make(capacity=3)

    def last() -> tuple[int, int]:
        stats = p.stats()
        return stats["last_copies"], stats["last_copy_bytes"]

    assert last() == (0, 0)  # before any prepare
    p.prepare(ids([0, 1]))
    assert last() == (2, 2 * EXPERT_BYTES)
    p.prepare(ids([1, 0]))  # all hits
    assert last() == (0, 0)
    p.prepare(ids([2, 3], [1, 2]))  # 1 hits; 2 fills the free slot; 3 evicts 0
    assert last() == (2, 2 * EXPERT_BYTES)
    if kind.planner == "host":  # the device planner serves such a step in passes instead
        with pytest.raises(InvalidInputError):
            p.prepare(ids([4, 5, 6, 7]))
        assert last() == (2, 2 * EXPERT_BYTES)  # a rejected call changes nothing
    p.invalidate(2)
    assert last() == (2, 2 * EXPERT_BYTES)  # invalidate copies nothing and is no prepare
    p.prepare(ids([-1, -1]))
    assert last() == (0, 0)
    p.prepare(ids([2, -1]))
    assert last() == (1, EXPERT_BYTES)


# -- -1 is padding ---------------------------------------------------------------------------


def test_padding_is_no_expert(make: Make) -> None:
    p = make(capacity=2)
    result = p.prepare(ids([3, -1], [-1, 5], [-1, -1]))
    assert_serves(p, result.expert_map, {3, 5})
    assert p.resident_experts().keys() == {3, 5}  # padding took no slot
    stats = p.stats()
    assert (stats["misses"], stats["hits"], stats["last_copies"]) == (2, 0, 2)
    assert result.expert_map[E - 1] == -1  # -1 never reached the map as an index


def test_a_routing_of_only_padding_requests_nothing(make: Make) -> None:
    p = make(capacity=1)
    p.prepare(ids([6]))
    before = p.stats()
    result = p.prepare(ids([-1, -1, -1], [-1, -1, -1]))
    assert result.expert_map.tolist() == [-1] * E
    assert p.resident_experts().keys() == {6}
    after = p.stats()
    assert after["prepare_calls"] == before["prepare_calls"] + 1
    assert {k: after[k] for k in ("hits", "misses", "evictions", "resident")} == {
        k: before[k] for k in ("hits", "misses", "evictions", "resident")
    }
    assert (after["last_copies"], after["last_copy_bytes"]) == (0, 0)


def test_padding_in_unique_ids_is_dropped(kind: ProviderKind, make: Make) -> None:
    kind.host_only("groups are passes selected by pass_index, not unique_ids")
    p = make(capacity=1)
    result = p.prepare(ids([1, 3, -1]), unique_ids=[-1, 3, -1])
    assert_serves(p, result.expert_map, {3})
    result = p.prepare(ids([1, -1]), unique_ids=torch.tensor([1, -1]))
    assert_serves(p, result.expert_map, {1})


@pytest.mark.parametrize(("split", "top_k"), [("token", 2), ("expert", 3)])
def test_forward_skips_padding_and_does_not_count_it(
    kind: ProviderKind, split: str, top_k: int
) -> None:
    if split == "token":
        kind.host_only("a step is split by passes over expert groups, never by tokens")
    hidden, inter, tokens = 16, 8, 10
    layer = make_layer(E, hidden, inter, seed=11)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(12))
    topk_ids, topk_weights = make_routing(tokens, E, top_k, seed=13)
    topk_ids[::3, 0] = -1  # some padded entries
    topk_ids[4] = -1  # a token of only padding
    distinct = set(topk_ids.flatten().tolist()) - {-1}
    # Exactly as many slots as real experts: one prepare, because -1 is not counted.
    p: Any = kind.build(layer.w13, layer.w2, capacity=len(distinct), split=split, device=CPU)
    ref = reference_moe(layer, x, topk_ids, topk_weights)
    assert torch.equal(cached_moe(p, layer, x, topk_ids, topk_weights), ref)
    assert p.stats()["prepare_calls"] == 1 and p.resident_experts().keys() == distinct
    # Fewer slots: several pieces, none of them counting padding.
    q: Any = kind.build(layer.w13, layer.w2, capacity=3, split=split, device=CPU)
    out = cached_moe(q, layer, x, topk_ids, topk_weights)
    pieces = plan_chunks(topk_ids, 3) if split == "token" else plan_expert_groups(topk_ids, 3)
    assert q.stats()["prepare_calls"] == len(pieces) > 1
    if split == "token":
        assert torch.equal(out, ref)
    else:
        assert sorted(e for group in pieces for e in group) == sorted(distinct)
        bound = 3 * (top_k + 1) * 2.0**-24 * term_magnitude(layer, x, topk_ids, topk_weights)
        torch.testing.assert_close(out, ref, rtol=0.0, atol=bound)


# -- forwards through run_with_expert_cache ---------------------------------------------

HIDDEN, INTER, T = 16, 8, 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("split", "top_k", "capacity"), [("token", 2, 3), ("expert", 3, 2)])
def test_forward_matches_the_uncached_layer(
    kind: ProviderKind, dtype: torch.dtype, split: str, top_k: int, capacity: int
) -> None:
    if split == "token":
        kind.host_only("a step is split by passes over expert groups, never by tokens")
    layer = make_layer(E, HIDDEN, INTER, dtype=dtype, seed=3)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    topk_ids, topk_weights = make_routing(T, E, top_k, dtype=dtype, seed=5)
    assert len(set(topk_ids.flatten().tolist())) > capacity
    p: Any = kind.build(layer.w13, layer.w2, capacity=capacity, split=split, device=CPU)
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


# -- who owns the host sources ----------------------------------------------------------------


def scribble(src: dict[str, torch.Tensor], experts: Sequence[int]) -> None:
    """Overwrite ``experts``' rows of every source in place with bytes no expert holds."""
    for t in src.values():
        for e in experts:
            raw_row = t[e].view(torch.uint8) if t.dim() > 1 else t[e : e + 1].view(torch.uint8)
            raw_row.fill_(0x7E)


def test_a_later_write_by_the_caller_changes_nothing_served(kind: ProviderKind) -> None:
    src = sources()
    p: Any = kind.build(**src, capacity=2, device=CPU)
    assert p.share_sources is False
    scribble(src, range(E))  # after construction, before any prepare
    result = p.prepare(ids([0, 1]))
    assert_serves(p, result.expert_map, {0, 1})  # the original bytes
    scribble(src, range(E))
    p.invalidate(0)
    result = p.prepare(ids([0, 2]))  # both copied again, after the write
    assert p.stats()["last_copies"] == 2
    assert_serves(p, result.expert_map, {0, 2})
    assert p.stats()["host_bytes"] == sum(t.nbytes for t in sources().values())


def test_share_sources_keeps_the_callers_tensors(kind: ProviderKind) -> None:
    src = sources()
    original = sources()
    p: Any = kind.build(**src, capacity=2, device=CPU, share_sources=True)
    assert p.share_sources is True
    result = p.prepare(ids([0]))
    assert_serves(p, result.expert_map, {0}, original)
    scribble(src, [0, 1])
    # Resident slots keep the bytes they were filled with (a hit copies nothing) ...
    result = p.prepare(ids([0]))
    assert p.stats()["last_copies"] == 0
    assert_serves(p, result.expert_map, {0}, original)
    # ... a miss copies what the caller's tensors hold now ...
    p.prepare(ids([0, 1]))
    slot = p.resident_experts()[1]
    for name, buf in zip(SOURCE_NAMES, buffers(p), strict=True):
        assert buf is not None
        assert torch.equal(raw(buf[slot]), raw(src[name][1])), name
        assert not torch.equal(raw(buf[slot]), raw(original[name][1])), name
    # ... and invalidate is how the caller makes a rewritten resident expert copy again.
    p.invalidate(0)
    result = p.prepare(ids([0]))
    assert_serves(p, result.expert_map, {0}, src)


# -- bad input leaves everything unchanged ----------------------------------------------


def _wide_row_token_split(p: Provider) -> object:
    return run_with_expert_cache(
        p,  # type: ignore[arg-type]
        ids([0, 1, 0, 1], [2, 3, 4, 5]),
        lambda w, rows, shared: torch.zeros(rows.stop - rows.start),
    )


BAD_CALLS: list[tuple[str, Callable[[Provider], object], str]] = [
    (
        "more unique experts than capacity",
        lambda p: p.prepare(ids([4, 5], [6, 7])),
        "prepare: 4 unique experts requested but capacity is 3",
    ),
    (
        "one token routes to more experts than capacity",
        _wide_row_token_split,
        "plan_chunks: token row 1 routes to 4 distinct experts but capacity is 3",
    ),
    (
        "topk_ids out of range",
        lambda p: p.prepare(ids([3, E])),
        f"prepare: topk_ids holds expert id {E}, outside [0, {E}) (-1 is padding)",
    ),
    (
        "topk_ids -2",
        lambda p: p.prepare(ids([3, -2])),
        f"prepare: topk_ids holds expert id -2, outside [0, {E}) (-1 is padding)",
    ),
    (
        "padding does not hide a bad id",
        lambda p: p.prepare(ids([-1, -1], [-7, -1])),
        f"topk_ids holds expert id -7, outside [0, {E})",
    ),
    (
        "float topk_ids",
        lambda p: p.prepare(torch.zeros(1, 2)),
        "topk_ids must have an integer dtype, got torch.float32",
    ),
    ("rank 1", lambda p: p.prepare(torch.tensor([1, 2])), "must have rank 2"),
    ("rank 3", lambda p: p.prepare(torch.zeros(1, 1, 2, dtype=torch.int64)), "got rank 3"),
    ("not a tensor", lambda p: p.prepare([[1]]), "topk_ids must be a torch.Tensor, got list"),
    (
        "topk_ids on another device",
        lambda p: p.prepare(torch.zeros(1, 1, dtype=torch.int64, device="meta")),
        "topk_ids is on meta",
    ),
    (
        "unique_ids out of range",
        lambda p: p.prepare(ids([4]), unique_ids=[E]),
        f"unique_ids holds expert id {E}, outside [0, {E})",
    ),
    (
        "unique_ids -2",
        lambda p: p.prepare(ids([4]), unique_ids=[-1, -2]),
        f"unique_ids holds expert id -2, outside [0, {E}) (-1 is padding)",
    ),
    (
        "unique_ids duplicates",
        lambda p: p.prepare(ids([4, 5]), unique_ids=[4, 4]),
        "unique_ids names expert 4 more than once",
    ),
    (
        "unique_ids unrouted",
        lambda p: p.prepare(ids([4]), unique_ids=[5]),
        "unique_ids names expert 5, which no entry of topk_ids routes to",
    ),
    (
        "unique_ids over capacity",
        lambda p: p.prepare(ids([4, 5, 6, 7]), unique_ids=[4, 5, 6, 7]),
        "prepare: 4 unique experts requested but capacity is 3",
    ),
    (
        "unique_ids float",
        lambda p: p.prepare(ids([4]), unique_ids=torch.tensor([4.0])),
        "unique_ids must have an integer dtype",
    ),
    ("invalidate -1", lambda p: p.invalidate(-1), f"invalidate: expert id -1 outside [0, {E})"),
    ("invalidate E", lambda p: p.invalidate(E), f"invalidate: expert id {E} outside [0, {E})"),
    ("invalidate bool", lambda p: p.invalidate(True), "expert_id must be an int, got True"),
    ("invalidate float", lambda p: p.invalidate(1.0), "expert_id must be an int, got 1.0"),  # type: ignore[arg-type]
]

DEVICE_SIDE = {
    message
    for name, _, message in BAD_CALLS
    if name.startswith(
        ("more unique", "one token", "topk_ids out", "topk_ids -2", "padding does", "unique_ids")
    )
}
"""Rejections the device planner cannot make on the host: it reads no ids there (they are
checked on the device, counted and raised by ``stats()``), serves a step in passes and takes no
``unique_ids``."""

WARMUP = [[0, 1], [1], [2, 3], [1, 3]]
FOLLOW_UP = [[4], [5, 0], [2], [6, 7], [3], [0, 4, 5], [1]]


def observe(kind: ProviderKind, p: Provider, last_map: torch.Tensor) -> tuple[object, ...]:
    """Counters, residency, the provider's private bookkeeping, the last map, every slot byte."""
    return (
        p.stats(),
        p.resident_experts(),
        kind.internals(p),
        last_map.tolist(),
        [raw(b).tolist() for b in buffers(p) if b is not None],
    )


@pytest.mark.parametrize(
    ("bad_call", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_rejected_call_changes_nothing(
    kind: ProviderKind, make: Make, bad_call: Callable[[Provider], object], message: str
) -> None:
    if kind.planner == "device" and message in DEVICE_SIDE:
        kind.host_only("ids are checked on the device, counted and raised by stats()")
    victim, twin = make(), make()
    for call in WARMUP:
        last_map = victim.prepare(ids(call)).expert_map
        twin_map = twin.prepare(ids(call)).expert_map
    victim.invalidate(2)
    twin.invalidate(2)
    before = observe(kind, victim, last_map)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        bad_call(victim)
    assert observe(kind, victim, last_map) == before
    # And the victim keeps behaving exactly like a twin that never saw the bad call.
    for call in FOLLOW_UP:
        last_map = victim.prepare(ids(call)).expert_map
        twin_map = twin.prepare(ids(call)).expert_map
        assert observe(kind, victim, last_map) == observe(kind, twin, twin_map), call


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"split": "rows"}, "split must be one of ['token', 'expert'], got 'rows'"),
        ({"capacity": 0}, "got capacity=0 with num_experts=8"),
        ({"capacity": -1}, "got capacity=-1 with num_experts=8"),
        ({"capacity": E + 1}, "got capacity=9 with num_experts=8"),
        ({"capacity": 2.0}, "capacity must be an int, got 2.0 (float)"),
        ({"w2_scale_2": None}, "w13_scale_2 was given without w2_scale_2"),
        ({"w13_scale_2": None}, "w2_scale_2 was given without w13_scale_2"),
        ({"w2_scale_2": torch.zeros(E - 1)}, "w2_scale_2 has E=7"),
        ({"w13_bias": None}, "w2_bias was given without w13_bias: per-expert biases"),
        ({"w2_bias": torch.zeros(E - 1, 2)}, "w2_bias has E=7"),
        ({"w2": torch.zeros(E - 1, 2, 4)}, "w2 has E=7"),
        ({"w13": torch.zeros(E, 4, 2, device="meta")}, "w13 is on meta"),
        ({"w13": torch.zeros(E)[:0]}, "expert sources disagree on the number of experts"),
        ({"share_sources": "yes"}, "share_sources must be a bool, got 'yes' (str)"),
    ],
)
def test_constructor_rejects(make: Make, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        make(**overrides)


# -- thread guard ----------------------------------------------------------------


def test_concurrent_call_from_another_thread_is_rejected(
    kind: ProviderKind, make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make()
    name = type(p).__name__
    inside, leave = threading.Event(), threading.Event()
    owner, attribute = kind.inside_prepare(p)
    original = getattr(owner, attribute)

    def slow(*args: object) -> None:
        inside.set()
        assert leave.wait(10)
        original(*args)

    monkeypatch.setattr(owner, attribute, slow)
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(p.prepare(ids([1]))))
    worker.start()
    try:
        assert inside.wait(10)
        before = p.stats()
        with pytest.raises(
            ConcurrentCallError,
            match=re.escape(
                f"{name}.invalidate called from another thread while {name}.prepare was running"
            ),
        ):
            p.invalidate(1)
        with pytest.raises(ConcurrentCallError, match=re.escape(f"{name}.prepare called")):
            p.prepare(ids([2]))
        assert p.stats() == before
    finally:
        leave.set()
        worker.join(10)
    # The rejected callers changed nothing; the first call completed normally.
    assert len(outcome) == 1
    assert p.resident_experts() == {1: 0}
    assert p.stats()["prepare_calls"] == 1
    p.invalidate(1)  # the guard is free again
    assert p.resident_experts() == {}


def test_reentry_from_the_same_thread_is_rejected_without_deadlock(
    kind: ProviderKind, make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make()
    owner, attribute = kind.inside_prepare(p)
    original = getattr(owner, attribute)
    errors: list[ConcurrentCallError] = []

    def reentrant(*args: object) -> None:
        with pytest.raises(ConcurrentCallError) as info:
            p.prepare(ids([2]))
        errors.append(info.value)
        original(*args)

    monkeypatch.setattr(owner, attribute, reentrant)
    result = p.prepare(ids([1]))
    assert len(errors) == 1 and "re-entered from the same thread" in str(errors[0])
    assert_serves(p, result.expert_map, {1})


def test_sequential_calls_from_many_threads_all_succeed(make: Make) -> None:
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
    assert p.resident_experts().keys() == set(range(E))


def test_guard_released_after_an_exception() -> None:
    guard = CallGuard("Provider")
    with pytest.raises(KeyError), guard("prepare"):
        raise KeyError("boom")
    with guard("invalidate"):
        pass


@pytest.mark.parametrize("layout", ["separate", "packed"])
def test_slot_check_finds_exactly_the_corrupted_slot(
    make: Make, kind: ProviderKind, layout: str
) -> None:
    """``slot_mismatches`` (the end-of-run audit of every resident slot): empty after real
    misses and evictions; names the one tensor of the one slot whose bytes were changed, and
    only that one."""
    if kind.name == "cached" and layout == "packed":
        pytest.skip("the cached baseline has the separate layout only")
    p = make(capacity=3, **({"layout": layout} if layout == "packed" else {}))
    for row in ([0, 1], [2, 5], [1, 6]):
        p.prepare(ids(row))
    resident = p.resident_experts()
    assert len(resident) == 3 and p.slot_mismatches(resident) == []
    expert, slot = sorted(resident.items())[1]
    with torch.no_grad():
        row = p.buf_w2[slot]  # bf16 [2, 4]: a strided view when packed
        row[1, 2] = -row[1, 2]  # the sign bit of one element
    assert p.slot_mismatches(resident) == [f"expert {expert} slot {slot}: w2"]
    # Told another expert sits in that slot: every present tensor differs.
    other = {next(e for e in range(E) if e not in resident): slot}
    found = p.slot_mismatches(other)
    assert found and all(m.startswith(f"expert {next(iter(other))} slot {slot}: ") for m in found)

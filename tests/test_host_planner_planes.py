"""The host planner with w13 and w2 held as bf16 planes (``HostPlannedProvider(compress=True)``),
on the CPU backend: its copy step decodes each miss into its slot (a GPU decodes it by one launch
a miss and source on the copy stream, ``tests/cuda/test_row_provider_cuda.py``), so that every
slot holds every bit of its expert, the bookkeeping and maps are the raw-byte provider's call for
call, the host holds less than three quarters of the bytes, a wrong decode is caught by the
audit, and settings the format cannot take are refused before anything is built."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compressed_sources import C, E, weights

import rowcache.backends.cpu as cpu_backend
from rowcache import HostPlannedProvider, InvalidInputError, RowCacheWeightProvider


def provider(w: dict[str, torch.Tensor], **kwargs: Any) -> HostPlannedProvider:
    built = RowCacheWeightProvider(**w, capacity=C, device="cpu", **kwargs)
    assert isinstance(built, HostPlannedProvider)
    return built


routes = st.lists(
    st.lists(st.integers(0, E - 1), min_size=1, max_size=C, unique=True), min_size=1, max_size=12
)


@settings(max_examples=25, deadline=None)
@given(calls=routes, invalidations=st.lists(st.integers(0, E - 1), max_size=3))
def test_every_slot_holds_its_expert_s_bits_and_the_bookkeeping_is_the_raw_provider_s(
    calls: list[list[int]], invalidations: list[int]
) -> None:
    w = weights()
    planes, raw = provider(w, compress=True), provider(w)
    for index, route in enumerate(calls):
        maps = []
        for p in (planes, raw):
            maps.append(p.prepare(torch.tensor([route])).expert_map.clone())
            if index < len(invalidations):
                p.invalidate(invalidations[index])
        assert torch.equal(maps[0], maps[1])
        assert planes.resident_experts() == raw.resident_experts()
        assert planes.lru_order() == raw.lru_order()
        for expert, slot in planes.resident_experts().items():
            for name in ("w13", "w2"):
                held = getattr(planes, f"buf_{name}")[slot].view(torch.int16)
                assert torch.equal(held, w[name][expert].view(torch.int16)), (expert, name)
        assert planes.slot_mismatches(planes.resident_experts()) == []
    # Every counter the raw-byte provider's; only the host bytes differ.
    planes_stats, raw_stats = planes.stats(), raw.stats()
    assert planes_stats.pop("host_bytes") < raw_stats.pop("host_bytes")
    assert planes_stats == raw_stats


def test_the_host_holds_less_than_three_quarters_of_the_bytes() -> None:
    w = weights()
    planes, raw = provider(w, compress=True), provider(w)
    assert set(planes._sources.planes) == {"w13", "w2"}
    bf16 = w["w13"].nbytes + w["w2"].nbytes
    scales = w["w13_scale"].nbytes + w["w2_scale"].nbytes
    assert raw.stats()["host_bytes"] == bf16 + scales
    assert planes.stats()["host_bytes"] - scales < 0.75 * bf16


def test_a_wrong_decode_is_caught_by_the_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cpu_backend.decode_experts

    def sign_dropped(planes: Any, experts: Any) -> torch.Tensor:  # a seeded bug
        return real(planes, experts).abs()

    monkeypatch.setattr(cpu_backend, "decode_experts", sign_dropped)
    p = provider(weights(), compress=True)
    p.prepare(torch.tensor([[0, 5]]))
    wrong = p.slot_mismatches(p.resident_experts())
    assert sorted(wrong) == [
        "expert 0 slot 0: w13",
        "expert 0 slot 0: w2",
        "expert 5 slot 1: w13",
        "expert 5 slot 1: w2",
    ]


def test_settings_the_format_cannot_take_are_refused() -> None:
    w = weights()
    with pytest.raises(InvalidInputError, match="compress must be a bool, got 1"):
        provider(w, compress=1)
    with pytest.raises(InvalidInputError, match="compress=True holds w13 and w2 as bf16 planes"):
        provider(w, compress=True, layout="packed")
    floats = {**w, "w13": w["w13"].float(), "w2": w["w2"].float()}
    with pytest.raises(InvalidInputError, match="compress=True holds bf16 w13 and w2"):
        provider(floats, compress=True)

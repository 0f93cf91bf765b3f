"""The start-up line of what the cache holds where (``rowcache.vllm.memory_line``), from the
providers' own stats."""

from __future__ import annotations

import pytest
import torch

from rowcache.row_provider import RowCacheWeightProvider
from rowcache.vllm import memory_line
from rowcache.vllm.memory_line import note_layer, take_line

E, HIDDEN, INTER = 16, 64, 32


def provider(compress: bool) -> RowCacheWeightProvider:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, HIDDEN, INTER, generator=g).to(torch.bfloat16)
    return RowCacheWeightProvider(w13, w2, capacity=4, device="cpu", compress=compress)


def test_the_line_sums_every_layer_noted_then_starts_again() -> None:
    take_line(planes=False)  # whatever earlier tests noted
    stats = [
        {"capacity": 4, "slot_bytes": 4 * 3 * 2**27, "host_bytes": 16 * 3 * 2**27} for _ in range(8)
    ]
    for s in stats:
        note_layer(s, num_experts=16)
    line = take_line(planes=False)
    assert line == (
        "rowcache: 8 MoE layers cached, 4 of 16 experts a layer in slots: 12.00 GiB of the "
        "experts' 48.00 GiB on the GPU; 48.00 GiB held in pinned host memory (1.00 of the "
        "experts' bytes)"
    )
    assert take_line(planes=False) is None  # said once: a new tally


def test_planes_say_their_share_of_the_bytes() -> None:
    take_line(planes=False)
    raw, planes = provider(compress=False), provider(compress=True)
    note_layer(planes.stats(), num_experts=E)
    line = take_line(planes=True)
    assert line is not None
    ratio = planes.stats()["host_bytes"] / raw.stats()["host_bytes"]
    assert f"({ratio:.2f} of the experts' bytes, as bf16 planes)" in line
    assert "1 MoE layer cached, 4 of 16 experts a layer" in line


def test_layers_of_different_sizes_are_given_as_a_range() -> None:
    take_line(planes=False)
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64)
    note_layer({"capacity": 16, "slot_bytes": 16 * 2**20, "host_bytes": 64 * 2**20}, 64)
    line = take_line(planes=False)
    assert line is not None and "8 to 16 of 64 experts a layer" in line


def test_pinned_memory_left_from_loading_is_called_a_leak() -> None:
    """Transient slabs still held once every layer is built are memory nothing will free: the
    line says how much; none, and it says nothing of it."""
    take_line(planes=False)
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64)
    line = take_line(planes=True, load_time_bytes=2 * 2**30)
    assert line is not None and line.endswith(
        "; 2.00 GiB of pinned memory from loading the checkpoint still held (expected none: a leak)"
    )
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64)
    line = take_line(planes=True, load_time_bytes=0)
    assert line is not None and "loading" not in line


def test_the_set_up_time_is_the_pinning_since_the_last_line_and_the_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process's pinning seconds are a running total: each line gives those since the call
    before (a second engine in the process gets its own), beside the builds it noted."""
    monkeypatch.setattr(memory_line, "_pinning_mark", 0.0)  # the process's mark, put back after
    take_line(planes=False, pinning_seconds=100.0)  # a line before: the mark
    for _ in range(2):
        note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64, 1.25)
    line = take_line(planes=False, pinning_seconds=110.0)
    assert line is not None and line.endswith(
        "(1.00 of the experts' bytes); set-up 12.5 s: 10.0 s pinning host memory, "
        "2.5 s building the providers"
    )
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64, 0.5)
    line = take_line(planes=True, load_time_bytes=2**30, pinning_seconds=113.0)
    assert line is not None and line.endswith(
        "; set-up 3.5 s: 3.0 s pinning host memory, 0.5 s building the providers"
        "; 1.00 GiB of pinned memory from loading the checkpoint still held (expected none: a leak)"
    )
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64, 0.5)
    line = take_line(planes=False)
    assert line is not None and "set-up" not in line  # no times given, none said
    # The other layers' first forwards take no line but move the mark: the next engine's line
    # counts only what was pinned after them.
    assert take_line(planes=False, pinning_seconds=120.0) is None
    note_layer({"capacity": 8, "slot_bytes": 8 * 2**20, "host_bytes": 64 * 2**20}, 64, 0.5)
    line = take_line(planes=False, pinning_seconds=121.0)
    assert line is not None and line.endswith(
        "; set-up 1.5 s: 1.0 s pinning host memory, 0.5 s building the providers"
    )

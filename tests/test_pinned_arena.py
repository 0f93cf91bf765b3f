"""The arena of pinned slabs (``rowcache.pinned``), over plain host memory (no GPU here): every
view in bounds, aligned and disjoint from the others, slabs reused while they have room, freed
once nothing views them, and bad input refused."""

from __future__ import annotations

import gc
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rowcache.pinned as pinned
from rowcache.errors import InvalidInputError
from rowcache.pinned import ALIGN, PinnedArena

made: list[int] = []


def plain(nbytes: int) -> torch.Tensor:
    """Plain host memory, aligned like the pinned allocator's (pages)."""
    made.append(nbytes)
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes]


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.int64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(DTYPES)), min_size=1, max_size=25))
def test_views_are_in_bounds_aligned_and_disjoint(requests: list[tuple[int, torch.dtype]]) -> None:
    made.clear()
    arena = PinnedArena(slab_bytes=4096, allocate=plain)
    views = [arena.empty((n,), dtype) for n, dtype in requests]
    for view, (n, dtype) in zip(views, requests, strict=True):
        assert view.shape == (n,) and view.dtype == dtype and view.is_contiguous()
        if n:
            assert view.data_ptr() % ALIGN == 0
    spans = sorted(span(v) for v in views if v.numel())
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start  # no two views share a byte
    # Writes to one view never show in another.
    for index, view in enumerate(views):
        view.view(torch.uint8).fill_(index % 251)
    for index, view in enumerate(views):
        assert bool((view.view(torch.uint8) == index % 251).all())
    # Slabs are powers of two, at least the slab size: none is rounded up by torch again.
    assert all(size >= 4096 and size & (size - 1) == 0 for size in made)


def test_small_requests_share_a_slab_and_a_large_one_takes_twice_its_power_of_two() -> None:
    made.clear()
    arena = PinnedArena(slab_bytes=4096, allocate=plain)
    a = arena.empty((1000,), torch.uint8)
    b = arena.empty((100,), torch.float32)
    assert made == [4096] and b.data_ptr() == a.data_ptr() + 1024  # aligned after a
    big = arena.empty((3, 1000), torch.bfloat16)  # 6,000 bytes: a 16 KiB slab
    assert made == [4096, 16384]
    assert arena.empty((2000,), torch.uint8).data_ptr() == a.data_ptr() + 1536  # first fit
    tail = arena.empty((9000,), torch.uint8)  # fits only the 16 KiB slab's tail
    assert made == [4096, 16384] and tail.data_ptr() == big.data_ptr() + 6144
    assert arena.reserved_bytes == 4096 + 16384


def test_a_slab_nothing_views_is_let_go() -> None:
    made.clear()
    arena = PinnedArena(slab_bytes=8192, allocate=plain)
    a = arena.empty((4000,), torch.uint8)  # an 8 KiB slab
    keep = arena.empty((5000,), torch.uint8)  # not in its tail: a 16 KiB slab
    assert made == [8192, 16384]
    del a
    gc.collect()
    arena.empty((10,), torch.uint8)  # the next request lets the first slab go
    assert arena.reserved_bytes == 16384
    assert keep.numel() == 5000


def test_bad_input_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="power of two >= 512, got 1000"):
        PinnedArena(slab_bytes=1000, allocate=plain)
    arena = PinnedArena(slab_bytes=4096, allocate=plain)
    with pytest.raises(InvalidInputError, match=r"must not be negative, got \(2, -1\)"):
        arena.empty((2, -1), torch.uint8)
    assert arena.reserved_bytes == 0
    assert arena.empty((0, 5), torch.float32).shape == (0, 5)


def test_slabs_and_empty_views_are_host_memory_under_another_default_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM creates a model's weights under ``with torch.device("cuda")``, where torch makes an
    # unnamed pinned request on the default device and refuses it. Emulated here with torch's
    # rule and the meta device (no GPU here): the arena's own allocation names the host.
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        device = torch.device(kwargs.get("device") or torch.get_default_device())
        if pin_memory and device.type != "cpu":
            raise RuntimeError("Only dense CPU tensors can be pinned")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with torch.device("meta"):
        arena = PinnedArena(slab_bytes=4096)
        view = arena.empty((100,), torch.bfloat16)
        nothing = arena.empty((0, 3), torch.float32)
    assert view.device.type == "cpu" and nothing.device.type == "cpu"
    assert arena.reserved_bytes == 4096


def test_collect_lets_go_of_slabs_nothing_views_and_keeps_the_others() -> None:
    made.clear()
    arena = PinnedArena(slab_bytes=4096, allocate=plain)
    first = [arena.empty((1500,), torch.uint8) for _ in range(2)]  # one 4 KiB slab
    kept = arena.empty((2000,), torch.uint8)  # not in its tail: a second slab
    assert made == [4096, 4096]
    arena.collect()
    assert arena.reserved_bytes == 8192  # everything still viewed
    del first[0]
    gc.collect()
    arena.collect()
    assert arena.reserved_bytes == 8192  # one view of the first slab is left
    first.clear()
    gc.collect()
    arena.collect()
    assert arena.reserved_bytes == 4096 and kept.numel() == 2000


def test_transient_tensors_come_from_their_own_arena_and_are_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transient = PinnedArena(slab_bytes=4096, allocate=plain)
    monkeypatch.setattr(pinned, "_TRANSIENT", transient)
    lasting = pinned._ARENA
    views = [pinned.pinned_empty_transient((500,), torch.bfloat16) for _ in range(3)]
    assert transient.reserved_bytes == 4096 and pinned._ARENA is lasting  # not the lasting one
    views.clear()
    gc.collect()
    pinned.collect_transient()
    assert transient.reserved_bytes == 0


def test_without_torch_s_use_count_transient_tensors_are_torch_s_own_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An arena could not tell a slab free: a slab would stay pinned for the process's life.
    asked: list[dict[str, Any]] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(kwargs)
        return real_empty(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    monkeypatch.setattr(pinned, "releases_slabs", lambda: False)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(pinned, "_TRANSIENT", None)
    t = pinned.pinned_empty_transient((7,), torch.float32)
    assert t.shape == (7,) and asked == [
        {"dtype": torch.float32, "device": "cpu", "pin_memory": True}
    ]
    assert pinned._TRANSIENT is None


def test_slabs_are_released_only_with_both_of_torch_s_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert pinned.releases_slabs()  # this torch has both
    real = pinned.lookup
    for missing in (pinned.STORAGE_USE_COUNT, pinned.STORAGE_CDATA):
        monkeypatch.setattr(
            pinned, "lookup", lambda seam, m=missing: None if seam is m else real(seam)
        )
        assert not pinned.releases_slabs()


def test_pinned_requests_count_their_host_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pinned request (a slab's, or a transient tensor torch holds itself) adds the host
    time it took to ``pinning_seconds``, a failed one too; nothing else does."""
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(pinned, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(pinned, "_pinning_seconds", 0.0)  # the process's total, put back after
    asked: list[tuple[tuple[int, ...], bool]] = []

    def fake_empty(shape: Any, *, dtype: torch.dtype, device: str, pin_memory: bool) -> Any:
        asked.append((tuple(shape), pin_memory))
        if shape == (7,):
            raise RuntimeError("out of pinned memory")
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(pinned.torch, "empty", fake_empty)
    before = pinned.pinning_seconds()
    slab = pinned._pinned_bytes(1024)
    assert slab.numel() == 1024 and pinned.pinning_seconds() - before == 2.5
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        pinned._pinned((7,), torch.uint8)
    assert pinned.pinning_seconds() - before == 2.75
    assert asked == [((1024,), True), ((7,), True)]


def test_a_timed_block_counts_as_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timed_pinning`` (the plugin's release of the load-time blocks) adds its block's host
    time, an exception's too, which it lets through."""
    ticks = iter([1.0, 4.0, 5.0, 5.5])
    monkeypatch.setattr(pinned, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(pinned, "_pinning_seconds", 0.0)
    with pinned.timed_pinning():
        pass
    assert pinned.pinning_seconds() == 3.0
    with pytest.raises(ValueError, match="inside"), pinned.timed_pinning():
        raise ValueError("inside")
    assert pinned.pinning_seconds() == 3.5

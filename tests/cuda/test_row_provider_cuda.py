"""RowCacheWeightProvider on a CUDA device: construction, data across streams, a slow eager
reader, and the host never blocking behind queued consumer work."""

from __future__ import annotations

import time

import pytest
import torch
from cuda_support import (
    BIG,
    ExpertData,
    consumer_streams,
    cycles_for_ms,
    gpu_sleep,
    idle_mismatches,
    sanitizer_enabled,
    slot_tensors,
)
from mutant_provider import install

from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import CudaBackend
from rowcache.packing import Layout

pytestmark = pytest.mark.cuda

E = 8
_DATA: list[ExpertData] = []


def data() -> ExpertData:
    if not _DATA:
        _DATA.append(ExpertData(E, BIG, seed=4))
    return _DATA[0]


def test_picks_the_cuda_backend_pins_sources_and_keeps_buffer_addresses() -> None:
    p = data().provider(3)
    assert isinstance(p.backend, CudaBackend)
    assert p.backend.call_log is None  # logging is off unless asked for
    assert p.buf_w13.is_cuda and p.backend.forward_map.is_cuda
    assert all(t.is_pinned() for t in data().host.values())
    before = [t.data_ptr() for t in slot_tensors(p)]
    for call in ([0, 1, 2], [3, 4], [5, 6, 7], [0]):
        p.prepare(torch.tensor([call]))
    assert [t.data_ptr() for t in slot_tensors(p)] == before


@pytest.mark.parametrize(
    ("layout", "compress", "copy"),
    [
        ("separate", False, "batched"),
        ("packed", False, "batched"),
        # w13 and w2 held as planes: decoded into the slots on the copy stream in the copy step,
        # beside the copies of the other four, one launch a miss and source.
        ("separate", True, "batched"),
        ("separate", True, "per_tensor"),
    ],
)
def test_data_across_streams_owner_changes_and_invalidate(
    layout: Layout, compress: bool, copy: str
) -> None:
    d = data()
    backend = CudaBackend("cuda", copy=copy)  # type: ignore[arg-type]
    p = d.provider(3, backend=backend, layout=layout, compress=compress)
    # Packed: one batch entry per miss (all six tensors in one range); separate: one per tensor
    # copied (four with planes).
    assert isinstance(p.backend, CudaBackend)
    if copy == "batched":
        assert p.backend.ranges_per_miss == (1 if layout == "packed" else 4 if compress else 6)
    streams = consumer_streams(2)
    calls = [[0, 1], [1, 2], [3], [4, 5, 0], [6], [2, 7], [0], [5, 6, 7], [1, 2, 3]]
    for i, call in enumerate(calls):
        with torch.cuda.stream(streams[i % 2]):
            p.prepare(torch.tensor([call]))
            if i % 3 == 2:
                p.invalidate(call[0])
                p.prepare(torch.tensor([call]))
        torch.cuda.synchronize()
        forward = p.backend.forward_map.tolist()
        assert sorted(e for e, s in enumerate(forward) if s >= 0) == sorted(call)
        pairs = [(e, s) for e, s in enumerate(forward) if s >= 0]
        wrong = d.mismatches(f"call {i}", slot_tensors(p), pairs)
        wrong += idle_mismatches(f"call {i}", p, d)
        assert not wrong, "\n".join(wrong)
    stats = p.stats()
    assert stats["owner_changes"] >= len(calls) - 1
    assert stats["evictions"] > 0 and stats["invalidations"] == 3


def slow_reader_rounds(p: RowCacheWeightProvider) -> list[bool]:
    """An eager read held back on stream A, then a prepare on stream B that evicts its slot:
    for each round, whether the read still saw the old expert. Round 0 is also where the
    provider's pinned staging rings grow; a page-locked allocation between two launches on
    different streams keeps them from overlapping (CUDA's implicit synchronization), which
    may order even a mutant's copy behind the reader there."""
    a, b = consumer_streams(2)
    # Warm the caching allocator on both streams first: a fresh device allocation (cudaMalloc)
    # between two launches on different streams keeps them from running concurrently (CUDA's
    # implicit synchronization), which would order the mutant's copy behind the reader.
    for s in (a, b):
        with torch.cuda.stream(s):
            slot = p.backend.forward_map[0:1].to(torch.int64).clamp(min=0)
            p.buf_w13.index_select(0, slot)
    torch.cuda.synchronize()
    seen = []
    for round_ in range(6):
        e = round_ % E
        with torch.cuda.stream(a):
            result = p.prepare(torch.tensor([[e]]))
            gpu_sleep(cycles_for_ms(30))
            # Indexed on the device: a host-side index (.item()) would wait for the sleep. The
            # clamp keeps a broken schedule (a map already rewritten to -1) from asserting.
            slot = result.expert_map[e : e + 1].to(torch.int64).clamp(min=0)
            seen.append(result.w1.index_select(0, slot)[0])
        with torch.cuda.stream(b):
            p.prepare(torch.tensor([[(round_ + 1) % E]]))
    torch.cuda.synchronize()
    src = data().device["w13"]
    return [torch.equal(got, src[r % E]) for r, got in enumerate(seen)]


@pytest.mark.parametrize("compress", [False, True], ids=["bytes", "planes"])
def test_a_slow_eager_reader_is_never_overwritten(compress: bool) -> None:
    # Planes: the decode into the evicted slot waits for the reader as a copy does.
    assert all(slow_reader_rounds(data().provider(1, compress=compress)))


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("compress", [False, True], ids=["bytes", "planes"])
def test_without_the_release_wait_the_slow_eager_reader_is_overwritten(compress: bool) -> None:
    rounds = slow_reader_rounds(install(data().provider(1, compress=compress), "no_release_wait"))
    assert not any(rounds[1:]), rounds  # round 0 warms the staging rings (see above)


def test_prepare_and_invalidate_never_block_on_consumer_work() -> None:
    """On the default stream, behind 300 ms of queued GPU work (topk_ids on the host: a GPU
    topk_ids costs a device-to-host read in validation, which is not the schedule)."""
    slowdown = 10 if sanitizer_enabled() else 1  # the sanitizer's per-op host cost
    p = data().provider(2)
    p.prepare(torch.tensor([[0, 1]]))
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    gpu_sleep(cycles_for_ms(300 * slowdown))
    start = time.perf_counter()
    for e in range(2, 8):
        p.prepare(torch.tensor([[e]]))
        p.invalidate(e)
    host = time.perf_counter() - start
    assert not stream.query(), "the sleep finished already: the test proves nothing"
    torch.cuda.synchronize()
    print(f"6 prepares and 6 invalidates behind queued GPU work: {host * 1e3:.2f} ms host")
    assert host < 0.1 * slowdown, f"host blocked for {host:.3f} s"

"""The arena of pinned slabs on a GPU: its views are pinned, a GPU copies them as it copies any
pinned tensor (asynchronously), and torch's host allocator pins the slabs' bytes,
not each request rounded up to a power of two."""

from __future__ import annotations

import torch

from rowcache.pinned import PinnedArena
from rowcache.torch_seams import HOST_EMPTY_CACHE, lookup


def test_views_are_pinned_and_read_by_the_gpu_exactly() -> None:
    arena = PinnedArena(slab_bytes=1 << 20)
    views = [arena.empty((n,), torch.bfloat16) for n in (1000, 77, 300_000, 5)]
    for index, view in enumerate(views):
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).mul(index + 1))
        assert view.is_pinned()
        assert torch.equal(view.to("cuda", non_blocking=True).cpu(), view)


def test_the_host_allocator_pins_the_slabs_bytes() -> None:
    # Three 300 MiB tensors: 1.5 GiB pinned one by one (each rounded up to 512 MiB), one
    # 1 GiB slab from the arena.
    # Active bytes: the blocks in use, each as large as torch made it (a cached block reused
    # counts at its own size too).
    # Blocks freed with copies pending (the test before) count as active until torch next
    # looks at their events: let it look now, not while the arena allocates.
    torch.cuda.synchronize()
    empty = lookup(HOST_EMPTY_CACHE)
    if empty is not None:
        empty()
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    arena = PinnedArena()
    views = [arena.empty((300 << 20,), torch.uint8) for _ in range(3)]
    after = torch.cuda.host_memory_stats()["active_bytes.current"]
    # Within a MiB: other tests' small pinned blocks may come and go meanwhile (on the H200,
    # 2026-12-04, one byte more than the slab); torch's rounding would be 512 MiB more.
    assert 1 << 30 <= after - before < (1 << 30) + (1 << 20)
    assert all(v.is_pinned() for v in views)


def test_views_are_pinned_host_memory_under_a_cuda_default_device() -> None:
    # As vLLM creates a model's weights: ``with torch.device("cuda")`` around create_weights.
    with torch.device("cuda"):
        arena = PinnedArena(slab_bytes=1 << 20)
        view = arena.empty((1000,), torch.bfloat16)
        nothing = arena.empty((0,), torch.bfloat16)
    assert view.device.type == "cpu" and view.is_pinned()
    assert nothing.device.type == "cpu"


def test_a_collected_slab_goes_back_to_the_driver() -> None:
    # The transient arena's path at load: the views die with their layer, collect() lets go
    # of the slab, and emptying torch's host cache unpins it.
    import gc

    from rowcache.torch_seams import HOST_EMPTY_CACHE, lookup

    empty_cache = lookup(HOST_EMPTY_CACHE)
    assert empty_cache is not None
    empty_cache()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    arena = PinnedArena()
    views = [arena.empty((300 << 20,), torch.uint8) for _ in range(3)]
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    assert held - before >= 1 << 30
    views.clear()
    gc.collect()
    arena.collect()
    empty_cache()
    after = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    assert arena.reserved_bytes == 0 and after <= before + (1 << 20)


def test_a_view_inside_a_slab_has_its_own_device_address() -> None:
    # vLLM's UVA view of a host tensor (``get_cuda_view_from_cpu_tensor``, how the plugin
    # registers its host parameters) asks cudaHostGetDevicePointer for the tensor's own data
    # pointer, which for an arena's view lies inside a slab, not at its start: the driver must
    # map it (with unified addressing, to the same address).
    import importlib

    runtime = importlib.import_module("cuda.bindings.runtime")
    arena = PinnedArena(slab_bytes=1 << 20)
    first = arena.empty((1000,), torch.uint8)
    inside = arena.empty((4096,), torch.float32)
    assert inside.data_ptr() == first.data_ptr() + 1024  # inside the slab, not at its start
    error, device_pointer = runtime.cudaHostGetDevicePointer(inside.data_ptr(), 0)
    assert error == runtime.cudaError_t.cudaSuccess, error
    assert int(device_pointer) == inside.data_ptr()

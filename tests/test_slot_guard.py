"""Slot buffers start zeroed and are followed by zero bytes (``rowcache.sources``'
``SLOT_GUARD_BYTES``): a kernel that loads a little past a row (triton_kernels' MXFP4 matmul
on Hopper reads 64 bytes past each weight-scale row) finds zeros, not what the allocator left
there, in slots no miss has filled and past the last slot; both layouts, both planners, and
still after misses fill every slot."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_packing import nvfp4_like

from rowcache import RowCacheWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.sources import SLOT_GUARD_BYTES, SOURCE_NAMES, guarded_empty

E, C = 9, 4


def _storage_bytes(buf: torch.Tensor) -> torch.Tensor:
    """Every byte of ``buf``'s storage, as uint8."""
    return torch.tensor([], dtype=torch.uint8).set_(buf.untyped_storage())


def _end(buf: torch.Tensor) -> int:
    """The byte offset in its storage just past ``buf``'s last element."""
    last = buf.storage_offset() + (buf.shape[0] - 1) * buf.stride(0) + buf[-1].numel()
    return last * buf.element_size()


def test_a_guarded_buffer_is_zero_and_runs_past_its_end_in_zeros() -> None:
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        buf = guarded_empty((3, 5), dtype, torch.device("cpu"))
        assert buf.shape == (3, 5) and buf.dtype == dtype and buf.is_contiguous()
        assert not buf.view(torch.uint8).any()
        tail = _storage_bytes(buf)[_end(buf) :]
        assert tail.numel() >= SLOT_GUARD_BYTES and not tail.any()


@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("kind", ["host", "device"])
def test_slots_start_zeroed_and_stay_guarded_after_misses(layout: str, kind: str) -> None:
    cls: Any = DevicePlannedProvider if kind == "device" else RowCacheWeightProvider
    provider = cls(**nvfp4_like(E), capacity=C, device="cpu", layout=layout)
    bufs = {n: getattr(provider, f"buf_{n}") for n in SOURCE_NAMES}
    for name, buf in bufs.items():
        assert not buf.contiguous().view(torch.uint8).any(), name  # no miss yet: zeros
    with torch.inference_mode():
        for first in range(0, E, 2):
            provider.prepare(torch.tensor([[first, (first + 1) % E]]))
    for name, buf in bufs.items():
        assert buf.contiguous().view(torch.uint8).any(), name  # the misses filled slots
    # Packed sources are views of one storage: its guard follows the last view's end.
    shared = bufs["w13"].untyped_storage().data_ptr()
    packed_end = max(_end(b) for b in bufs.values() if b.untyped_storage().data_ptr() == shared)
    for name, buf in bufs.items():
        end = packed_end if layout == "packed" else _end(buf)
        tail = _storage_bytes(buf)[end:]
        assert tail.numel() >= SLOT_GUARD_BYTES and not tail.any(), name

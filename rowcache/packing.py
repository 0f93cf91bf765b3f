"""The packed slot layout: every tensor of one expert (one slot) in one contiguous byte range.

Why: a miss copies one row of each per-expert tensor. NVFP4 experts have six (weights, block
scales, and two 4-byte global scales), and on the H200 a batched copy with one entry per tensor
per miss reaches about 79% of the pinned ceiling where one entry per expert of the same bytes
reaches 98% (``tools/probe_copy_entries.py``; each entry costs the copy engine a few
microseconds whatever its size). With ``layout="packed"`` the provider keeps its sources in one
pinned host buffer ``[E, P]`` and its slots in one device buffer ``[capacity, P]`` of bytes,
and every tensor is a strided view into them, so a miss is one range of P bytes on both sides.

Each tensor's row starts at a multiple of ``PACK_ALIGN`` bytes inside the range, which keeps
every view aligned for its dtype and for vectorized loads (FP8 experts: float8_e4m3fn weights
and float32 scales, four tensors, one range). The views are not contiguous: their
first stride is ``P / element size`` elements, the other strides are those of a contiguous row.
A kernel that takes strides (vLLM's Triton MoE kernels read ``w.stride(0)``, and FP8 block
scales through their strides) reads them as they are; one that assumes contiguous
``[capacity, ...]`` buffers needs the default layout: so does vLLM's per-tensor FP8 scale
``[capacity]``, which its Triton kernel reads as ``b_scale_ptr + slot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.pinned import pinned_empty_exact

__all__ = ["LAYOUTS", "PACK_ALIGN", "Layout", "check_layout", "pack_offsets", "packed_views"]

Layout = Literal["separate", "packed"]
LAYOUTS: tuple[Layout, ...] = ("separate", "packed")
"""``separate``: one contiguous ``[capacity, ...]`` buffer per tensor (the default);
``packed``: one byte range per slot holding all of its tensors."""

PACK_ALIGN = 256
"""Byte alignment of every tensor's row inside a packed range (and of the range's size)."""


def check_layout(layout: object) -> Layout:
    for known in LAYOUTS:
        if layout == known:
            return known
    raise InvalidInputError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")


def _aligned(size: int) -> int:
    return -(-size // PACK_ALIGN) * PACK_ALIGN


def _row_bytes(t: Tensor) -> int:
    return t[0].numel() * t.element_size() if t.shape[0] > 0 else 0


def pack_offsets(templates: Sequence[Tensor | None]) -> tuple[list[int], int]:
    """Byte offset of each present template's row inside a packed range (-1 where absent),
    and the range's size P. Templates are expert-major ``[E, ...]`` tensors."""
    offsets: list[int] = []
    at = 0
    for t in templates:
        if t is None:
            offsets.append(-1)
            continue
        offsets.append(at)
        at += _aligned(_row_bytes(t))
    return offsets, max(at, PACK_ALIGN)


def packed_views(
    storage: Tensor, templates: Sequence[Tensor | None], offsets: Sequence[int]
) -> list[Tensor | None]:
    """Views of the uint8 ``storage [N, P]``, one per template: rows shaped like the
    template's rows, with its dtype, at its offset (None where the template is None)."""
    rows = storage.shape[0]
    views: list[Tensor | None] = []
    for t, offset in zip(templates, offsets, strict=True):
        if t is None:
            views.append(None)
            continue
        size = _row_bytes(t)
        # A byte slice per row, reinterpreted as the dtype (its offset and P are multiples of
        # PACK_ALIGN, so every element is aligned), then its last dimension split into the row.
        view = storage[:, offset : offset + size].view(t.dtype).view(rows, *t.shape[1:])
        views.append(view)
    return views


def packed_storage(
    num_rows: int, size: int, *, device: torch.device, pin_memory: bool = False
) -> Tensor:
    """A uint8 buffer ``[num_rows, size]`` (pinned host memory when ``pin_memory``: the
    arena's exact bytes, since the packed sources live as long as their provider)."""
    if pin_memory:
        return pinned_empty_exact((num_rows, size), torch.uint8)
    return torch.empty((num_rows, size), dtype=torch.uint8, device=device)

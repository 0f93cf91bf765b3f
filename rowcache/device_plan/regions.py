"""The byte ranges a miss copies, read off the sources and the slot buffers once.

A region is one per-expert tensor (``separate`` layout) or the whole packed range of an expert
(``packed`` layout): the row of expert ``e`` starts at ``src_ptr + e * src_stride`` on the host
and the row of slot ``s`` at ``dst_ptr + s * dst_stride`` on the device, both ``row_bytes``
long and contiguous. The gather copies exactly those bytes for every miss, nothing else.

``chunk_table`` cuts every region into pieces of at most ``CHUNK_BYTES`` for the fused gather:
one work item is one (miss, piece), and a piece is copied in 8-byte words when its addresses
allow it (``wide``), in bytes otherwise (the 4-byte NVFP4 global scales and FP8 per-tensor
scales of the separate layout, and FP8 block-scale rows whose size is not a multiple of 8:
``ceil(H/128) * ceil(I/128) * 4`` bytes for w2 with an odd product). vLLM's block-scaled FP8
expert at Qwen3-30B-A3B shapes is all words: 3 MiB and 1.5 MiB of e4m3 weights, 768- and
384-byte float32 scale rows (``tests/test_fp8_slots.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.sources import SOURCE_NAMES, ExpertSources, SlotBuffers

__all__ = ["CHUNK_BYTES", "Region", "chunk_table", "copy_regions"]

CHUNK_BYTES = 16 * 1024
"""Largest piece one work item of the fused gather copies (one load per work item)."""

WORD = 8


@dataclass(frozen=True)
class Region:
    name: str
    src_ptr: int
    src_stride: int
    dst_ptr: int
    dst_stride: int
    row_bytes: int


def _row_bytes(t: Tensor) -> int:
    return t[0].numel() * t.element_size() if t.shape[0] else 0


def _region(name: str, src: Tensor, dst: Tensor) -> Region:
    size = _row_bytes(src)
    for side, t in (("source", src), ("slot buffer", dst)):
        if t.shape[0] and not t[0].is_contiguous():
            raise InvalidInputError(
                f"the device planner copies contiguous rows, but the {side} {name} has "
                f"strides {t.stride()} for shape {tuple(t.shape)}"
            )
    return Region(
        name=name,
        src_ptr=src.data_ptr(),
        src_stride=src.stride(0) * src.element_size(),
        dst_ptr=dst.data_ptr(),
        dst_stride=dst.stride(0) * dst.element_size(),
        row_bytes=size,
    )


def copy_regions(sources: ExpertSources, slots: SlotBuffers) -> list[Region]:
    """The regions of these sources and slots: one packed range, or one per present tensor
    that a miss copies as bytes (not those held as bf16 planes, which a miss decodes)."""
    if sources.pack is not None:
        _, size = sources.pack
        src_base = sources.w13.untyped_storage().data_ptr()
        dst_base = slots.w13.untyped_storage().data_ptr()
        return [Region("packed", src_base, size, dst_base, size, size)]
    return [
        _region(name, src, dst)
        for name, src, dst in zip(SOURCE_NAMES, sources.copied(), slots.tensors(), strict=True)
        if src is not None and dst is not None
    ]


def _aligned(*values: int) -> bool:
    return all(v % WORD == 0 for v in values)


def chunk_table(
    regions: list[Region], device: torch.device, chunk_bytes: int = CHUNK_BYTES
) -> Tensor:
    """``[J, 7]`` int64 rows ``(src_ptr, src_stride, dst_ptr, dst_stride, offset, length,
    wide)``: every region cut into pieces of at most ``chunk_bytes`` (a multiple of 8), the
    word-aligned part of a region in wide pieces and any remainder in byte pieces."""
    if chunk_bytes <= 0 or chunk_bytes % WORD:
        raise ValueError(f"chunk_bytes must be a positive multiple of {WORD}, got {chunk_bytes}")
    rows: list[list[int]] = []
    for r in regions:
        wide_ok = _aligned(r.src_ptr, r.src_stride, r.dst_ptr, r.dst_stride)
        words_end = r.row_bytes - r.row_bytes % WORD if wide_ok else 0
        for offset in range(0, words_end, chunk_bytes):
            length = min(chunk_bytes, words_end - offset)
            rows.append([r.src_ptr, r.src_stride, r.dst_ptr, r.dst_stride, offset, length, 1])
        for offset in range(words_end, r.row_bytes, chunk_bytes):
            length = min(chunk_bytes, r.row_bytes - offset)
            rows.append([r.src_ptr, r.src_stride, r.dst_ptr, r.dst_stride, offset, length, 0])
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 7)

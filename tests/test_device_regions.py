"""The gather's chunk table covers exactly the bytes of every expert, in both slot layouts.

The fused gather (``rowcache.device_plan.triton_kernels.gather_kernel``) copies, for every miss
and every row of the table, ``length`` bytes from ``src_ptr + expert * src_stride + offset`` to
``dst_ptr + slot * dst_stride + offset``. Here the same walk runs in Python over the table,
against real CPU buffers, and must reproduce ``slot <- expert`` for every tensor, byte for byte,
touching nothing else; wide rows (8-byte words) must be word-aligned.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from rowcache.device_plan.regions import CHUNK_BYTES, chunk_table, copy_regions
from rowcache.sources import ExpertSources, allocate_slot_buffers

E, C = 5, 3


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w13": torch.randn(E, 64, 130, generator=gen).to(torch.bfloat16),  # 16,640 B rows
        "w2": torch.randint(0, 255, (E, 33, 7), generator=gen, dtype=torch.uint8),  # 231 B
        "w13_scale": torch.rand(E, 3, generator=gen),
        "w2_scale": torch.rand(E, 1, generator=gen),
        "w13_scale_2": torch.rand(E, generator=gen),  # 4-byte rows: the byte path
        "w2_scale_2": torch.rand(E, generator=gen),
        "w13_bias": torch.rand(E, 64, generator=gen),
        "w2_bias": torch.rand(E, 33, generator=gen).to(torch.bfloat16),  # 66 B: the byte path
    }


def walk(table: torch.Tensor, expert: int, slot: int) -> None:
    """The gather's copy for one miss, in Python."""
    for src, src_stride, dst, dst_stride, offset, length, wide in table.tolist():
        source = src + expert * src_stride + offset
        target = dst + slot * dst_stride + offset
        if wide:
            assert source % 8 == 0 and target % 8 == 0 and length % 8 == 0
        ctypes.memmove(target, source, length)


@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("chunk", [64, 1024, CHUNK_BYTES])
def test_the_table_copies_every_tensor_exactly(layout: str, chunk: int) -> None:
    given = tensors()
    sources = ExpertSources(**given, device="cpu", layout=layout)  # type: ignore[arg-type]
    slots = allocate_slot_buffers(sources, C, "cpu")
    for buf in slots.tensors():
        assert buf is not None
        buf.view(torch.uint8).fill_(0xAB) if buf.is_contiguous() else buf.zero_()
    before = [b.clone() for b in slots.tensors() if b is not None]
    table = chunk_table(copy_regions(sources, slots), torch.device("cpu"), chunk)
    assert (table[:, 5] <= chunk).all() and (table[:, 5] > 0).all()
    walk(table, expert=3, slot=1)
    walk(table, expert=0, slot=2)
    for name, buf, old in zip(
        given, [b for b in slots.tensors() if b is not None], before, strict=True
    ):
        src = given[name]
        assert torch.equal(buf[1], src[3]), name
        assert torch.equal(buf[2], src[0]), name
        assert torch.equal(buf[0], old[0]), f"{name}: slot 0 was touched"


def test_pieces_partition_each_region() -> None:
    sources = ExpertSources(**tensors(), device="cpu")  # type: ignore[arg-type]
    slots = allocate_slot_buffers(sources, C, "cpu")
    regions = copy_regions(sources, slots)
    table = chunk_table(regions, torch.device("cpu"), 1024).tolist()
    for region in regions:
        pieces = sorted((r[4], r[5]) for r in table if r[0] == region.src_ptr)
        at = 0
        for offset, length in pieces:
            assert offset == at
            at += length
        assert at == region.row_bytes, region.name


def test_bad_chunk_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        chunk_table([], torch.device("cpu"), 12)

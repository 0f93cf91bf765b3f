"""The GPU decode of bf16 planes (``rowcache.compress.bf16_planes``) into slots, in Triton.

``decode_gather_kernel`` runs after the device planner's plan, like its gather: a fixed grid of
programs walks the work items (miss, block of ``BLOCK`` values); the number of items comes
from the miss count on the device, so with no miss every program returns after one load, and
the launch is captured in a CUDA graph once. A work item reads the block's sign-mantissa bytes
and exponent codes (on the host through unified addressing, or on the device; a 4-bit code from
its byte's nibble, a 3-bit one from the three bytes of its group of eight), looks each code up
in the 16-entry codebook, takes the escaped exponents from the block's range of the escape
plane (the rank of an escape in its block is an exclusive prefix sum of the escape flags), and
stores the reassembled 16 bits into the slot. Every store is masked by the block's end and by
the miss count; a miss entry below 0 (never written below the count) writes nothing.

Neighbouring values load the same byte of codes again, which the caches serve: a block tiled by
code units instead, each byte loaded once, decoded 5 to 14% slower on the H200
(docs/records/2026-12-04-bench-decode-tiled.md).

``SlotDecoder`` is the launch, checked once per slot buffer; ``decode_into_slots`` builds one
and launches it once (tests, the bench). Under ``TRITON_INTERPRET=1`` the same kernel runs on
the CPU, which is how CI checks it against ``bf16_planes.decode_experts``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rowcache.compress.bf16_planes import BLOCK, Bf16Planes
from rowcache.errors import InvalidInputError

__all__ = ["DECODE_WARPS", "SlotDecoder", "decode_gather_kernel", "decode_into_slots"]

DECODE_WARPS = 4
"""Warps of one decode program (Triton's default)."""


# The one miss's scalars are never specialized: a value of 1 would compile them as constants,
# and every expert and slot id into a kernel of its own.
@triton.jit(do_not_specialize=["one_expert", "one_slot"])
def decode_gather_kernel(
    codebook_ptr,
    sm_ptr,
    sm_stride,
    codes_ptr,
    codes_stride,
    starts_ptr,
    starts_stride,
    escapes_ptr,
    dst_ptr,
    dst_stride,
    n,
    blocks,
    miss_experts_ptr,
    miss_slots_ptr,
    miss_count_ptr,
    capacity,
    one_expert,
    one_slot,
    BLOCK: tl.constexpr,
    CODE_BITS: tl.constexpr,
    ONE_MISS: tl.constexpr = False,
    MUTANT: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Seeded bug 2 decodes every entry of the miss list, not the first count.
    if ONE_MISS:  # the miss as two scalars (the host planner's), no list in memory
        total = blocks
    elif MUTANT == 2:
        total = capacity * blocks
    else:
        total = tl.load(miss_count_ptr) * blocks
    for item in range(pid, total, nprog):
        b = item % blocks
        if ONE_MISS:
            expert = one_expert.to(tl.int64)
            slot = one_slot.to(tl.int64)
        else:
            m = item // blocks
            expert = tl.load(miss_experts_ptr + m).to(tl.int64)
            slot = tl.load(miss_slots_ptr + m).to(tl.int64)
        if (expert >= 0) & (slot >= 0):
            at = b * BLOCK + tl.arange(0, BLOCK)
            inside = at < n
            sm = tl.load(sm_ptr + expert * sm_stride + at, mask=inside, other=0).to(tl.int32)
            row = codes_ptr + expert * codes_stride
            if CODE_BITS == 4:
                pair = tl.load(row + at // 2, mask=inside, other=0)
                code = (pair.to(tl.int32) >> ((at % 2) * 4).to(tl.int32)) & 0xF
            else:  # 3 bits: value 8g + r in bits 3r .. 3r + 2 of group g's 24-bit word
                group = row + (at // 8) * 3
                if MUTANT == 5:  # seeded bug: groups taken 2 bytes apart, not 3
                    group = row + (at // 8) * 2
                word = tl.load(group, mask=inside, other=0).to(tl.int32)
                word = word | (tl.load(group + 1, mask=inside, other=0).to(tl.int32) << 8)
                word = word | (tl.load(group + 2, mask=inside, other=0).to(tl.int32) << 16)
                code = (word >> ((at % 8) * 3).to(tl.int32)) & 0x7
            exponent = tl.load(codebook_ptr + code).to(tl.int32)
            escaped = (code == (1 << CODE_BITS) - 1) & inside
            flags = escaped.to(tl.int32)
            rank = tl.cumsum(flags, axis=0) - flags  # escapes before this value in its block
            if MUTANT == 1:  # seeded bug: the inclusive prefix sum (one escape late)
                rank = rank + flags
            start = tl.load(starts_ptr + expert * starts_stride + b)
            escape = tl.load(escapes_ptr + start + rank, mask=escaped, other=0).to(tl.int32)
            exponent = tl.where(escaped, escape, exponent)
            bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
            if MUTANT == 3:  # seeded bug: the sign is dropped
                bits = bits & 0x7FFF
            if MUTANT == 4:  # seeded bug: the last block's store is not cut at the expert's end
                inside = at < blocks * BLOCK
            tl.store(dst_ptr + slot * dst_stride + at, bits.to(tl.int16), mask=inside)


class SlotDecoder:
    """The decode of one source's planes into its slot buffer, checked and laid out once (the
    device planner launches it after every gather, so nothing here is redone per pass).

    ``codebook`` is the planes' codebook where the kernel should read it (on the device, once:
    the planes may live in host memory); the planes' own by default. ``mutant`` (tests only)
    selects a seeded bug of the kernel."""

    def __init__(
        self,
        planes: Bf16Planes,
        slots: Tensor,
        *,
        grid: int,
        codebook: Tensor | None = None,
        num_warps: int = DECODE_WARPS,
        mutant: int = 0,
    ) -> None:
        n = planes.values_per_expert
        if slots.dtype.itemsize != 2 or slots.dim() < 1 or slots[0].numel() != n:
            raise InvalidInputError(
                f"bf16 planes of {n} values an expert decode into 16-bit [C, ...] slots of as "
                f"many values, got {slots.dtype} of shape {tuple(slots.shape)}"
            )
        if not slots.is_contiguous() or grid < 1:
            raise InvalidInputError(
                f"the decode writes contiguous slots with >= 1 program, got strides "
                f"{slots.stride()} and grid {grid}"
            )
        if num_warps not in (1, 2, 4, 8, 16, 32):
            raise InvalidInputError(f"num_warps must be a power of two <= 32, got {num_warps}")
        self._planes = planes
        self._slots = slots.view(slots.shape[0], -1).view(torch.int16)
        self._codebook = planes.codebook if codebook is None else codebook
        self._grid = (grid,)
        self._num_warps = num_warps
        self._mutant = mutant

    def __call__(self, miss_experts: Tensor, miss_slots: Tensor, miss_count: Tensor) -> None:
        """Decode the first ``miss_count`` misses: expert ``miss_experts[i]`` into slot
        ``miss_slots[i]``."""
        self._launch(self._grid, miss_experts, miss_slots, miss_count, miss_experts.numel())

    def decode_one(self, expert: int, slot: int) -> None:
        """Decode expert ``expert`` into slot ``slot``, the two given as the launch's scalars:
        the host planner's miss, which has no miss list on the device (nor any buffer the
        launch reads but the planes, which never change). The grid is cut to the expert's
        blocks. Bounds are the caller's (the host plan), checked here all the same: a launch
        writes nothing outside the slots."""
        planes = self._planes
        if not (0 <= expert < planes.num_experts and 0 <= slot < self._slots.shape[0]):
            raise InvalidInputError(
                f"decode_one: expert {expert} outside [0, {planes.num_experts}) or slot {slot} "
                f"outside [0, {self._slots.shape[0]})"
            )
        grid = (min(self._grid[0], planes.blocks_per_expert),)
        # No list: the miss pointers are never read (ONE_MISS); any tensor stands in.
        none = self._slots
        self._launch(grid, none, none, none, 0, expert, slot, one_miss=True)

    def _launch(
        self,
        grid: tuple[int],
        miss_experts: Tensor,
        miss_slots: Tensor,
        miss_count: Tensor,
        capacity: int,
        one_expert: int = 0,
        one_slot: int = 0,
        *,
        one_miss: bool = False,
    ) -> None:
        planes = self._planes
        n = planes.values_per_expert
        decode_gather_kernel[grid](
            self._codebook,
            planes.sign_mantissa,
            planes.sign_mantissa.stride(0),
            planes.codes,
            planes.codes.stride(0),
            planes.escape_starts,
            planes.escape_starts.stride(0),
            planes.escapes,
            self._slots,
            n,
            n,
            planes.blocks_per_expert,
            miss_experts,
            miss_slots,
            miss_count,
            capacity,
            one_expert,
            one_slot,
            BLOCK=BLOCK,
            CODE_BITS=planes.code_bits,
            ONE_MISS=one_miss,
            MUTANT=self._mutant,
            num_warps=self._num_warps,
        )


def decode_into_slots(
    planes: Bf16Planes,
    slots: Tensor,
    miss_experts: Tensor,
    miss_slots: Tensor,
    miss_count: Tensor,
    *,
    grid: int,
    codebook: Tensor | None = None,
    num_warps: int = DECODE_WARPS,
    mutant: int = 0,
) -> None:
    """One decode of the first ``miss_count`` misses (expert ``miss_experts[i]`` into slot
    ``miss_slots[i]`` of the bf16 ``[C, ...]`` buffer ``slots``) with ``grid`` programs of
    ``num_warps`` warps: a ``SlotDecoder`` built and launched once."""
    SlotDecoder(planes, slots, grid=grid, codebook=codebook, num_warps=num_warps, mutant=mutant)(
        miss_experts, miss_slots, miss_count
    )

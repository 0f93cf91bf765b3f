"""A lossless format for bf16 expert weights: sign and mantissa kept as they are, the exponent
coded in 3 or 4 bits against a per-tensor codebook, with an escape for the rare exponents.

A bf16 value is 1 sign bit, 8 exponent bits and 7 mantissa bits. Trained and Gaussian weights
use few of the 256 exponents (on the builder's Gaussian weights the exponent field carries
about 2.5 bits of entropy; its 7 most common values cover about 98% of the weights and its 15
most common 99.98%), so:

* ``sign_mantissa``: one byte a value, the sign in bit 7 and the mantissa in bits 0-6;
* ``codes``: ``code_bits`` bits a value: the index of the value's exponent in the tensor's
  ``codebook`` of its ``2**code_bits - 1`` most common exponents, or the escape code
  (``2**code_bits - 1``) for any other. 4 bits: two codes a byte, the even value in the low
  nibble. 3 bits: eight codes in three bytes, value ``8g + r`` in bits ``3r .. 3r + 2`` of the
  little-endian 24-bit word of group ``g``;
* ``escapes``: the exponent byte of every escaped value, in value order, and ``escape_starts``
  where each decode block's escapes begin, so that one block (``BLOCK`` values) decodes alone.

The encoder takes whichever width stores the tensor in fewer bytes: 3 bits on Gaussian weights
(11 bits a value plus one byte for each of the ~2% escapes: a ratio of about 0.70), 4 bits where
the exponents spread wider (12 bits a value: 0.75). Every bit pattern round-trips, whatever its
class (signed zeros, subnormals, infinities, NaN payloads, the largest and smallest exponents),
and so does a tensor whose exponents do not fit the codebook at all: it only escapes more (at
worst 19 or 20 bits a value). The encoder refuses no bf16 tensor.

Each plane keeps every expert's bytes in one contiguous range (``expert_ranges``), so a miss
copies three ranges; ``decode_experts`` is the reference the GPU decode is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.pinned import pinned_empty_exact

__all__ = [
    "BLOCK",
    "CODES",
    "CODE_WIDTHS",
    "ENCODE_CHUNK_VALUES",
    "ESCAPE",
    "Bf16Planes",
    "decode",
    "decode_experts",
    "encode",
]

BLOCK = 4096
"""Values per decode block: one block's escapes are found from ``escape_starts`` alone."""

CODES = 16
"""Entries of the codebook tensor at any width (a 3-bit codebook uses the first 8)."""
ESCAPE = CODES - 1
"""The 4-bit code of an exponent outside the codebook (its byte is in ``escapes``); at
``code_bits`` bits the escape is ``2**code_bits - 1`` (``Bf16Planes.escape_code``)."""
CODE_WIDTHS = (3, 4)
"""The code widths the format stores (bits a value)."""


@dataclass(frozen=True)
class Bf16Planes:
    """An ``[E, ...]`` bf16 tensor in the planes of the module docstring."""

    shape: tuple[int, ...]
    codebook: Tensor
    """uint8 ``[CODES]``: the exponent of each code; the escape code's entry and those past it
    are unused (0)."""
    sign_mantissa: Tensor
    """uint8 ``[E, n]`` (``n`` values an expert)."""
    codes: Tensor
    """uint8 ``[E, ceil(n / 2)]`` at 4 bits (a last odd value's high nibble is 0), ``[E, 3 *
    ceil(n / 8)]`` at 3 bits (the codes past ``n`` are 0)."""
    escape_starts: Tensor
    """int64 ``[E, blocks + 1]``: block ``b`` of expert ``e`` has its escapes at
    ``escapes[escape_starts[e, b] : escape_starts[e, b + 1]]``; ``escape_starts[e, blocks]``
    is ``escape_starts[e + 1, 0]``."""
    escapes: Tensor
    """uint8 ``[escaped values]``: their exponent bytes, expert by expert, in value order."""
    code_bits: int = 4
    """Bits a code (``CODE_WIDTHS``)."""

    def __post_init__(self) -> None:
        if self.code_bits not in CODE_WIDTHS:
            raise InvalidInputError(
                f"code_bits {self.code_bits!r} is not a width the planes store; allowed: "
                f"{', '.join(map(str, CODE_WIDTHS))}"
            )

    @property
    def escape_code(self) -> int:
        """The code of an escaped exponent."""
        return (1 << self.code_bits) - 1

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def values_per_expert(self) -> int:
        return int(self.sign_mantissa.shape[1])

    @property
    def blocks_per_expert(self) -> int:
        return int(self.escape_starts.shape[1]) - 1

    @property
    def nbytes(self) -> int:
        """Every byte the format keeps (planes, codebook and block table)."""
        planes = (self.codebook, self.sign_mantissa, self.codes, self.escape_starts, self.escapes)
        return sum(t.numel() * t.element_size() for t in planes)

    @property
    def raw_nbytes(self) -> int:
        """The bytes of the bf16 tensor it holds."""
        return 2 * self.num_experts * self.values_per_expert

    @property
    def ratio(self) -> float:
        """``nbytes / raw_nbytes`` (below 1 where the format saves)."""
        return self.nbytes / max(self.raw_nbytes, 1)

    def map(self, fn: Callable[[Tensor], Tensor]) -> Bf16Planes:
        """The same planes with ``fn`` applied to each tensor (to move or pin them)."""
        return Bf16Planes(
            shape=self.shape,
            codebook=fn(self.codebook),
            sign_mantissa=fn(self.sign_mantissa),
            codes=fn(self.codes),
            escape_starts=fn(self.escape_starts),
            escapes=fn(self.escapes),
            code_bits=self.code_bits,
        )

    def expert_escapes(self, expert: int) -> Tensor:
        """The escape bytes of one expert (one contiguous range of ``escapes``)."""
        start, stop = (int(v) for v in self.escape_starts[expert, [0, -1]])
        return self.escapes[start:stop]

    def expert_nbytes(self, expert: int) -> int:
        """What a miss of ``expert`` moves: its sign-mantissa row, codes row and escapes."""
        return (
            self.values_per_expert + int(self.codes.shape[1]) + self.expert_escapes(expert).numel()
        )


def _check_bf16(x: Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise InvalidInputError(f"bf16 planes hold bfloat16 tensors, got {x.dtype}")
    if x.dim() < 1 or x.shape[0] < 1:
        raise InvalidInputError(
            f"bf16 planes hold an [E, ...] tensor with E >= 1, got shape {tuple(x.shape)}"
        )


def _pack(codes: Tensor, code_bits: int) -> Tensor:
    """``[E, n]`` uint8 codes packed into the ``codes`` plane of ``code_bits`` bits."""
    experts, n = codes.shape
    per_group, group_bytes = (2, 1) if code_bits == 4 else (8, 3)
    pad = -n % per_group
    if pad:
        codes = torch.cat([codes, codes.new_zeros((experts, pad))], dim=1)
    groups = codes.view(experts, -1, per_group).to(torch.int32)
    shifts = torch.arange(per_group, device=codes.device, dtype=torch.int32) * code_bits
    word = (groups << shifts).sum(dim=2, dtype=torch.int32)  # disjoint bits: a sum is an or
    if group_bytes == 1:
        return word.to(torch.uint8).contiguous()
    parts = [(word >> (8 * k)) & 0xFF for k in range(group_bytes)]
    return torch.stack(parts, dim=2).reshape(experts, -1).to(torch.uint8).contiguous()


def _unpack(packed: Tensor, code_bits: int, n: int) -> Tensor:
    """The ``[rows, n]`` int32 codes of ``packed`` rows of the ``codes`` plane."""
    rows = packed.shape[0]
    per_group, group_bytes = (2, 1) if code_bits == 4 else (8, 3)
    parts = packed.to(torch.int32).view(rows, -1, group_bytes)
    word = parts[:, :, 0]
    for k in range(1, group_bytes):
        word = word | (parts[:, :, k] << (8 * k))
    shifts = torch.arange(per_group, device=packed.device, dtype=torch.int32) * code_bits
    codes = (word.unsqueeze(2) >> shifts) & ((1 << code_bits) - 1)
    return codes.reshape(rows, -1)[:, :n]


def _code_bytes(code_bits: int, experts: int, n: int) -> int:
    """The ``codes`` plane's bytes at ``code_bits``."""
    return experts * (-(-n // 2) if code_bits == 4 else 3 * -(-n // 8))


ENCODE_CHUNK_VALUES = 1 << 24
"""Values ``encode`` works on at once (whole experts, at least one): its temporaries stay near
20 bytes a value of the larger of this and one expert (about 320 MB, or 590 MB for an expert of
29M values) beside the planes it fills, however many experts the tensor holds, so that encoding
a large layer on the GPU fits beside the model."""


def _exponent(bits: Tensor) -> Tensor:
    # int16 bits: the shift is arithmetic, so the field is masked after it.
    return ((bits >> 7) & 0xFF).to(torch.uint8)


def encode(
    x: Tensor,
    code_bits: int | None = None,
    *,
    chunk_values: int = ENCODE_CHUNK_VALUES,
    work_device: torch.device | str | None = None,
    pin_memory: bool = False,
) -> Bf16Planes:
    """The planes of a bf16 ``[E, ...]`` tensor (on any device; the planes are on the same).

    ``code_bits`` (one of ``CODE_WIDTHS``; None: whichever stores the tensor in fewer bytes,
    4 on a tie) sets the code width; the codebook holds the ``2**code_bits - 1`` most common
    exponents of the whole tensor (ties to the smaller exponent); ``x`` is read, not changed.
    The work goes over groups of whole experts of about ``chunk_values`` values, each moved to
    ``work_device`` (default: ``x``'s) and its planes back, so a host tensor is encoded on a
    GPU holding one group at a time; ``pin_memory``: the planes of a host tensor are allocated
    pinned. The planes depend on neither."""
    _check_bf16(x)
    if code_bits is not None and code_bits not in CODE_WIDTHS:
        raise InvalidInputError(
            f"code_bits {code_bits!r} is not a width the planes store; allowed: "
            f"{', '.join(map(str, CODE_WIDTHS))} or None (the smaller)"
        )
    if chunk_values < 1:
        raise InvalidInputError(f"chunk_values must be >= 1, got {chunk_values}")
    experts = x.shape[0]
    device = x.device
    work = device if work_device is None else torch.device(work_device)

    pin = pin_memory and device.type == "cpu"  # only host memory is pinned

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if pin:  # the planes live as long as their holder: the arena's exact bytes
            return pinned_empty_exact(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def group(chunk: slice) -> Tensor:
        """A group of experts' bits as int16 ``[experts, n]`` on the work device (the shifts
        are arithmetic there, so each field is masked after its shift)."""
        part = x.detach()[chunk].to(work).contiguous()
        return part.view(torch.int16).reshape(chunk.stop - chunk.start, -1)

    n = math.prod(x.shape[1:])
    step = max(1, chunk_values // max(n, 1))
    chunks = [slice(first, min(first + step, experts)) for first in range(0, experts, step)]
    counts = torch.zeros(256, dtype=torch.int64, device=work)
    for chunk in chunks:
        counts += torch.bincount(_exponent(group(chunk)).flatten(), minlength=256)
    # Most common first; among equal counts the smaller exponent (a stable sort by -count).
    ranked = torch.sort(-counts, stable=True).indices
    if code_bits is None:
        # Bytes at each width: the codes plane and one byte an escape (the block table is
        # the same at both widths).
        covered = torch.cumsum(counts[ranked], dim=0)
        total = experts * n

        def size(width: int) -> int:
            kept = int(covered[(1 << width) - 2])
            return _code_bytes(width, experts, n) + total - kept

        code_bits = 3 if size(3) < size(4) else 4
    escape = (1 << code_bits) - 1
    order = ranked[:escape]
    codebook = empty((CODES,), torch.uint8)
    codebook.zero_()
    codebook[:escape] = order.to(torch.uint8).to(device)
    code_of = torch.full((256,), escape, dtype=torch.uint8, device=work)
    code_of[order] = torch.arange(escape, dtype=torch.uint8, device=work)
    blocks = max(1, -(-n // BLOCK))
    sign_mantissa = empty((experts, n), torch.uint8)
    packed = empty((experts, _code_bytes(code_bits, 1, n)), torch.uint8)
    counts_per_block = torch.empty(experts * blocks, dtype=torch.int64, device=device)
    escapes: list[Tensor] = []
    for chunk in chunks:
        part = group(chunk)
        exponent = _exponent(part)
        sign_mantissa[chunk] = (((part >> 8) & 0x80) | (part & 0x7F)).to(torch.uint8)
        codes = code_of[exponent.int()]  # a uint8 index would be taken as a mask
        escaped = codes == escape
        escapes.append(exponent[escaped].to(device))  # row-major: expert by expert, value order
        where = escaped.nonzero()  # [escapes, 2]: (expert in the chunk, value), few
        rows = chunk.stop - chunk.start
        counts_per_block[chunk.start * blocks : chunk.stop * blocks] = torch.bincount(
            where[:, 0] * blocks + where[:, 1] // BLOCK, minlength=rows * blocks
        )
        packed[chunk] = _pack(codes, code_bits)
    prefix = torch.zeros(experts * blocks + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts_per_block, dim=0, out=prefix[1:])
    starts = torch.arange(experts, device=device).unsqueeze(1) * blocks
    escape_starts = empty((experts, blocks + 1), torch.int64)
    escape_starts.copy_(prefix[starts + torch.arange(blocks + 1, device=device)])
    escaped_bytes = empty((sum(e.numel() for e in escapes),), torch.uint8)
    torch.cat(escapes, out=escaped_bytes)
    return Bf16Planes(
        shape=tuple(x.shape),
        codebook=codebook,
        sign_mantissa=sign_mantissa,
        codes=packed,
        escape_starts=escape_starts,
        escapes=escaped_bytes,
        code_bits=code_bits,
    )


def decode_experts(planes: Bf16Planes, experts: Sequence[int]) -> Tensor:
    """The bf16 ``[len(experts), ...]`` of these experts, bit for bit what was encoded."""
    for expert in experts:
        if not 0 <= expert < planes.num_experts:
            raise InvalidInputError(
                f"expert {expert} is outside [0, {planes.num_experts}) of these planes"
            )
    index = torch.tensor(list(experts), dtype=torch.long, device=planes.codes.device)
    n = planes.values_per_expert
    codes = _unpack(planes.codes[index], planes.code_bits, n)
    exponent = planes.codebook.to(torch.int32)[codes]
    escaped = codes == planes.escape_code
    if bool(escaped.any()):
        found = [planes.expert_escapes(e) for e in experts]
        exponent[escaped] = torch.cat(found).to(torch.int32)
    sm = planes.sign_mantissa[index].to(torch.int32)
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(torch.bfloat16).reshape(len(experts), *planes.shape[1:])


def decode(planes: Bf16Planes) -> Tensor:
    """The whole bf16 tensor, bit for bit what was encoded."""
    return decode_experts(planes, range(planes.num_experts))

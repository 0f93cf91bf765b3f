"""Per-expert host tensors and the device slot buffers they are copied into.

Both are validated here once, at construction, so that the hot path of every
provider can index them without re-checking shapes, devices or dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.compress import Bf16Planes, decode, decode_experts, encode
from rowcache.errors import InvalidInputError
from rowcache.packing import Layout, check_layout, pack_offsets, packed_storage, packed_views
from rowcache.pinned import pinned_empty_exact

__all__ = [
    "HELD_CODE_BITS",
    "SLOT_GUARD_BYTES",
    "SOURCE_NAMES",
    "ExpertSources",
    "SlotBuffers",
    "allocate_slot_buffers",
    "guarded_empty",
    "planes_and_slots",
    "validate_capacity",
]

SOURCE_NAMES = (
    "w13",
    "w2",
    "w13_scale",
    "w2_scale",
    "w13_scale_2",
    "w2_scale_2",
    "w13_bias",
    "w2_bias",
)
"""Fixed order of the eight per-expert tensors; slot buffers follow it too."""

PAIRS = (("w13_scale_2", "w2_scale_2"), ("w13_bias", "w2_bias"))
"""Optional sources that come together or not at all."""

COMPRESSED = ("w13", "w2")
"""The sources ``compress=True`` holds as bf16 planes (``rowcache.compress``); the scales and
biases, a few percent of an expert, stay as they are."""


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise InvalidInputError(
            f"{name} must be expert-major [E, ...], got a 0-dim tensor ({_describe(t)})"
        )
    return t


def _needs_pinning(device: torch.device) -> bool:
    # Only CUDA copies are asynchronous from pinned memory; on other targets
    # pinning would cost memory for nothing (and needs an accelerator).
    return device.type == "cuda"


class ExpertSources:
    """Validated bundle of the per-expert host tensors, expert-major ``[E, ...]``.

    ``w13`` and ``w2`` are required; ``w13_scale``/``w2_scale`` are optional;
    ``w13_scale_2``/``w2_scale_2`` (per-expert global scales, NVFP4) and
    ``w13_bias``/``w2_bias`` (per-expert output biases: gpt-oss's ``[E, 2I]`` and ``[E, H]``)
    are optional but each pair must be given together. Every source is bytes to the cache: any
    dtype, MXFP4's packed ``uint8`` values and ``uint8`` e8m0 scales included. All must live on
    the CPU and share the same number of experts E.

    Ownership (``share``): by default (``share=False``) the sources are copied here, once, into
    host memory the provider owns: pinned for a CUDA target (so that slot fills are
    asynchronous), plain for the CPU. A later in-place write to the caller's tensors then
    changes nothing the provider serves. The provider holds exactly one host copy; the
    caller's original stays alive as long as the caller holds it, so drop it after building
    the provider (host memory peaks at two copies while the provider is built).

    ``share=True`` keeps the caller's tensors themselves (no copy, no second host copy at any
    time): for a CUDA target they must already be pinned (``pin_memory()`` at load time), and
    it cannot be combined with ``layout="packed"``, which copies by construction. The caller
    then owns the contents: an in-place write changes what a later miss copies, while slots
    already resident keep the old bytes until their expert is evicted or invalidated (call
    ``invalidate(e)`` after rewriting expert ``e``).

    ``layout="packed"`` (``rowcache.packing``) copies every source into one host buffer
    ``[E, P]`` (pinned for a CUDA target) holding each expert's tensors in one byte range, and
    keeps only that copy; the slot buffers then follow the same layout.

    ``compress=True`` holds ``w13`` and ``w2`` (bf16) as bf16 planes (``rowcache.compress``:
    lossless, about three quarters of the bytes, pinned for a CUDA target) and nothing else of
    them: ``planes`` has them, ``copied()`` leaves them out (a miss decodes them into the slots
    instead of copying them), and ``tensors()`` gives for each a tensor on the ``meta`` device
    of its shape and dtype, which sizes the slots and fails loudly if anything copies from it.
    It takes the separate layout; with ``share`` the other sources are the caller's tensors
    and w13 and w2 are read once, to encode them (the caller may then free its copies).
    """

    __slots__ = ("_tensors", "device", "layout", "num_experts", "pack", "planes", "shared")

    def __init__(
        self,
        w13: Tensor,
        w2: Tensor,
        w13_scale: Tensor | None = None,
        w2_scale: Tensor | None = None,
        *,
        w13_scale_2: Tensor | None = None,
        w2_scale_2: Tensor | None = None,
        w13_bias: Tensor | None = None,
        w2_bias: Tensor | None = None,
        device: torch.device | str,
        layout: Layout = "separate",
        share: bool = False,
        compress: bool = False,
    ) -> None:
        target = torch.device(device)
        checked_layout = check_layout(layout)
        for flag, value in (("share_sources", share), ("compress", compress)):
            if not isinstance(value, bool):
                raise InvalidInputError(
                    f"{flag} must be a bool, got {value!r} ({type(value).__name__})"
                )
        if compress and checked_layout == "packed":
            raise InvalidInputError(
                "compress=True holds w13 and w2 as bf16 planes of their own, which take "
                f"layout='separate', got layout={checked_layout!r}"
            )
        if share and checked_layout == "packed":
            raise InvalidInputError(
                "share_sources=True cannot be combined with layout='packed': the packed layout "
                "copies every source into one host buffer"
            )
        raw: dict[str, object] = {
            "w13": w13,
            "w2": w2,
            "w13_scale": w13_scale,
            "w2_scale": w2_scale,
            "w13_scale_2": w13_scale_2,
            "w2_scale_2": w2_scale_2,
            "w13_bias": w13_bias,
            "w2_bias": w2_bias,
        }
        given = {n: None if t is None else _check_tensor(n, t) for n, t in raw.items()}
        for required in ("w13", "w2"):
            if given[required] is None:
                raise InvalidInputError(f"{required} is required, got None")
        for first, second in PAIRS:
            if (raw[first] is None) != (raw[second] is None):
                missing, present = (first, second) if raw[first] is None else (second, first)
                what = "per-expert global scales" if "scale" in first else "per-expert biases"
                raise InvalidInputError(
                    f"{present} was given without {missing}: {what} must be given together"
                )
        present_items = [(n, t) for n, t in given.items() if t is not None]
        off_cpu = [f"{n} is on {t.device}" for n, t in present_items if t.device.type != "cpu"]
        if off_cpu:
            raise InvalidInputError(
                "expert sources must be on the CPU (host memory): " + ", ".join(off_cpu)
            )
        experts = {n: t.shape[0] for n, t in present_items}
        if len(set(experts.values())) != 1:
            listing = ", ".join(f"{n} has E={e}" for n, e in experts.items())
            raise InvalidInputError(f"expert sources disagree on the number of experts: {listing}")
        num_experts = experts["w13"]
        if num_experts == 0:
            raise InvalidInputError("expert sources hold no experts (E=0)")
        if compress:
            dtypes = {n: t.dtype for n, t in present_items if n in COMPRESSED}
            other = [f"{n} is {d}" for n, d in dtypes.items() if d != torch.bfloat16]
            if other:
                raise InvalidInputError(
                    "compress=True holds bf16 w13 and w2 as bf16 planes, but " + ", ".join(other)
                )

        self.pack: tuple[list[int], int] | None = None
        """(byte offset of each tensor in ``SOURCE_NAMES`` order, range size) when packed."""
        if checked_layout == "packed":
            templates = [given[n] for n in SOURCE_NAMES]
            offsets, size = pack_offsets(templates)
            storage = packed_storage(
                num_experts, size, device=torch.device("cpu"), pin_memory=_needs_pinning(target)
            )
            views = packed_views(storage, templates, offsets)
            for view, source in zip(views, templates, strict=True):
                if view is not None and source is not None:
                    view.copy_(source)
            given = dict(zip(SOURCE_NAMES, views, strict=True))
            self.pack = (offsets, size)
        elif share:
            if _needs_pinning(target):
                unpinned = [
                    n
                    for n, t in present_items
                    if not t.is_pinned() and not (compress and n in COMPRESSED)
                ]
                if unpinned:
                    raise InvalidInputError(
                        f"share_sources=True on {target} needs pinned sources, and "
                        f"{', '.join(unpinned)} {'is' if len(unpinned) == 1 else 'are'} not "
                        "pinned (pin_memory() them at load time, or let the provider copy them)"
                    )
        else:
            own = _pinned_copy if _needs_pinning(target) else _host_copy
            kept = {n: t for n, t in given.items() if not (compress and n in COMPRESSED)}
            given = {**given, **{n: None if t is None else own(t) for n, t in kept.items()}}
        self.planes: dict[str, Bf16Planes] = {}
        """The sources held as bf16 planes (``compress=True``: w13 and w2), by name."""
        if compress:
            for name in COMPRESSED:
                source = given[name]
                assert source is not None
                self.planes[name] = _encoded_on_host(source, target)
                given[name] = torch.empty(source.shape, dtype=source.dtype, device="meta")
        self._tensors = given
        self.device = target
        self.layout: Layout = checked_layout
        self.num_experts = num_experts
        self.shared = share
        """Whether the sources are the caller's tensors (``share=True``) or the provider's copy."""

    @property
    def w13(self) -> Tensor:
        t = self._tensors["w13"]
        assert t is not None
        return t

    @property
    def w2(self) -> Tensor:
        t = self._tensors["w2"]
        assert t is not None
        return t

    @property
    def w13_scale(self) -> Tensor | None:
        return self._tensors["w13_scale"]

    @property
    def w2_scale(self) -> Tensor | None:
        return self._tensors["w2_scale"]

    @property
    def w13_scale_2(self) -> Tensor | None:
        return self._tensors["w13_scale_2"]

    @property
    def w2_scale_2(self) -> Tensor | None:
        return self._tensors["w2_scale_2"]

    @property
    def w13_bias(self) -> Tensor | None:
        return self._tensors["w13_bias"]

    @property
    def w2_bias(self) -> Tensor | None:
        return self._tensors["w2_bias"]

    def tensors(self) -> tuple[Tensor | None, ...]:
        """All eight sources in ``SOURCE_NAMES`` order, None where absent (a compressed one
        as its ``meta`` stand-in: shape and dtype, no bytes)."""
        return tuple(self._tensors[n] for n in SOURCE_NAMES)

    def copied(self) -> tuple[Tensor | None, ...]:
        """The sources a miss copies as bytes, in ``SOURCE_NAMES`` order: ``tensors()`` with
        None for those held as planes (a miss decodes those)."""
        return tuple(None if n in self.planes else self._tensors[n] for n in SOURCE_NAMES)

    def expert_host_bytes(self, name: str, expert: int) -> Tensor:
        """The bytes expert ``expert`` of source ``name`` holds, as a slot must hold them (a
        compressed source decoded on the host): for audits, not for a forward."""
        if name in self.planes:
            return decode_experts(self.planes[name], [expert])[0].reshape(-1).view(torch.uint8)
        source = self._tensors[name]
        if source is None:
            raise InvalidInputError(f"these sources hold no {name}")
        return source[expert].reshape(-1).contiguous().view(torch.uint8)

    def whole(self, name: str, device: torch.device | str) -> Tensor:
        """Every expert of source ``name`` as the slots hold them, on ``device`` (planes moved
        there and decoded): for audits and reference forwards, not for a forward."""
        target = torch.device(device)
        if name in self.planes:
            return decode(self.planes[name].map(lambda t: t.to(target)))
        source = self._tensors[name]
        if source is None:
            raise InvalidInputError(f"these sources hold no {name}")
        return source.to(target)

    @property
    def expert_bytes(self) -> int:
        """Bytes one miss copies into a slot: one row of every present source (the whole
        byte range, alignment padding included, when packed)."""
        if self.pack is not None:
            return self.pack[1]
        return sum(_row_bytes(t) for t in self._tensors.values() if t is not None)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held by the sources (all experts, all eight tensors, and the
        alignment padding of a packed layout; the planes of compressed ones). The tensors' own
        bytes, not their storages': pinned sources are views of slabs that other layers'
        sources share (``rowcache.pinned``)."""
        planes = sum(p.nbytes for p in self.planes.values())
        if self.pack is not None:
            return self.num_experts * self.pack[1] + planes
        return sum(t.nbytes for t in self.copied() if t is not None) + planes


HELD_CODE_BITS: int | None = None
"""The exponent code width the sources hold their planes at: None, the encoder's choice per
tensor (whichever width stores it in fewer bytes: 3 bits on Gaussian weights, 0.70 of the bytes
against 0.75 at 4). The 3-bit decode was recorded exact and faster than the 4-bit one at every
miss count on the H200 (docs/records/2026-12-04-bench-decode-gather-bits.md); each tensor's
planes carry their width, and the decode reads it from them."""


def _encoded_on_host(source: Tensor, target: torch.device) -> Bf16Planes:
    """The planes of host tensor ``source``, in host memory, pinned for a CUDA ``target``.

    For a CUDA target the encode runs there, one tensor at a time, and its planes come back to
    pinned host memory: the same planes as an encode on the host (every step is exact integer
    work in a fixed order), at the device's speed rather than a few hundred MB/s of the host's
    torch ops, so that holding a model's experts compressed does not slow its loading. The
    device holds one group of experts and the encode's temporaries at a time
    (``bf16_planes.ENCODE_CHUNK_VALUES``: about 320 MB, more where one expert is larger); the
    planes are written straight into pinned host memory."""
    if not _needs_pinning(target):
        return encode(source, HELD_CODE_BITS)
    return encode(source, HELD_CODE_BITS, work_device=target, pin_memory=True)


def _row_bytes(t: Tensor) -> int:
    return t[0].numel() * t.element_size()


def _host_copy(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` in plain host memory."""
    return t.clone(memory_format=torch.contiguous_format)


def _pinned_copy(t: Tensor) -> Tensor:
    """A copy of ``t`` in pinned host memory (the arena's exact bytes: the sources live as long
    as their provider), one allocation whether ``t`` is pinned or not."""
    copy = pinned_empty_exact(tuple(t.shape), t.dtype)
    copy.copy_(t)
    return copy


def validate_capacity(capacity: object, num_experts: int) -> int:
    """Return ``capacity`` if it is an int with ``0 < capacity <= num_experts``."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidInputError(
            f"capacity must be an int, got {capacity!r} ({type(capacity).__name__})"
        )
    if not 0 < capacity <= num_experts:
        raise InvalidInputError(
            f"capacity must satisfy 0 < capacity <= num_experts, got capacity={capacity} "
            f"with num_experts={num_experts}"
        )
    return capacity


@dataclass(frozen=True)
class SlotBuffers:
    """The eight device buffers ``[capacity, *row_shape]`` that slots live in.

    Allocated once; providers write into them in place and never replace them,
    so the addresses captured by kernels stay valid.
    """

    capacity: int
    w13: Tensor
    w2: Tensor
    w13_scale: Tensor | None
    w2_scale: Tensor | None
    w13_scale_2: Tensor | None
    w2_scale_2: Tensor | None
    w13_bias: Tensor | None
    w2_bias: Tensor | None

    def tensors(self) -> tuple[Tensor | None, ...]:
        """All eight buffers in ``SOURCE_NAMES`` order, None where absent."""
        return (
            self.w13,
            self.w2,
            self.w13_scale,
            self.w2_scale,
            self.w13_scale_2,
            self.w2_scale_2,
            self.w13_bias,
            self.w2_bias,
        )

    @property
    def slot_bytes(self) -> int:
        """Bytes of device memory the slots span, all buffers together (the zero guard past
        each storage, :data:`SLOT_GUARD_BYTES`, not counted: it holds no expert)."""
        spans: dict[int, int] = {}
        unaddressed = 0
        for t in self.tensors():
            if t is None:
                continue
            # From the storage's start, ``capacity`` rows of the view's row stride: a buffer
            # of its own, or the packed rows at their full width (every view alike).
            end = t.shape[0] * t.stride(0) * t.element_size()
            address = t.untyped_storage().data_ptr()
            if address == 0:  # meta or empty: no address to tell storages apart by
                unaddressed += end
            else:
                spans[address] = max(spans.get(address, 0), end)
        return sum(spans.values()) + unaddressed


SLOT_GUARD_BYTES = 512
"""Zero bytes after the end of every slot buffer, which itself starts zeroed.

A kernel may load a little past a row it reads and multiply what it finds by a zero weight:
triton_kernels' MXFP4 matmul on Hopper (vLLM 0.25.0's gpt-oss kernel) loads each weight-scale
row's last K step unmasked, 64 bytes past the row; the last row of the last slot reads past
the buffer, every other slot's reads the next row or slot. Finite bytes there vanish in the
product; an e8m0 ``0xFF`` (NaN) turns it into NaN, which the clamped SwiGLU turns into wrong
finite values. Zeros past the buffer, and in slots no miss has filled yet, keep such reads
harmless whatever the allocator put there before (512: the over-read with room to spare, a
multiple of every element size)."""


def guarded_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed contiguous ``shape`` tensor whose storage runs :data:`SLOT_GUARD_BYTES` zero
    bytes past its end."""
    count = math.prod(shape)
    tail = -(-SLOT_GUARD_BYTES // dtype.itemsize)
    return torch.zeros(count + tail, dtype=dtype, device=device)[:count].view(shape)


def allocate_slot_buffers(
    sources: ExpertSources, capacity: int, device: torch.device | str
) -> SlotBuffers:
    """Allocate one ``[capacity, *row_shape]`` buffer per present source on ``device`` (views
    of one ``[capacity, P]`` byte buffer when the sources are packed), zeroed, with a zero
    guard past the end (:data:`SLOT_GUARD_BYTES`).

    ``device`` must be the one the sources were prepared for, because pinning
    was decided by it.
    """
    target = torch.device(device)
    if target != sources.device:
        raise InvalidInputError(
            f"slot buffers requested on {target} but the sources were prepared for {sources.device}"
        )
    validate_capacity(capacity, sources.num_experts)

    if sources.pack is not None:
        offsets, size = sources.pack
        storage = guarded_empty((capacity, size), torch.uint8, target)
        views = packed_views(storage, sources.tensors(), offsets)
        first, second = views[0], views[1]
        assert first is not None and second is not None
        return SlotBuffers(capacity, first, second, *views[2:])

    # Plain torch allocations on the target device: device-generic, so that the CUDA
    # specifics stay in the CUDA backend.
    def alloc(src: Tensor | None) -> Tensor | None:
        if src is None:
            return None
        return guarded_empty((capacity, *src.shape[1:]), src.dtype, target)

    bufs = [alloc(t) for t in sources.tensors()]
    w13, w2 = bufs[0], bufs[1]
    assert w13 is not None and w2 is not None
    return SlotBuffers(capacity, w13, w2, *bufs[2:])


def planes_and_slots(sources: ExpertSources, slots: SlotBuffers) -> list[tuple[Bf16Planes, Tensor]]:
    """Each source held as bf16 planes with the slot buffer it decodes into (a miss of either
    planner decodes them; the other sources are copied as bytes, ``ExpertSources.copied``)."""
    buffers = dict(zip(SOURCE_NAMES, slots.tensors(), strict=True))
    pairs = []
    for name, planes in sources.planes.items():
        buffer = buffers[name]
        assert buffer is not None  # allocate_slot_buffers gives every present source a buffer
        pairs.append((planes, buffer))
    return pairs

"""Pinned host memory of (almost) exactly the bytes asked, for tensors that live as long as the
cache that holds them.

torch's caching host allocator rounds every pinned request up to a power of two (so that freed
blocks can be reused by size class): a layer's 805 MB ``w13`` takes 1 GiB and its 907 MB of
planes, held as five tensors, 1.21 GB. On the H200 (2026-12-04, 8 layers of Qwen3-30B-A3B
shapes held as planes) the process pinned 22.57 GB, of which the rounding accounts for 2.4 GB
by the tensors' sizes. An arena asks torch for power-of-two slabs, which it does not round, and
hands out aligned views of them one after another; only the unused tail of a slab is lost.

A view keeps its slab alive. The arena lets go of a slab once nothing else views it (checked at
each request), so a model's slabs are freed after the model by the next request at the latest;
until then a slab's free tail serves later requests. The arena is for what lives as long as the
model (the providers' sources and planes). Tensors freed early (a layer's checkpoint tensors,
released once its planes hold them) come from a second arena whose slabs are let go of once
the layers that share them are released (``pinned_empty_transient``, ``collect_transient``):
one live view holds its whole slab.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.torch_seams import STORAGE_CDATA, STORAGE_USE_COUNT, lookup

__all__ = [
    "ALIGN",
    "SLAB_BYTES",
    "PinnedArena",
    "collect_transient",
    "pinned_empty_exact",
    "pinned_empty_transient",
    "pinning_seconds",
    "releases_slabs",
    "timed_pinning",
]

SLAB_BYTES = 1 << 30
"""The smallest slab (1 GiB). A request that no slab's tail holds takes a new slab of at least
twice its next power of two, so that requests of a few sizes share slabs: a layer's 768 MiB w13
and 384 MiB w2 fill 2 GiB slabs where slabs of their own sizes would lose a quarter (layers of
raw bf16 Qwen3-30B-A3B experts: 10 GiB of slabs for 9 GiB; block-FP8 ones: 29 for 27; planes:
7 for 6.3; gpt-oss's rows: 10 for 9.5; torch's rounding: 12, 36, 9.1 and 10.2)."""
ALIGN = 512
"""Every view starts at a multiple of this many bytes (the CUDA allocator's own granule: any
dtype, and the vectorized loads of the copies and the decode)."""


_pinning_seconds = 0.0


@contextmanager
def timed_pinning() -> Iterator[None]:
    """Count the host time of the block inside in ``pinning_seconds`` (an exception too)."""
    global _pinning_seconds
    start = time.perf_counter()
    try:
        yield
    finally:
        _pinning_seconds += time.perf_counter() - start


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A pinned host tensor from torch's caching host allocator, its host time counted
    (``pinning_seconds``)."""
    with timed_pinning():
        # The host named: vLLM creates a model's weights under a CUDA default device
        # (``with torch.device("cuda")``), where an unnamed pinned request is a CUDA one and
        # fails.
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def pinning_seconds() -> float:
    """Host seconds this process has spent on rowcache's pinned memory (``timed_pinning``):
    asking the driver for blocks (the arenas' slabs, the transient tensors torch holds itself)
    and giving them back (``rowcache.vllm``'s release of the load-time blocks). The driver
    locks or unlocks every page of a block, which at tens of GB is a large part of an engine's
    start-up. vLLM's own pinned memory is not counted."""
    return _pinning_seconds


def _pinned_bytes(nbytes: int) -> Tensor:
    return _pinned((nbytes,), torch.uint8)


@dataclass
class _Slab:
    memory: Tensor
    """A flat uint8 tensor."""
    free_at: int
    """The offset of its first free byte (aligned)."""
    unviewed: int
    """Its storage's use count with no view of it (read when it was made)."""


class PinnedArena:
    """Hands out views of pinned slabs. ``allocate(nbytes)`` makes a slab (a flat uint8
    tensor): pinned host memory by default; tests pass plain host memory."""

    def __init__(
        self,
        slab_bytes: int = SLAB_BYTES,
        allocate: Callable[[int], Tensor] = _pinned_bytes,
    ) -> None:
        if slab_bytes < ALIGN or slab_bytes & (slab_bytes - 1):
            raise InvalidInputError(
                f"slab_bytes must be a power of two >= {ALIGN}, got {slab_bytes}"
            )
        self.slab_bytes = slab_bytes
        self._allocate = allocate
        self._slabs: list[_Slab] = []

    @property
    def reserved_bytes(self) -> int:
        """Bytes of every slab the arena made (whether or not anything still views it)."""
        return sum(slab.memory.numel() for slab in self._slabs)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialized contiguous tensor in a slab: the first slab whose free tail holds
        it, else a new one of ``max(slab_bytes, 2 x its next power of two)`` bytes."""
        if any(d < 0 for d in shape):
            raise InvalidInputError(f"shape must not be negative, got {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:  # host memory, as every view (whatever the default device)
            return torch.empty(shape, dtype=dtype, device="cpu")
        self.collect()
        slab = next((s for s in self._slabs if s.memory.numel() - s.free_at >= nbytes), None)
        if slab is None:
            memory = self._allocate(max(self.slab_bytes, 2 << (nbytes - 1).bit_length()))
            slab = _Slab(memory, 0, _use_count(memory))
            self._slabs.append(slab)
        start = slab.free_at
        slab.free_at = min(slab.memory.numel(), -(-(start + nbytes) // ALIGN) * ALIGN)
        return slab.memory[start : start + nbytes].view(dtype).view(shape)

    def collect(self) -> None:
        """Let go of the slabs nothing views any longer (their memory goes back to torch,
        whose caching host allocator keeps it until its cache is emptied)."""
        self._slabs = [s for s in self._slabs if _use_count(s.memory) > s.unviewed]


def _use_count(t: Tensor) -> int:
    """How many tensors share ``t``'s storage (torch's own count, as its multiprocessing code
    reads it), the temporary storage object this call makes included; a count that never
    falls (so the slab is kept) where torch lacks the names (``rowcache.torch_seams``)."""
    count = lookup(STORAGE_USE_COUNT)
    storage = t.untyped_storage()
    cdata = getattr(storage, STORAGE_CDATA.path[-1], None)
    if count is None or cdata is None:
        return 1 << 30
    return int(count(cdata))


_ARENA: PinnedArena | None = None
_TRANSIENT: PinnedArena | None = None


def pinned_empty_exact(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor in the process's arena of pinned slabs (:class:`PinnedArena`): for what lives as
    long as the model. Needs a CUDA device (pinned memory)."""
    global _ARENA
    if _ARENA is None:
        _ARENA = PinnedArena()
    return _ARENA.empty(shape, dtype)


def releases_slabs() -> bool:
    """Whether an arena can tell that nothing views a slab any longer (torch's storage use
    count, ``rowcache.torch_seams``): without it a slab is kept for the process's life."""
    return lookup(STORAGE_USE_COUNT) is not None and lookup(STORAGE_CDATA) is not None


def pinned_empty_transient(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A pinned tensor for what lives only while a model loads (a layer's checkpoint tensors,
    released once the cache holds the experts in its own form), in an arena of its own: its
    slabs are freed by :func:`collect_transient` once every tensor in them is, where torch's
    own blocks round each request up to a power of two (the load-time peak of pinned memory).
    Torch's own block where an arena could not tell its slabs free (``releases_slabs``).
    Needs a CUDA device (pinned memory)."""
    global _TRANSIENT
    if not releases_slabs():
        return _pinned(shape, dtype)
    if _TRANSIENT is None:
        _TRANSIENT = PinnedArena()
    return _TRANSIENT.empty(shape, dtype)


def collect_transient() -> None:
    """Let go of the transient arena's slabs that nothing views any longer."""
    if _TRANSIENT is not None:
        _TRANSIENT.collect()


def pinned_memory() -> dict[str, int | None]:
    """What this process pins: torch's caching host allocator's blocks (``torch_host_bytes``,
    None where torch does not count them; every pinned tensor of torch's, vLLM's and the
    arenas' slabs alike) and of those the two arenas' slabs (``arena_bytes``,
    ``transient_bytes``)."""
    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    stats = stats_of() if stats_of is not None and torch.cuda.is_available() else {}
    allocated = stats.get("allocated_bytes.current")
    return {
        "torch_host_bytes": None if allocated is None else int(allocated),
        "arena_bytes": 0 if _ARENA is None else _ARENA.reserved_bytes,
        "transient_bytes": 0 if _TRANSIENT is None else _TRANSIENT.reserved_bytes,
    }

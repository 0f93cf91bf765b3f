"""The providers under test, built over shared pinned sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from rowcache.backends.cuda import CopyPath, CopyTiming, CudaBackend
from rowcache.cached import CachedWeightProvider
from rowcache.packing import Layout
from rowcache.row_provider import HostPlannedProvider
from rowcache.sources import SOURCE_NAMES
from rowcache.types import ExpertWeightResult

__all__ = ["PROVIDERS", "BenchProvider", "copy_path_of", "copy_timing_of"]


class BenchProvider(Protocol):
    def prepare(self, topk_ids: Tensor) -> ExpertWeightResult: ...

    def resident_experts(self) -> dict[int, int]: ...

    def stats(self) -> dict[str, int]: ...


Factory = Callable[[dict[str, Tensor], int, torch.device], BenchProvider]


def _weights(sources: dict[str, Tensor]) -> dict[str, Tensor | None]:
    """The provider constructors' weight arguments, from a geometry's source tensors."""
    return {name: sources.get(name) for name in SOURCE_NAMES}


def _row_with(
    copy: CopyPath,
    sources: dict[str, Tensor],
    capacity: int,
    device: torch.device,
    layout: Layout = "separate",
) -> HostPlannedProvider:
    return HostPlannedProvider(
        **_weights(sources),  # type: ignore[arg-type]
        capacity=capacity,
        device=device,
        backend=CudaBackend(device, copy=copy),
        layout=layout,
        # The geometry's pinned sources are shared by every provider of the run (the packed
        # layout copies them into its own buffer by design).
        share_sources=layout == "separate",
    )


def _row(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return _row_with("batched", sources, capacity, device)


def _row_packed(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return _row_with("batched", sources, capacity, device, layout="packed")


def _row_pt(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return _row_with("per_tensor", sources, capacity, device)


def _cached(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return CachedWeightProvider(
        **_weights(sources),  # type: ignore[arg-type]
        capacity=capacity,
        device=device,
        share_sources=True,
    )


PROVIDERS: dict[str, Factory] = {
    "row": _row,
    "row_packed": _row_packed,
    "row_pt": _row_pt,
    "cached": _cached,
}
"""``row``: ``RowCacheWeightProvider`` with its default CUDA backend (one batched copy call per
``prepare``, one entry per tensor per miss); ``row_packed``: the same with
``layout="packed"`` (one entry per miss, ``rowcache.packing``); ``row_pt``: the same provider
with per-tensor copies (one ``copy_`` per tensor per miss, ``CudaBackend(copy="per_tensor")``);
``cached``: the LFRU baseline ``CachedWeightProvider``."""


def _cuda_backend(provider: BenchProvider) -> CudaBackend | None:
    backend = getattr(provider, "backend", None)
    return backend if isinstance(backend, CudaBackend) else None


def copy_path_of(provider: BenchProvider) -> str | None:
    """The CUDA backend's copy path (``batched``, ``per_tensor``), None for other providers."""
    backend = _cuda_backend(provider)
    return None if backend is None else backend.copy_path


def copy_timing_of(provider: BenchProvider, enabled: bool) -> CopyTiming | None:
    """Switch the CUDA backend's copy timing on (a fresh ``CopyTiming``) or off; None when the
    provider has no such backend (``cached`` copies inside ``prepare`` on the current stream)."""
    backend = _cuda_backend(provider)
    if backend is None:
        return None
    backend.copy_timing = CopyTiming() if enabled else None
    return backend.copy_timing

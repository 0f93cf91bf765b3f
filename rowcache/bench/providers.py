"""The providers under test, built over shared pinned sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from rowcache.cached import CachedWeightProvider
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.types import ExpertWeightResult

__all__ = ["PROVIDERS", "BenchProvider"]


class BenchProvider(Protocol):
    def prepare(self, topk_ids: Tensor) -> ExpertWeightResult: ...

    def resident_experts(self) -> dict[int, int]: ...

    def stats(self) -> dict[str, int]: ...


Factory = Callable[[dict[str, Tensor], int, torch.device], BenchProvider]


def _row(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return RowCacheWeightProvider(
        sources["w13"],
        sources["w2"],
        sources.get("w13_scale"),
        sources.get("w2_scale"),
        w13_scale_2=sources.get("w13_scale_2"),
        w2_scale_2=sources.get("w2_scale_2"),
        capacity=capacity,
        device=device,
    )


def _cached(sources: dict[str, Tensor], capacity: int, device: torch.device) -> BenchProvider:
    return CachedWeightProvider(
        sources["w13"],
        sources["w2"],
        sources.get("w13_scale"),
        sources.get("w2_scale"),
        w13_scale_2=sources.get("w13_scale_2"),
        w2_scale_2=sources.get("w2_scale_2"),
        capacity=capacity,
        device=device,
    )


PROVIDERS: dict[str, Factory] = {"row": _row, "cached": _cached}
"""``row``: ``RowCacheWeightProvider``; ``cached``: the LFRU baseline ``CachedWeightProvider``."""

"""Driving the passes of one forward through a ``DevicePlannedProvider``.

The number of passes is the provider's ``num_passes(topk_ids)``, fixed by the shape. One pass:
``run``'s output is returned as is, so the result is bit-identical to the host path's single
kernel call. More: every pass runs over all rows (shared work only with the first) and the
partial outputs are summed in float32, then cast back to the first output's dtype; a pass that
exposes nothing contributes zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rowcache.errors import RowCacheError
from rowcache.types import ExpertWeightResult

__all__ = ["PassPlanned", "run_passes"]


@runtime_checkable
class PassPlanned(Protocol):
    def num_passes(self, topk_ids: Tensor) -> int: ...

    def prepare(
        self,
        topk_ids: Tensor,
        unique_ids: None = None,
        *,
        pass_index: int = 0,
        passes: int | None = None,
    ) -> ExpertWeightResult: ...


def run_passes(
    provider: PassPlanned,
    topk_ids: Tensor,
    run: Callable[[ExpertWeightResult, slice, bool], Tensor],
) -> Tensor:
    """``run(weights, rows, include_shared)`` once per pass; see the module docstring."""
    call = run
    rows = slice(0, topk_ids.shape[0])
    total = provider.num_passes(topk_ids)
    if total == 1:
        return call(provider.prepare(topk_ids, pass_index=0, passes=1), rows, True)
    summed: Tensor | None = None
    dtype = torch.float32
    for index in range(total):
        part = call(provider.prepare(topk_ids, pass_index=index, passes=total), rows, index == 0)
        if part.dim() == 0 or part.shape[0] != topk_ids.shape[0]:
            raise RowCacheError(
                f"run_with_expert_cache: run returned shape {tuple(part.shape)} for "
                f"{topk_ids.shape[0]} rows"
            )
        if summed is None:
            dtype = part.dtype
            summed = part.to(torch.float32, copy=True)
        else:
            summed.add_(part)
    assert summed is not None
    return summed.to(dtype)

"""Driving the passes of one forward through a ``DevicePlannedProvider``.

The number of passes is the provider's ``num_passes(topk_ids)``, fixed by the shape. Every pass
runs over all rows, shared work only with the first; a pass that exposes nothing contributes
nothing. Two routes:

* ``run_passes_unreduced`` (exact): ``run_unreduced`` returns each pass's per-entry outputs
  ``[M, top_k, H]`` unreduced; every pass's exposed entries are merged into one step buffer
  (``merge_pass``) and the caller's ``reduce`` runs once, after the last pass, over the whole
  step. The result has the bits of one kernel call with every expert resident, for any kernel
  whose per-entry outputs do not depend on which other experts are resident.
* ``run_passes`` (the ``run`` callback, reduced outputs): one pass returns ``run``'s output as
  is; more are summed in float32 and cast back to the first output's dtype. That sum rounds
  differently from one call that reduces each token's top-k outputs once, so a multi-pass step
  is not bit-identical to the single call: use it only where that is acceptable.

Both read nothing on the host and allocate only tensors whose shapes follow from the input
shapes, so a forward through either is captured into a CUDA graph once per batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rowcache.errors import RowCacheError
from rowcache.types import ExpertWeightResult

__all__ = [
    "PassPlanned",
    "check_rows",
    "check_unreduced",
    "exposed_entries",
    "merge_pass",
    "merge_passes",
    "reduce_once",
    "run_passes",
    "run_passes_unreduced",
    "sum_passes",
]


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


def _passes(
    provider: PassPlanned, topk_ids: Tensor
) -> tuple[Callable[[int], ExpertWeightResult], int]:
    """The ``prepare`` of each pass of this step (by index), and the number of passes."""
    total = provider.num_passes(topk_ids)
    return lambda index: provider.prepare(topk_ids, pass_index=index, passes=total), total


def run_passes(
    provider: PassPlanned,
    topk_ids: Tensor,
    run: Callable[[ExpertWeightResult, slice, bool], Tensor],
) -> Tensor:
    """``run(weights, rows, include_shared)`` once per pass; see the module docstring (a
    multi-pass step is summed in float32: not bit-identical to one call)."""
    prepare, total = _passes(provider, topk_ids)
    if total == 1:
        return run(prepare(0), slice(0, topk_ids.shape[0]), True)
    return sum_passes(prepare, total, topk_ids, run)


def sum_passes(
    prepare: Callable[[int], ExpertWeightResult],
    count: int,
    topk_ids: Tensor,
    run: Callable[[ExpertWeightResult, slice, bool], Tensor],
) -> Tensor:
    """``run(prepare(index), every row, index == 0)`` for each of ``count`` passes, in order,
    the outputs summed in float32 and cast back to the first output's dtype.

    Shared by ``run_passes`` and the host planner's expert split
    (``rowcache.forward.run_with_expert_cache``). Not bit-identical to one call that reduces
    each token's top-k outputs once; the unreduced route (``merge_passes``) is.
    """
    rows = slice(0, topk_ids.shape[0])
    summed: Tensor | None = None
    dtype = torch.float32
    for index in range(count):
        part = run(prepare(index), rows, index == 0)
        check_rows(part, rows)
        if summed is None:
            dtype = part.dtype
            # A copy even for float32 output: run may return a buffer it reuses.
            summed = part.to(torch.float32, copy=True)
        else:
            summed.add_(part)
    assert summed is not None
    return summed.to(dtype)


def check_rows(output: Tensor, rows: slice) -> None:
    """Raise unless ``output``'s first dimension is the number of ``rows`` (``run``'s)."""
    expected = rows.stop - rows.start
    if output.dim() == 0 or output.shape[0] != expected:
        raise RowCacheError(
            f"run_with_expert_cache: run returned shape {tuple(output.shape)} for rows "
            f"{rows.start}:{rows.stop}, expected a first dimension of {expected}"
        )


def check_unreduced(part: Tensor, topk_ids: Tensor, rows: slice) -> None:
    """Raise unless ``part`` is ``[rows, top_k, ...]`` for these rows of ``topk_ids``."""
    expected = (rows.stop - rows.start, topk_ids.shape[1] if topk_ids.dim() == 2 else -1)
    if part.dim() < 3 or tuple(part.shape[:2]) != expected:
        raise RowCacheError(
            f"run_unreduced_with_expert_cache: run_unreduced returned shape "
            f"{tuple(part.shape)} for rows {rows.start}:{rows.stop}, expected "
            f"[{expected[0]}, {expected[1]}, ...] (rows, top_k, hidden)"
        )


def exposed_entries(expert_map: Tensor, topk_ids: Tensor) -> Tensor:
    """``[M, top_k]`` booleans: the routing entries whose expert ``expert_map`` maps to a slot.

    Padding (-1) and ids outside ``[0, E)`` (which the device planner ignores and counts) are
    never exposed; they are not used as indices either (index 0 stands in for them), so
    nothing here reads outside the map or asks the host about a device value.
    """
    ids = topk_ids.to(device=expert_map.device, dtype=torch.long)
    valid = (ids >= 0) & (ids < expert_map.shape[0])
    slots = expert_map[torch.where(valid, ids, torch.zeros_like(ids))]
    return valid & (slots >= 0)


def merge_pass(step: Tensor, part: Tensor, exposed: Tensor) -> None:
    """Take into ``step`` the entries of ``part`` that its pass exposed; keep the others.

    A selection, not a sum: each entry of ``step`` ends up holding the bits the pass that
    exposed it computed, which is what one call with every expert resident computes for it.
    Adding the passes would also be exact for finite values (an entry is exposed by one pass
    and every other pass writes zero there), but it loses signed zeros (-0.0 + 0.0 is +0.0)
    and it depends on the kernel writing zeros, not leaving stale bytes, for the entries a
    pass does not expose (vLLM 0.33.0's Triton kernel leaves them unwritten under an expert
    map). ``torch.where`` reads nothing from the unexposed entries and keeps every bit of
    the exposed ones. Elementwise with ``out=step``: no allocation depending on values.
    """
    torch.where(exposed.to(part.device).unsqueeze(-1), part, step, out=step)


def run_passes_unreduced(
    provider: PassPlanned,
    topk_ids: Tensor,
    run_unreduced: Callable[[ExpertWeightResult, slice, bool], Tensor],
    reduce: Callable[[Tensor, Tensor], None],
) -> Tensor:
    """The exact route of the module docstring; returns the output ``reduce`` wrote
    (``merge_passes`` over the provider's passes)."""
    return merge_passes(*_passes(provider, topk_ids), topk_ids, run_unreduced, reduce)


def merge_passes(
    prepare: Callable[[int], ExpertWeightResult],
    count: int,
    topk_ids: Tensor,
    run_unreduced: Callable[[ExpertWeightResult, slice, bool], Tensor],
    reduce: Callable[[Tensor, Tensor], None],
) -> Tensor:
    """``run_unreduced(prepare(index), every row, index == 0)`` for each of ``count`` passes,
    in order, merged into one step buffer and reduced once; returns the output ``reduce``
    wrote.

    Shared by ``run_passes_unreduced`` and the host planner's expert split
    (``rowcache.forward.run_unreduced_with_expert_cache``). One pass: ``reduce(part,
    output)`` over that pass's output as it is. More: a zeroed step buffer of the first
    pass's shape and dtype, each pass's exposed entries merged into it (``merge_pass``;
    entries no pass exposes, such as padding, stay +0), then ``reduce(step, output)`` once.
    ``output`` is allocated here, ``[M, *part.shape[2:]]`` in ``part``'s dtype.
    """
    rows = slice(0, topk_ids.shape[0])
    step: Tensor | None = None
    for index in range(count):
        weights = prepare(index)
        part = run_unreduced(weights, rows, index == 0)
        check_unreduced(part, topk_ids, rows)
        if count == 1:
            return reduce_once(reduce, part)
        if step is None:
            step = torch.zeros_like(part, memory_format=torch.contiguous_format)
        # Before the next prepare rewrites the map (stream order on the device).
        merge_pass(step, part, exposed_entries(weights.expert_map, topk_ids))
    assert step is not None
    return reduce_once(reduce, step)


def reduce_once(reduce: Callable[[Tensor, Tensor], None], unreduced: Tensor) -> Tensor:
    """``reduce(unreduced, output)`` into a fresh ``[M, *unreduced.shape[2:]]`` output."""
    output = unreduced.new_empty((unreduced.shape[0], *unreduced.shape[2:]))
    reduce(unreduced, output)
    return output

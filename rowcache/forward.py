"""Evaluating one MoE forward through a provider whose slots may not hold all its experts.

The callback contract (``RunFn``): ``run(weights, rows, include_shared)``
returns the MoE output for token rows ``rows`` of the layer input, computed
only from experts that ``weights.expert_map`` maps to a slot (global id ->
slot, -1 elsewhere); a (token, expert) pair whose expert maps to -1
contributes nothing. An entry -1 of ``topk_ids`` is padding
(``rowcache.validation.PADDING``): it names no expert, is never planned or
requested, and ``run`` skips it as vLLM's kernels do (it is not an index into
the map). ``include_shared`` says whether to add the shared
expert's (or any other once-per-token) output. ``run`` must enqueue all its
reads of the slot buffers before it returns, because the next ``prepare`` may
overwrite them. It returns a tensor whose first dimension is the number of
rows in ``rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch
from torch import Tensor

from rowcache.device_plan.forward import PassPlanned, run_passes
from rowcache.errors import InvalidInputError, RowCacheError
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

__all__ = ["RunFn", "run_with_expert_cache"]

RunFn: TypeAlias = Callable[[ExpertWeightResult, slice, bool], Tensor]
"""``run(weights, rows, include_shared) -> output rows``; see the module docstring."""


def _check_rows(output: Tensor, rows: slice, expected: int) -> None:
    if output.dim() == 0 or output.shape[0] != expected:
        raise RowCacheError(
            f"run_with_expert_cache: run returned shape {tuple(output.shape)} for rows "
            f"{rows.start}:{rows.stop}, expected a first dimension of {expected}"
        )


def run_with_expert_cache(provider: ExpertWeightProvider, topk_ids: Tensor, run: RunFn) -> Tensor:
    """Compute the MoE output for every row of ``topk_ids`` through ``provider``'s slots.

    ``provider.split`` decides how a forward with more experts than slots is
    cut. ``"token"``: one ``prepare`` per chunk of rows from ``plan_chunks``,
    each chunk's output written into its rows, shared work included in every
    chunk (each row belongs to exactly one). ``"expert"``: one ``prepare`` per
    group from ``plan_expert_groups`` over all rows, partial outputs summed in
    float32 (so the order of groups costs no low-precision rounding), shared
    work only with the first group, the sum cast back to the first output's
    dtype. When everything fits, there is a single ``prepare`` and ``run``'s
    output is returned as is; so it is for a routing of only padding (-1),
    whose one ``prepare`` requests nothing.

    A device-planned provider (``rowcache.device_plan``) runs the number of passes its
    ``num_passes(topk_ids)`` fixes by the shape, without reading ``topk_ids`` on the host
    (``rowcache.device_plan.forward.run_passes``), so the forward can be captured.
    """
    if isinstance(provider, PassPlanned):
        return run_passes(provider, topk_ids, run)
    split = provider.split
    if split == "token":
        chunks = plan_chunks(topk_ids, provider.capacity)
        if len(chunks) <= 1:
            return run(provider.prepare(topk_ids), slice(0, topk_ids.shape[0]), True)
        return _token_split(provider, topk_ids, run, chunks)
    if split == "expert":
        groups = plan_expert_groups(topk_ids, provider.capacity)
        if len(groups) <= 1:
            return run(provider.prepare(topk_ids), slice(0, topk_ids.shape[0]), True)
        return _expert_split(provider, topk_ids, run, groups)
    raise InvalidInputError(f"run_with_expert_cache: unknown split {split!r}")


def _token_split(
    provider: ExpertWeightProvider,
    topk_ids: Tensor,
    run: RunFn,
    chunks: list[tuple[int, int]],
) -> Tensor:
    out: Tensor | None = None
    for start, stop in chunks:
        rows = slice(start, stop)
        part = run(provider.prepare(topk_ids[rows]), rows, True)
        _check_rows(part, rows, stop - start)
        if out is None:
            out = part.new_empty((topk_ids.shape[0], *part.shape[1:]))
        out[rows] = part
    assert out is not None
    return out


def _expert_split(
    provider: ExpertWeightProvider,
    topk_ids: Tensor,
    run: RunFn,
    groups: list[list[int]],
) -> Tensor:
    every_row = slice(0, topk_ids.shape[0])
    total: Tensor | None = None
    dtype = torch.float32
    for index, group in enumerate(groups):
        part = run(provider.prepare(topk_ids, unique_ids=group), every_row, index == 0)
        _check_rows(part, every_row, topk_ids.shape[0])
        if total is None:
            dtype = part.dtype
            # A copy even for float32 output: run may return a buffer it reuses.
            total = part.to(torch.float32, copy=True)
        else:
            total.add_(part)
    assert total is not None
    return total.to(dtype)

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

Two routes. ``run_with_expert_cache(provider, topk_ids, run)`` takes reduced outputs: when
everything fits it returns ``run``'s output as is, but a step cut by expert groups (the host
planner's ``"expert"`` split, or several passes of the device planner) sums the groups'
outputs in float32, which rounds differently from one kernel call that reduces each token's
top-k outputs once: not bit-identical. ``run_unreduced_with_expert_cache(provider, topk_ids,
run_unreduced, reduce)`` is exact: ``run_unreduced(weights, rows, include_shared)`` returns
the rows' per-entry outputs ``[rows, top_k, H]`` unreduced (each token's output for each of
its routing entries, router weights applied; any value for an entry whose expert maps to -1,
which is never read), the library merges every call's exposed entries into one step buffer
and calls ``reduce(step_buffer, output)`` exactly once per step, after the last call. The
returned tensor is read (in stream order) before the next ``prepare`` or ``run_unreduced``,
so it may be a workspace that the next call overwrites. Shared work goes with the first call
of a group split or pass split and with every chunk of a token split (each row in one chunk),
as for ``run``; where its output goes is the caller's business (``reduce`` may add it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from torch import Tensor

from rowcache.device_plan.forward import (
    PassPlanned,
    check_rows,
    check_unreduced,
    merge_passes,
    reduce_once,
    run_passes,
    run_passes_unreduced,
    sum_passes,
)
from rowcache.errors import InvalidInputError
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

__all__ = [
    "ReduceFn",
    "RunFn",
    "UnreducedRunFn",
    "run_unreduced_with_expert_cache",
    "run_with_expert_cache",
]

RunFn: TypeAlias = Callable[[ExpertWeightResult, slice, bool], Tensor]
"""``run(weights, rows, include_shared) -> output rows``; see the module docstring."""

UnreducedRunFn: TypeAlias = Callable[[ExpertWeightResult, slice, bool], Tensor]
"""``run_unreduced(weights, rows, include_shared) -> [rows, top_k, H]`` per-entry outputs."""

ReduceFn: TypeAlias = Callable[[Tensor, Tensor], None]
"""``reduce(unreduced [M, top_k, H], output [M, H])``: writes each token's reduction."""


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

    The float32 sum of a step cut by experts is not bit-identical to one kernel call:
    ``run_unreduced_with_expert_cache`` is the exact route.
    """
    if isinstance(provider, PassPlanned):
        return run_passes(provider, topk_ids, run)
    split = provider.split
    if split == "token":
        chunks = plan_chunks(topk_ids, provider.capacity)
        if len(chunks) <= 1:
            return run(provider.prepare(topk_ids), slice(0, topk_ids.shape[0]), True)
        return _token_split(provider, topk_ids, run, chunks, check_rows)
    if split == "expert":
        groups = _step_groups(provider, topk_ids)
        if len(groups) <= 1:
            return run(provider.prepare(topk_ids), slice(0, topk_ids.shape[0]), True)
        # Reduced outputs summed in float32: not bit-identical to one call (see the module
        # docstring); run_unreduced_with_expert_cache is the exact route.
        return sum_passes(
            lambda index: provider.prepare(topk_ids, unique_ids=groups[index]),
            len(groups),
            topk_ids,
            run,
        )
    raise InvalidInputError(f"run_with_expert_cache: unknown split {split!r}")


def run_unreduced_with_expert_cache(
    provider: ExpertWeightProvider,
    topk_ids: Tensor,
    run_unreduced: UnreducedRunFn,
    reduce: ReduceFn,
) -> Tensor:
    """The MoE output for every row of ``topk_ids``, bit-identical to one call with every
    expert resident; see the module docstring for the callbacks.

    The step is cut as ``run_with_expert_cache`` cuts it (``provider.split``, or the passes of
    a device-planned provider). When it is not cut, ``reduce(part, output)`` runs over
    ``run_unreduced``'s output as it is. A token split writes each chunk's rows into a step
    buffer; an expert split or several passes merge each call's exposed entries (those whose
    expert the call's ``expert_map`` maps to a slot) into a zeroed step buffer, taking them,
    not adding them (``rowcache.device_plan.forward.merge_pass`` says why); entries no call
    exposes, such as padding, stay +0. Then ``reduce(step_buffer, output)``, once. ``output``
    is allocated here (``[M, H]``, the dtype of ``run_unreduced``'s output) and returned.

    With a device-planned provider nothing is read on the host and every allocation's shape
    follows from the input shapes, so the forward can be captured into a CUDA graph.
    """
    if isinstance(provider, PassPlanned):
        return run_passes_unreduced(provider, topk_ids, run_unreduced, reduce)
    every_row = slice(0, topk_ids.shape[0])
    split = provider.split
    if split == "token":
        chunks = plan_chunks(topk_ids, provider.capacity)
        if len(chunks) <= 1:
            part = run_unreduced(provider.prepare(topk_ids), every_row, True)
            check_unreduced(part, topk_ids, every_row)
            return reduce_once(reduce, part)
        step = _token_split(
            provider,
            topk_ids,
            run_unreduced,
            chunks,
            lambda part, rows: check_unreduced(part, topk_ids, rows),
        )
        return reduce_once(reduce, step)
    if split == "expert":
        groups = _step_groups(provider, topk_ids)
        return merge_passes(
            lambda index: provider.prepare(topk_ids, unique_ids=groups[index]),
            len(groups),
            topk_ids,
            run_unreduced,
            reduce,
        )
    raise InvalidInputError(f"run_unreduced_with_expert_cache: unknown split {split!r}")


def _step_groups(provider: ExpertWeightProvider, topk_ids: Tensor) -> list[list[int]]:
    """The expert groups of a step cut by experts (one ``prepare`` each, in this order): the
    provider's own when it orders a step (``HostPlannedProvider.step_groups``: the step's
    hits first, so no group evicts an expert a later one needs while another victim exists),
    else the sorted experts cut into groups (``plan_expert_groups``)."""
    step_groups = getattr(provider, "step_groups", None)
    if callable(step_groups):
        groups: list[list[int]] = step_groups(topk_ids)
        return groups
    return plan_expert_groups(topk_ids, provider.capacity)


def _token_split(
    provider: ExpertWeightProvider,
    topk_ids: Tensor,
    run: RunFn,
    chunks: list[tuple[int, int]],
    check: Callable[[Tensor, slice], None],
) -> Tensor:
    """``run`` once per chunk of rows, shared work in each, every output checked by
    ``check(part, rows)`` and written into its rows of one step buffer (of the first
    output's dtype and trailing shape): the reduced output, or the unreduced entries of the
    exact route."""
    out: Tensor | None = None
    for start, stop in chunks:
        rows = slice(start, stop)
        part = run(provider.prepare(topk_ids[rows]), rows, True)
        check(part, rows)
        if out is None:
            out = part.new_empty((topk_ids.shape[0], *part.shape[1:]))
        out[rows] = part
    assert out is not None
    return out

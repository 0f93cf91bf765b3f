"""Splitting a forward whose experts do not fit in the slots.

Two plans, one per ``Split``: token chunks (row ranges each needing at most
``capacity`` experts) and expert groups (the routed experts cut into groups of
at most ``capacity``). ``-1`` in ``topk_ids`` is padding (``rowcache.validation.PADDING``):
it names no expert, so it is never counted or grouped, and a row of only -1 fits any chunk.
Planning does not range-check the other ids (it does not know E); ``prepare`` does, for
every piece.
"""

from __future__ import annotations

from torch import Tensor

from rowcache.errors import InvalidInputError

# _routed_experts: the distinct experts, with prepare's fast path for a small CPU tensor (a
# Python set instead of torch.unique's dispatch and sort); shared so that planning and
# validation cannot disagree on what a routing holds.
from rowcache.validation import PADDING, _routed_experts, check_topk_ids

__all__ = ["plan_chunks", "plan_expert_groups"]


def _check_capacity(capacity: object, op: str) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidInputError(
            f"{op}: capacity must be an int, got {capacity!r} ({type(capacity).__name__})"
        )
    if capacity <= 0:
        raise InvalidInputError(f"{op}: capacity must be positive, got {capacity}")
    return capacity


def plan_chunks(topk_ids: Tensor, capacity: int) -> list[tuple[int, int]]:
    """Cut the token rows into half-open ranges whose distinct experts fit ``capacity``.

    Greedy: each chunk extends until the next row would push its distinct
    experts past ``capacity``, so chunks are maximal and as few as a
    front-to-back scan can make them. Empty ``topk_ids`` gives ``[]``. A single
    row that routes to more distinct experts than ``capacity`` cannot be
    served by any chunk and is rejected. Padding (-1) is not an expert: it
    counts toward no chunk.
    """
    check_topk_ids(topk_ids, "plan_chunks")
    _check_capacity(capacity, "plan_chunks")
    num_rows = topk_ids.shape[0]
    if num_rows == 0:
        return []
    # Decode batches usually fit whole. No more entries than slots: they fit without reading
    # a value (no host transfer for a device tensor). Otherwise one count of the distinct
    # experts instead of a row scan.
    if topk_ids.numel() <= capacity or len(_routed_experts(topk_ids)) <= capacity:
        return [(0, num_rows)]

    chunks: list[tuple[int, int]] = []
    start = 0
    seen: set[int] = set()
    rows: list[list[int]] = topk_ids.tolist()
    for index, row in enumerate(rows):
        row_experts = set(row)
        row_experts.discard(PADDING)
        if len(row_experts) > capacity:
            raise InvalidInputError(
                f"plan_chunks: token row {index} routes to {len(row_experts)} distinct "
                f"experts but capacity is {capacity}"
            )
        seen |= row_experts
        if len(seen) > capacity:
            chunks.append((start, index))
            start = index
            seen = row_experts
    chunks.append((start, num_rows))
    return chunks


def plan_expert_groups(topk_ids: Tensor, capacity: int) -> list[list[int]]:
    """Cut the sorted distinct experts of ``topk_ids`` (padding, -1, dropped) into
    consecutive groups.

    Every group but the last holds exactly ``capacity`` experts; empty
    ``topk_ids``, or one of only padding, gives ``[]``.
    """
    check_topk_ids(topk_ids, "plan_expert_groups")
    _check_capacity(capacity, "plan_expert_groups")
    experts = _routed_experts(topk_ids)
    return [experts[i : i + capacity] for i in range(0, len(experts), capacity)]

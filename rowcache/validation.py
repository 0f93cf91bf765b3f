"""Validation of a ``prepare`` request, done in full before any side effect.

``requested_experts`` is the single place that turns ``(topk_ids, unique_ids)``
into the set of experts a call makes resident and exposes, so that every
provider agrees on what a request means and on which requests are rejected.

Semantics of ``unique_ids`` (shared by all providers):

* ``None``: the request is the set of distinct values of ``topk_ids``.
* given: the request is *exactly* ``unique_ids`` (its -1 entries dropped): no duplicates,
  every id in ``[0, E)``, and every id routed to by at least one entry of ``topk_ids``. It
  need not cover ``topk_ids``: the expert split passes one group of the routed
  experts at a time, and the entries of ``topk_ids`` outside the group see -1 in
  the map. An id no token routes to is rejected rather than silently loaded,
  because it can only come from a stale or mismatched group and would cost a
  slot (and possibly evict an expert that is needed).

In both cases ``topk_ids`` itself is checked in full (integer, rank 2, every
value in ``[0, E)`` or ``-1``), because the consumer indexes the map with every
value but -1. The request may hold at most ``capacity`` experts.

``-1`` (``PADDING``) is padding, as in vLLM and the peer providers: in ``topk_ids`` or in
``unique_ids`` it names no expert. It is not counted, not requested, not mapped (the
consumer skips such entries, as vLLM's kernels do) and never an error; a routing of only
-1 is a valid request for nothing. Every other negative id is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.types import UniqueIds

__all__ = ["PADDING", "check_topk_ids", "is_integer_dtype", "requested_experts"]

PADDING = -1
"""The id of a ``topk_ids`` (or ``unique_ids``) entry that names no expert."""


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for the integer dtypes (bool excluded: it is not an expert id)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _device_accepted(actual: torch.device, expected: torch.device | None) -> bool:
    if expected is None or actual.type == "cpu":
        return True
    if actual.type != expected.type:
        return False
    # "cuda" without an index means the current device, so it matches any index.
    return actual.index is None or expected.index is None or actual.index == expected.index


def check_topk_ids(topk_ids: object, op: str, device: torch.device | None = None) -> Tensor:
    """Return ``topk_ids`` if it is an integer tensor of rank 2 on an accepted device.

    Accepted devices are the CPU and ``device`` (the provider's), or any when
    ``device`` is None.
    """
    if not isinstance(topk_ids, Tensor):
        raise InvalidInputError(
            f"{op}: topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}"
        )
    if not is_integer_dtype(topk_ids.dtype):
        raise InvalidInputError(f"{op}: topk_ids must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise InvalidInputError(
            f"{op}: topk_ids must have rank 2 [tokens, k], got rank {topk_ids.dim()} "
            f"(shape {tuple(topk_ids.shape)})"
        )
    # ``is_cpu`` first: reading ``.device`` builds a device object, on every prepare.
    if not (topk_ids.is_cpu or _device_accepted(topk_ids.device, device)):
        raise InvalidInputError(
            f"{op}: topk_ids is on {topk_ids.device} but the provider is on {device} "
            "(accepted: cpu or the provider's device)"
        )
    return topk_ids


def _unique_ids_list(unique_ids: object, op: str, device: torch.device | None) -> list[int]:
    if isinstance(unique_ids, Tensor):
        if not is_integer_dtype(unique_ids.dtype):
            raise InvalidInputError(
                f"{op}: unique_ids must have an integer dtype, got {unique_ids.dtype}"
            )
        if unique_ids.dim() != 1:
            raise InvalidInputError(
                f"{op}: unique_ids must have rank 1, got rank {unique_ids.dim()} "
                f"(shape {tuple(unique_ids.shape)})"
            )
        if not _device_accepted(unique_ids.device, device):
            raise InvalidInputError(
                f"{op}: unique_ids is on {unique_ids.device} but the provider is on {device}"
            )
        ids: list[int] = unique_ids.tolist()
        return ids
    if isinstance(unique_ids, str | bytes) or not isinstance(unique_ids, Sequence):
        raise InvalidInputError(
            f"{op}: unique_ids must be an integer tensor or a sequence of ints, "
            f"got {type(unique_ids).__name__}"
        )
    bad = next((x for x in unique_ids if isinstance(x, bool) or not isinstance(x, int)), None)
    if bad is not None:
        raise InvalidInputError(
            f"{op}: unique_ids must be a flat sequence of ints, found {bad!r} "
            f"({type(bad).__name__})"
        )
    return list(unique_ids)


def _first_duplicate(ordered: list[int]) -> int | None:
    """The lowest id that ``ordered`` (ascending) holds more than once."""
    return next((a for a, b in pairwise(ordered) if a == b), None)


SMALL_ROUTING = 2048
"""Up to this many entries, a CPU ``topk_ids`` is reduced with a Python set: for a decode
step (a few tokens times top-k) that costs a few microseconds, where ``torch.unique``'s
dispatch and sort cost tens."""


def _without_padding(ids: list[int]) -> list[int]:
    """``ids`` (ascending) without ``PADDING``; the list itself when it holds no negative."""
    if ids and ids[0] < 0:
        return [e for e in ids if e != PADDING]
    return ids


def _routed_experts(topk_ids: Tensor) -> list[int]:
    """The distinct values of ``topk_ids`` (rank 2, checked) but ``PADDING``, ascending."""
    if topk_ids.is_cpu and topk_ids.numel() <= SMALL_ROUTING:
        # The nested list flattened in Python: a reshape's dispatch costs more than the loop.
        routed = sorted({expert for row in topk_ids.tolist() for expert in row})
    else:
        routed = torch.unique(topk_ids).tolist()
    return _without_padding(routed)


def _out_of_range(ids: list[int], num_experts: int) -> int | None:
    """An id of ``ids`` (ascending, padding dropped) outside ``[0, num_experts)``: the lowest
    when one is negative, else the highest; None when all are inside."""
    if ids and ids[0] < 0:
        return ids[0]
    if ids and ids[-1] >= num_experts:
        return ids[-1]
    return None


def requested_experts(
    topk_ids: Tensor,
    unique_ids: UniqueIds | None,
    num_experts: int,
    capacity: int,
    *,
    device: torch.device | None = None,
    op: str = "prepare",
) -> list[int]:
    """Validate a request and return its experts, sorted and unique.

    Raises ``InvalidInputError`` (naming the offending value and the limit) and
    has no side effect, so a provider that calls it first stays unchanged on
    rejection. Costs one ``torch.unique`` of ``topk_ids`` and one host transfer
    of its result (a Python set for a small CPU ``topk_ids``); nothing loops over all E
    experts.
    """
    return requested_and_routed(topk_ids, unique_ids, num_experts, capacity, device=device, op=op)[
        0
    ]


def requested_and_routed(
    topk_ids: Tensor,
    unique_ids: UniqueIds | None,
    num_experts: int,
    capacity: int,
    *,
    device: torch.device | None = None,
    op: str = "prepare",
) -> tuple[list[int], list[int]]:
    """Validate a request; return its experts and every expert ``topk_ids`` routes to (the
    step's), each sorted and unique.

    Raises ``InvalidInputError`` (naming the offending value and the limit) and
    has no side effect, so a provider that calls it first stays unchanged on
    rejection. Costs one ``torch.unique`` of ``topk_ids`` and one host transfer
    of its result (a Python set for a small CPU ``topk_ids``); nothing loops over all E
    experts.
    """
    check_topk_ids(topk_ids, op, device)
    routed = _routed_experts(topk_ids)
    value = _out_of_range(routed, num_experts)
    if value is not None:
        raise InvalidInputError(
            f"{op}: topk_ids holds expert id {value}, outside [0, {num_experts}) "
            f"({PADDING} is padding)"
        )

    if unique_ids is None:
        requested = routed
    else:
        ids = _without_padding(sorted(_unique_ids_list(unique_ids, op, device)))
        value = _out_of_range(ids, num_experts)
        if value is not None:
            raise InvalidInputError(
                f"{op}: unique_ids holds expert id {value}, outside [0, {num_experts}) "
                f"({PADDING} is padding)"
            )
        duplicate = _first_duplicate(ids)
        if duplicate is not None:
            raise InvalidInputError(f"{op}: unique_ids names expert {duplicate} more than once")
        unrouted = set(ids).difference(routed)
        if unrouted:
            raise InvalidInputError(
                f"{op}: unique_ids names expert {min(unrouted)}, which no entry of "
                "topk_ids routes to (unique_ids must be a subset of topk_ids' experts)"
            )
        requested = ids

    if len(requested) > capacity:
        raise InvalidInputError(
            f"{op}: {len(requested)} unique experts requested but capacity is {capacity}"
        )
    return requested, routed

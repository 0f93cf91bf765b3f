"""The device tensors of one layer's cache, and what the host reads back off them.

Everything a pass reads or writes lives here, on the cache's device, at a fixed address for
the cache's lifetime (a captured graph holds these addresses):

* ``resident`` ``[E]`` int32: the slot of every expert, -1 when not resident (the resident
  map);
* ``owners`` ``[C]`` int32: the expert in every slot, -1 when the slot is free;
* ``stamps`` ``[C]`` int64: the last-use stamp of every slot's expert (LRU order: smaller is
  older); meaningless for a free slot;
* ``clock`` ``[1]`` int64: the next stamp;
* ``counts`` ``[E]`` int32: every expert's request count under policy ``lfu``
  (``rowcache.policy``; all 0 and unused under ``lru``, ``count_max`` 0);
* ``forward`` ``[E]`` int32: the forward map of the last pass, the ``expert_map`` a kernel
  reads: the slot of every expert this pass exposes, -1 elsewhere;
* ``miss_experts`` / ``miss_slots`` ``[C]`` int32 and ``miss_count`` ``[1]`` int32: the copies
  the last pass needs, in ascending expert order (entries past ``miss_count`` are stale);
* ``counters`` ``[len(COUNTERS)]`` int64 and ``first_bad`` ``[1]`` int64: what ``stats()``
  reports, and the first id outside ``[-1, E)`` seen;
* ``step_rank`` ``[E]`` int32: the step's order, written by its first pass when the step
  needs more than one pass (else all -1): every requested expert's position, its hits first
  (``rowcache.device_plan.torch_planner``); later passes of the step read it;
* ``marks`` ``[E]`` int32 and ``order`` ``[C]`` int32: scratch of the fused planner.

The host never reads these on the hot path; ``read_counters`` copies them back on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.errors import RowCacheError

__all__ = [
    "COUNTERS",
    "PLANNED_FIELDS",
    "DeviceCacheState",
    "DeviceInputError",
    "first_difference",
    "new_state",
    "read_counters",
]

COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "prepare_calls",
    "passes",
    "bad_ids",
    "overflow",
    "invalidations",
)
"""Device counters in storage order. ``prepare_calls`` counts the passes that exposed at least
one expert and the first pass of every step (the host path's ``prepare`` calls: one per expert
group, one for a step of padding only); ``passes`` counts every pass, empty ones too;
``bad_ids`` counts ``topk_ids`` entries outside ``[-1, E)``; ``overflow`` counts requested
experts that no pass of the step exposed (more distinct experts than ``passes x capacity``)."""

HITS, MISSES, EVICTIONS, PREPARE_CALLS, PASSES, BAD_IDS, OVERFLOW, INVALIDATIONS = range(
    len(COUNTERS)
)


class DeviceInputError(RowCacheError, ValueError):
    """The device met input it could not serve: ids outside ``[-1, E)`` or a step with more
    distinct experts than its passes expose.

    The device cannot raise: such ids were treated as "no expert" (nothing written for them,
    nothing out of bounds) and counted. The host raises this at the next point where it
    reads the device's counters (``stats()``, ``check_errors()``), naming the count, the first
    offending value and the limit.
    """


@dataclass(frozen=True)
class DeviceCacheState:
    """One layer's cache state on the device (see the module docstring)."""

    num_experts: int
    capacity: int
    resident: Tensor
    owners: Tensor
    stamps: Tensor
    clock: Tensor
    counts: Tensor
    forward: Tensor
    miss_experts: Tensor
    miss_slots: Tensor
    miss_count: Tensor
    counters: Tensor
    first_bad: Tensor
    marks: Tensor
    order: Tensor
    step_rank: Tensor
    count_max: int = 0
    """Policy ``lfu``: the counts' saturation (``rowcache.policy``); 0: policy ``lru``."""


def new_state(
    num_experts: int, capacity: int, device: torch.device, count_max: int = 0
) -> DeviceCacheState:
    """An empty cache: every slot free, every map entry -1, counters zero; victims by request
    count when ``count_max`` (policy ``lfu``), else least recently used."""

    def full(n: int, value: int, dtype: torch.dtype) -> Tensor:
        return torch.full((n,), value, dtype=dtype, device=device)

    return DeviceCacheState(
        num_experts=num_experts,
        capacity=capacity,
        resident=full(num_experts, -1, torch.int32),
        owners=full(capacity, -1, torch.int32),
        stamps=full(capacity, 0, torch.int64),
        clock=full(1, 0, torch.int64),
        counts=full(num_experts, 0, torch.int32),
        forward=full(num_experts, -1, torch.int32),
        miss_experts=full(capacity, -1, torch.int32),
        miss_slots=full(capacity, -1, torch.int32),
        miss_count=full(1, 0, torch.int32),
        counters=full(len(COUNTERS), 0, torch.int64),
        first_bad=full(1, 0, torch.int64),
        marks=full(num_experts, 0, torch.int32),
        order=full(capacity, 0, torch.int32),
        step_rank=full(num_experts, -1, torch.int32),
        count_max=count_max,
    )


def read_counters(state: DeviceCacheState) -> tuple[dict[str, int], int]:
    """The counters by name and the first bad id, copied to the host (this waits for the
    device work enqueued so far on the current stream: never call it on the hot path)."""
    values = state.counters.tolist()
    return dict(zip(COUNTERS, values, strict=True)), int(state.first_bad.item())


def error_message(counters: dict[str, int], first_bad: int, num_experts: int) -> str | None:
    """The message of the ``DeviceInputError`` these counters call for, or None."""
    parts: list[str] = []
    if counters["bad_ids"]:
        parts.append(
            f"{counters['bad_ids']} topk_ids entries outside [-1, {num_experts}) were ignored "
            f"(the first was {first_bad})"
        )
    if counters["overflow"]:
        parts.append(
            f"{counters['overflow']} requested experts were not exposed by any pass (a step "
            "routed to more distinct experts than its passes x capacity)"
        )
    return "; ".join(parts) if parts else None


PLANNED_FIELDS = (
    "resident",
    "owners",
    "stamps",
    "clock",
    "counts",
    "forward",
    "miss_experts",
    "miss_slots",
    "miss_count",
    "counters",
)
"""The fields a planner pass leaves that the next pass or the gather reads (the scratch
``marks``, ``order`` and ``step_rank`` are not compared)."""


def first_difference(a: DeviceCacheState, b: DeviceCacheState) -> str | None:
    """The first of :data:`PLANNED_FIELDS` where the torch planner's state ``a`` and the fused
    planner's ``b`` differ, with both values; None where they agree (the miss lists only up to
    the miss count: entries past it are stale). Copies to the host: checks only."""
    for name in PLANNED_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if name in ("miss_experts", "miss_slots"):
            n = int(a.miss_count.item())
            x, y = x[:n], y[:n]
        if not torch.equal(x.to(torch.int64).cpu(), y.to(torch.int64).cpu()):
            return f"{name}: torch {x.tolist()}, fused {y.tolist()}"
    return None

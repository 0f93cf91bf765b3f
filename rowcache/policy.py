"""Victim policies: which resident expert a miss evicts when no slot is free.

Both planners take victims among the residents that the pass does not expose, those outside
the step first (``spec/README.md``, P5); within each, in the policy's order:

* ``lru`` (the default): the least recently used first;
* ``lfu``: the fewest requests first, ties to the least recently used. Every pass (a host
  planner's ``prepare``) adds one to the count of each expert it exposes; when one of them is
  already at ``count_max``, every expert's count is halved (rounded down) first, so old
  requests weigh less than new ones and a count fits in 4 bits. Counts are kept for every
  expert, resident or not, and ``invalidate`` leaves them alone. With the device planner and
  with the expert split a step counts each of its experts once (its passes expose disjoint
  groups); the token split's calls are chunks of rows, so there an expert counts once per
  chunk that routes to it.

The policy is ``model_check.table.reference._plan_prepare``'s (``Bounds.policy``), which the
model check explores and the conformance tests hold both planners to. ``docs/POLICY.md`` says
what ``lfu`` is predicted to gain, and where.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Literal, TypeAlias

from rowcache.errors import InvalidInputError

__all__ = ["COUNT_MAX", "POLICIES", "Policy", "RequestCounts", "check_policy"]

Policy: TypeAlias = Literal["lru", "lfu"]
POLICIES: tuple[Policy, ...] = ("lru", "lfu")
COUNT_MAX = 15
"""The largest count ``lfu`` keeps: 4 bits, which the device planner packs into its victim
sort key above the last-use stamp."""


def check_policy(policy: object, count_max: object) -> tuple[Policy, int]:
    """``(policy, count_max)`` checked, or ``InvalidInputError`` naming the value and the
    limit (``count_max`` is checked whatever the policy)."""
    for known in POLICIES:
        if policy == known:
            break
    else:
        raise InvalidInputError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if isinstance(count_max, bool) or not isinstance(count_max, int):
        raise InvalidInputError(f"count_max must be an int in [1, {COUNT_MAX}], got {count_max!r}")
    if not 1 <= count_max <= COUNT_MAX:
        raise InvalidInputError(f"count_max must be in [1, {COUNT_MAX}], got {count_max}")
    return known, count_max


class RequestCounts:
    """Every expert's request count under ``lfu``, on the host (the host planner's)."""

    def __init__(self, num_experts: int, count_max: int) -> None:
        self._counts = array("i", [0]) * num_experts
        self._count_max = count_max

    def add(self, experts: Iterable[int]) -> None:
        """One pass that exposes ``experts`` (distinct ids): halve every count first if one
        of them is at ``count_max``, then one more for each."""
        counts = self._counts
        experts = list(experts)
        if any(counts[e] >= self._count_max for e in experts):
            for e in range(len(counts)):
                counts[e] >>= 1
        for e in experts:
            counts[e] += 1

    def __getitem__(self, expert: int) -> int:
        return self._counts[expert]

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self._counts)

"""Requests with an exact number of misses, whatever the provider's eviction policy; and a
provider's hit rate over a sequence of steps.

Before each step the provider's resident set is read (``resident_experts()``, outside any
timed region); the step requests ``k - misses`` residents and ``misses`` non-residents, drawn
with a seeded ``random.Random``. Resident experts are hits whatever the policy, and the others
are misses, so the count is exact for the LRU row provider and the LFRU baseline alike.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from rowcache.forward import run_with_expert_cache
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

__all__ = ["Inspectable", "exact_miss_request", "hit_rate_over", "request_tensor"]


class Inspectable(Protocol):
    def resident_experts(self) -> dict[int, int]: ...


def exact_miss_request(
    provider: Inspectable, misses: int, *, top_k: int, num_experts: int, rng: random.Random
) -> list[int]:
    """``top_k`` distinct expert ids of which exactly ``misses`` are not resident now."""
    resident = sorted(provider.resident_experts())
    absent = sorted(set(range(num_experts)).difference(resident))
    hits = top_k - misses
    if hits > len(resident) or misses > len(absent):
        raise ValueError(
            f"cannot make {misses} misses of {top_k}: {len(resident)} resident, "
            f"{len(absent)} absent"
        )
    return sorted(rng.sample(resident, hits) + rng.sample(absent, misses))


def request_tensor(ids: list[int]) -> Tensor:
    """A decode step's ``topk_ids``: one token routed to ``ids`` (CPU int64, [1, k])."""
    return torch.tensor([ids], dtype=torch.int64)


def hit_rate_over(provider: ExpertWeightProvider, steps: Sequence[Tensor], warm: int) -> float:
    """Hits over hits plus misses of ``provider`` fed ``steps`` (each a ``topk_ids``) through
    ``run_with_expert_cache``, as an engine drives it, counted after the first ``warm``."""

    def run(weights: ExpertWeightResult, rows: slice, shared: bool) -> Tensor:
        return torch.zeros(rows.stop - rows.start, 1)

    before = (0, 0)
    for index, step in enumerate(steps):
        if index == warm:
            stats = provider.stats()
            before = (int(stats["hits"]), int(stats["misses"]))
        run_with_expert_cache(provider, step, run)
    stats = provider.stats()
    hits, misses = int(stats["hits"]) - before[0], int(stats["misses"]) - before[1]
    return hits / max(1, hits + misses)

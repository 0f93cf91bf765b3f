"""The victim policy for steps larger than the cache, measured: uniform routing, E=128, C=32,
top-8, 150 steps after 50 of warm-up. A static resident set hits C/E = 0.25, the ceiling of any
policy here; a pass that protects only its own experts, in id order, thrashed (0.100 at 8 rows,
0.000 at 32). Both planners must reach 0.24 at 8 and 32 rows."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from rowcache import HostPlannedProvider
from rowcache.policy import Policy
from rowcache.provider_base import Planner
from tools.policy_study import Geometry, provider_hit_rate

E, C, K = 128, 32, 8
WARM, MEASURED = 50, 150
TARGET = 0.24


def hit_rate(planner: Planner, rows: int, seed: int = 0, policy: Policy = "lru") -> float:
    rng = random.Random(seed)
    steps = [
        torch.tensor([rng.sample(range(E), K) for _ in range(rows)]) for _ in range(WARM + MEASURED)
    ]
    return provider_hit_rate(planner, steps, WARM, Geometry(E, K, C), policy=policy)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("rows", [8, 32])
@pytest.mark.parametrize("planner", ["host", "device"])
def test_steps_larger_than_the_cache_keep_the_static_hit_rate(
    planner: Planner, rows: int, policy: Policy
) -> None:
    rate = hit_rate(planner, rows, policy=policy)
    assert rate >= TARGET, f"{planner} planner, {rows} rows: hit rate {rate:.3f} < {TARGET}"


def test_the_measure_catches_the_pass_only_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded old policy (groups in id order, protection limited to the call) thrashes."""
    from rowcache import forward
    from rowcache.planning import plan_expert_groups

    def by_id(provider: object, topk_ids: Tensor) -> list[list[int]]:
        return plan_expert_groups(topk_ids, C)

    def call_only(
        self: HostPlannedProvider, count: int, requested: set[int], step: set[int]
    ) -> list[int]:
        return [e for e in self.lru_order() if e not in requested][:count]

    monkeypatch.setattr(forward, "_step_groups", by_id)
    monkeypatch.setattr(HostPlannedProvider, "_victims", call_only)
    assert hit_rate("host", 32) < 0.05

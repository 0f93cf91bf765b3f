"""Victim policies on skewed routing: what the cache's LRU reaches, and what others would.

    python3 -m tools.policy_study [--alpha 1.0] [--rows 1,8,32] [--steps 200] [--warm 50]

Routing as ``tools/vllm/router_skew.py`` models the skewed checkpoint (``--router-skew
ALPHA``): each token's logits are independent standard normals times the experts' Zipf
scales, top-8 of 128. At ``alpha`` 1.0 and 32 slots that model gives the LRU hit rates the
engine measured on the skewed checkpoint within about 0.03 (steps run 6: 0.88, 0.76 and 0.57
at batch 1, 8 and 32), so it is a fair ground for comparing policies before building one.

For each batch size it prints the hit rate (hits over hits plus misses, after ``warm`` steps)
of:

* ``host`` and ``device``: the cache's own providers (``RowCacheWeightProvider`` on the CPU,
  the host planner's expert split and the device planner), driven through
  ``run_with_expert_cache`` as the engine drives them: LRU, the whole step protected, hits
  served first;
* ``static``: the ``capacity`` most popular experts (by the model's scales), never evicted:
  what a resident set chosen from the routing's statistics would reach;
* ``lfu``: after each step the cache keeps the ``capacity`` experts of highest decayed
  request count among the residents and the step's experts (counts multiplied by ``decay``
  every step): a frequency-aware victim choice;
* ``lfu passes``: the same where a step has more experts than slots and is served in passes,
  whose last pass's experts stay (``lfu_passes_hit_rate``);
* ``bound``: the same choice by the step of next use (the nearest kept), which knows the
  future: no policy of this kind does better.

The byte model of docs/records/2026-12-02-steps-run6.md turns a hit rate into a decode speed against
vLLM's UVA offload, which reads 0.75 of the routed experts over PCIe: ``0.75 / (1 - hit)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.bench.steps import hit_rate_over
from rowcache.provider_base import Planner
from tools.vllm.router_skew import lru_hit_rate as router_lru
from tools.vllm.router_skew import zipf_scales

__all__ = [
    "bound_hit_rate",
    "lfu_hit_rate",
    "lfu_passes_hit_rate",
    "lru_hit_rate",
    "main",
    "provider_hit_rate",
    "skewed_steps",
    "static_hit_rate",
    "uva_ratio",
]

EXPERTS, TOP_K, CAPACITY = 128, 8, 32
UVA_FRACTION = 0.75
"""The routed experts vLLM's UVA offload reads over PCIe at 6.75 of 9.0 GiB offloaded: those
of the first six of eight layers (it fills its budget in layer order)."""


def skewed_steps(
    alpha: float, rows: int, steps: int, seed: int = 0, experts: int = EXPERTS
) -> tuple[list[Tensor], Tensor]:
    """``steps`` routings ``[rows, TOP_K]`` of the skewed model, and the experts' scales."""
    scales = zipf_scales(experts, alpha, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    routed = [
        (torch.randn(rows, experts, generator=gen) * scales).topk(TOP_K, dim=1).indices
        for _ in range(steps)
    ]
    return routed, scales


def _distinct(step: Tensor) -> list[int]:
    return sorted(set(step.flatten().tolist()))


def _rate(steps: Sequence[Tensor], warm: int, hits_of: Callable[[int, list[int]], int]) -> float:
    hits = requests = 0
    for index, step in enumerate(steps):
        wanted = _distinct(step)
        hit = hits_of(index, wanted)
        if index >= warm:
            hits += hit
            requests += len(wanted)
    return hits / max(1, requests)


def provider_hit_rate(
    planner: Planner, steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY
) -> float:
    """The cache's provider (``planner`` "host": the expert split; "device") over ``steps``."""
    provider = RowCacheWeightProvider(
        torch.zeros(EXPERTS, 2, 1),
        torch.zeros(EXPERTS, 1, 1),
        capacity=capacity,
        device="cpu",
        split="expert",
        planner=planner,
    )
    return hit_rate_over(provider, steps, warm)


def lru_hit_rate(steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY) -> float:
    """The providers' policy in a few lines (``tools/vllm/router_skew.lru_hit_rate``)."""
    return router_lru([_distinct(s) for s in steps], capacity, warm)


def static_hit_rate(
    steps: Sequence[Tensor], scales: Tensor, warm: int, capacity: int = CAPACITY
) -> float:
    """The ``capacity`` experts of largest scale, resident for good."""
    kept = set(scales.argsort(descending=True)[:capacity].tolist())
    return _rate(steps, warm, lambda _i, wanted: sum(e in kept for e in wanted))


def _keeping(
    steps: Sequence[Tensor],
    warm: int,
    capacity: int,
    rank: Callable[[int, int], float],
    after: Callable[[int, list[int]], None],
) -> float:
    """A policy that after each step keeps the ``capacity`` experts of least ``rank(step,
    expert)`` among the residents and the step's experts (``after`` updates its state)."""
    resident: set[int] = set()

    def hits_of(index: int, wanted: list[int]) -> int:
        nonlocal resident
        hits = sum(e in resident for e in wanted)
        after(index, wanted)
        candidates = sorted(resident | set(wanted), key=lambda e: (rank(index, e), e))
        resident = set(candidates[:capacity])
        return hits

    return _rate(steps, warm, hits_of)


def _count(counts: list[float], wanted: list[int], decay: float) -> None:
    """One step of the decayed request counts: every count times ``decay``, then one more
    for each expert the step requests."""
    for expert in range(len(counts)):
        counts[expert] *= decay
    for expert in wanted:
        counts[expert] += 1.0


def lfu_hit_rate(
    steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY, decay: float = 0.99
) -> float:
    """Keep the experts of highest decayed request count (module docstring)."""
    counts = [0.0] * EXPERTS

    def after(_index: int, wanted: list[int]) -> None:
        _count(counts, wanted, decay)

    return _keeping(steps, warm, capacity, lambda _i, e: -counts[e], after)


def lfu_passes_hit_rate(
    steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY, decay: float = 0.99
) -> float:
    """``lfu_hit_rate`` where a step has more experts than slots, as passes must serve it: the
    hits first, then the misses from the least requested up, ``capacity`` a pass; each later
    pass evicts the least requested experts of the earlier passes (every slot holds one of
    them by then), so the last pass's experts stay."""
    counts = [0.0] * EXPERTS
    resident: set[int] = set()

    def hits_of(_index: int, wanted: list[int]) -> int:
        nonlocal resident
        hits = [e for e in wanted if e in resident]
        _count(counts, wanted, decay)
        if len(wanted) <= capacity:
            candidates = sorted(resident | set(wanted), key=lambda e: (-counts[e], e))
            resident = set(candidates[:capacity])
            return len(hits)
        misses = sorted((e for e in wanted if e not in resident), key=lambda e: (counts[e], e))
        order = hits + misses
        slots = set(order[:capacity])
        for start in range(capacity, len(order), capacity):
            loading = order[start : start + capacity]
            victims = sorted(slots, key=lambda e: (counts[e], e))[: len(loading)]
            slots = (slots - set(victims)) | set(loading)
        resident = slots
        return len(hits)

    return _rate(steps, warm, hits_of)


def bound_hit_rate(steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY) -> float:
    """Keep the experts requested soonest after this step (it knows the future)."""
    never = len(steps)
    next_use: list[dict[int, int]] = [{} for _ in steps]
    seen: dict[int, int] = {}
    for index in range(len(steps) - 1, -1, -1):
        next_use[index] = dict(seen)
        for expert in _distinct(steps[index]):
            seen[expert] = index
    return _keeping(
        steps, warm, capacity, lambda i, e: next_use[i].get(e, never), lambda _i, _w: None
    )


def uva_ratio(hit_rate: float) -> float:
    """The decode speed against vLLM's UVA offload that the byte model predicts."""
    return UVA_FRACTION / max(1e-9, 1.0 - hit_rate)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="policy_study", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.warm >= ns.steps:
        ap.error(f"--warm {ns.warm} must be below --steps {ns.steps}")
    print(
        f"hit rate, E={EXPERTS} C={CAPACITY} top-{TOP_K}, alpha {ns.alpha}, "
        f"{ns.steps - ns.warm} steps after {ns.warm} (predicted x UVA in brackets)"
    )
    print(f"{'rows':>4} {'distinct':>8}" + "".join(f"{n:>15}" for n in POLICIES))
    for rows in (int(r) for r in ns.rows.split(",")):
        steps, scales = skewed_steps(ns.alpha, rows, ns.steps, ns.seed)
        distinct = sum(len(_distinct(s)) for s in steps) / len(steps)
        rates = [policy(steps, scales, ns.warm) for policy in POLICIES.values()]
        cells = "".join(f"{r:>7.3f} ({uva_ratio(r):>4.2f})" for r in rates)
        print(f"{rows:>4} {distinct:>8.1f}{cells}")
    return 0


POLICIES: dict[str, Callable[[Sequence[Tensor], Tensor, int], float]] = {
    "host": lambda steps, _s, warm: provider_hit_rate("host", steps, warm),
    "device": lambda steps, _s, warm: provider_hit_rate("device", steps, warm),
    "static": lambda steps, scales, warm: static_hit_rate(steps, scales, warm),
    "lfu": lambda steps, _s, warm: lfu_hit_rate(steps, warm),
    "lfu passes": lambda steps, _s, warm: lfu_passes_hit_rate(steps, warm),
    "bound": lambda steps, _s, warm: bound_hit_rate(steps, warm),
}


if __name__ == "__main__":
    sys.exit(main())

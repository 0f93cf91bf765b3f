"""Victim policies on skewed routing: what the cache's LRU reaches, and what others would.

    python3 -m tools.policy_study [--model qwen3] [--alpha 1.0] [--rows 1,8,32] [--steps 200]
                                  [--warm 50] [--seed 0]

Routing as ``tools/vllm/router_skew.py`` models the skewed checkpoint (``--router-skew
ALPHA``): each token's logits are independent standard normals times the experts' Zipf
scales, top-k of the model's experts (``--model``: the routed experts, top-k and the quarter
budget of slots of the engines' checkpoints, ``MODELS``). At ``alpha`` 1.0 and Qwen3's 32 of
128 slots that model gives the LRU hit rates the engine measured on the skewed checkpoint
within about 0.03 (steps run 6: 0.88, 0.76 and 0.57 at batch 1, 8 and 32), so it is a fair
ground for comparing policies before building one.

For each batch size it prints the hit rate (hits over hits plus misses, after ``warm`` steps)
of:

* ``host`` and ``device``: the cache's own providers (``RowCacheWeightProvider`` on the CPU,
  the host planner's expert split and the device planner), driven through
  ``run_with_expert_cache`` as the engine drives them: LRU, the whole step protected, hits
  served first;
* ``lfu slots``: the providers with ``policy="lfu"`` (``rowcache.policy``: victims the
  residents of fewest requests, ties to the least recently used, 4-bit counts halved when one
  would pass ``COUNT_MAX``), as ``slot_cache_hit_rate`` computes them in a few lines (equal to
  both planners exactly, tests/test_policy_study.py): every miss copied into a slot, as a slot
  cache must;
* ``static``: the ``capacity`` most popular experts (by the model's scales), never evicted:
  what a resident set chosen from the routing's statistics would reach;
* ``lfu``: after each step the cache keeps the ``capacity`` experts of highest decayed
  request count among the residents and the step's experts (counts multiplied by ``decay``
  every step). A slot cache cannot: a step's misses must be copied into slots before its
  kernel reads them, so they evict residents whatever their counts (``lfu slots`` is that);
  this is a cache that would serve cold misses from elsewhere;
* ``lfu passes``: the same where a step has more experts than slots and is served in passes,
  whose last pass's experts stay (``lfu_passes_hit_rate``);
* ``bound``: the same choice by the step of next use (the nearest kept), which knows the
  future: no policy of this kind does better.

The byte model of docs/records/2026-12-02-steps-run6.md turns a hit rate into a decode speed against
vLLM's UVA offload, which reads 0.75 of the routed experts over PCIe at the quarter budget (it
offloads whole layers: skew does not help it): ``0.75 / (1 - hit)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.bench.steps import hit_rate_over
from rowcache.policy import COUNT_MAX, Policy, RequestCounts
from rowcache.provider_base import Planner
from tools.vllm.router_skew import lru_hit_rate as router_lru
from tools.vllm.router_skew import zipf_scales

__all__ = [
    "MODELS",
    "Geometry",
    "bound_hit_rate",
    "lfu_hit_rate",
    "lfu_passes_hit_rate",
    "lru_hit_rate",
    "main",
    "provider_hit_rate",
    "skewed_steps",
    "slot_cache_hit_rate",
    "static_hit_rate",
    "uva_ratio",
]


@dataclass(frozen=True)
class Geometry:
    """A model's routing and the slots of its quarter budget."""

    experts: int
    top_k: int
    capacity: int


MODELS: dict[str, Geometry] = {
    "qwen3": Geometry(experts=128, top_k=8, capacity=32),
    "gpt-oss-20b": Geometry(experts=32, top_k=4, capacity=8),
    "deepseek-v2-lite": Geometry(experts=64, top_k=6, capacity=16),
}
"""The routed experts and top-k of the engines' checkpoints (``tools/vllm/make_moe_checkpoint``),
with a quarter of the experts in slots (the engines' ``row`` at the quarter budget). Not the
DeepSeek-V3 architecture: its top-8 is drawn from the best 4 of 8 groups by sigmoid scores with
a correction bias, which this routing does not model."""

QWEN3 = MODELS["qwen3"]
EXPERTS, TOP_K, CAPACITY = QWEN3.experts, QWEN3.top_k, QWEN3.capacity
UVA_FRACTION = 0.75
"""The routed experts vLLM's UVA offload reads over PCIe at 6.75 of 9.0 GiB offloaded: those
of the first six of eight layers (it fills its budget in layer order)."""


def skewed_steps(
    alpha: float, rows: int, steps: int, seed: int = 0, geometry: Geometry = QWEN3
) -> tuple[list[Tensor], Tensor]:
    """``steps`` routings ``[rows, top_k]`` of the skewed model, and the experts' scales."""
    scales = zipf_scales(geometry.experts, alpha, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    routed = [
        (torch.randn(rows, geometry.experts, generator=gen) * scales)
        .topk(geometry.top_k, dim=1)
        .indices
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
    planner: Planner,
    steps: Sequence[Tensor],
    warm: int,
    geometry: Geometry = QWEN3,
    *,
    policy: Policy = "lru",
    count_max: int = COUNT_MAX,
) -> float:
    """The cache's provider (``planner`` "host": the expert split; "device") over ``steps``,
    its victims by ``policy``."""
    provider = RowCacheWeightProvider(
        torch.zeros(geometry.experts, 2, 1),
        torch.zeros(geometry.experts, 1, 1),
        capacity=geometry.capacity,
        device="cpu",
        split="expert",
        planner=planner,
        policy=policy,
        count_max=count_max,
    )
    return hit_rate_over(provider, steps, warm)


def lru_hit_rate(steps: Sequence[Tensor], warm: int, capacity: int = CAPACITY) -> float:
    """The providers' policy in a few lines (``tools/vllm/router_skew.lru_hit_rate``)."""
    return router_lru([_distinct(s) for s in steps], capacity, warm)


def slot_cache_hit_rate(
    steps: Sequence[Tensor],
    warm: int,
    geometry: Geometry = QWEN3,
    *,
    counted: bool = True,
    count_max: int = COUNT_MAX,
) -> float:
    """A slot cache run as the providers run one (``rowcache.row_provider``,
    ``spec/README.md``): a step's order is its hits, then its misses, each in ascending id
    order, cut into passes of ``capacity``; a pass's misses take the free slots first, then
    the victims: residents outside the step before the step's experts of other passes, never
    the pass's own; the pass's experts become the most recently used, in id order. Victims:
    the least recently used (``counted`` False: the providers' LRU, which this must equal), or
    the fewest requests, ties to the least recently used (``counted``: a pass adds one to the
    count of each expert it exposes, after halving every count if one of them is at
    ``count_max``: ``rowcache.policy``)."""
    capacity = geometry.capacity
    stamp: dict[int, int] = {}  # the residents' last use
    counts = RequestCounts(geometry.experts, count_max)
    clock = 0

    def hits_of(_index: int, wanted: list[int]) -> int:
        nonlocal clock
        order = [e for e in wanted if e in stamp] + [e for e in wanted if e not in stamp]
        step = set(wanted)
        hits = 0
        for start in range(0, len(order), capacity):
            group = sorted(order[start : start + capacity])
            own = set(group)
            if counted:
                counts.add(group)
            for e in group:
                if e in stamp:  # resident when its pass runs
                    hits += 1
                    continue
                if len(stamp) == capacity:
                    others = [r for r in stamp if r not in own]
                    outside = [r for r in others if r not in step]
                    pool = outside or others
                    if counted:
                        victim = min(pool, key=lambda r: (counts[r], stamp[r]))
                    else:
                        victim = min(pool, key=lambda r: stamp[r])
                    del stamp[victim]
                stamp[e] = -1
            for rank, e in enumerate(group):
                stamp[e] = clock + rank
            clock += len(group)
        return hits

    return _rate(steps, warm, hits_of)


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
    steps: Sequence[Tensor],
    warm: int,
    capacity: int = CAPACITY,
    decay: float = 0.99,
    experts: int = EXPERTS,
) -> float:
    """Keep the experts of highest decayed request count (module docstring)."""
    counts = [0.0] * experts

    def after(_index: int, wanted: list[int]) -> None:
        _count(counts, wanted, decay)

    return _keeping(steps, warm, capacity, lambda _i, e: -counts[e], after)


def lfu_passes_hit_rate(
    steps: Sequence[Tensor],
    warm: int,
    capacity: int = CAPACITY,
    decay: float = 0.99,
    experts: int = EXPERTS,
) -> float:
    """``lfu_hit_rate`` where a step has more experts than slots, as passes must serve it: the
    hits first, then the misses from the least requested up, ``capacity`` a pass; each later
    pass evicts the least requested experts of the earlier passes (every slot holds one of
    them by then), so the last pass's experts stay."""
    counts = [0.0] * experts
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


Study = Callable[[Sequence[Tensor], Tensor, int, Geometry], float]

POLICIES: dict[str, Study] = {
    "host": lambda steps, _s, warm, g: provider_hit_rate("host", steps, warm, g),
    "device": lambda steps, _s, warm, g: provider_hit_rate("device", steps, warm, g),
    "lfu slots": lambda steps, _s, warm, g: slot_cache_hit_rate(steps, warm, g),
    "static": lambda steps, scales, warm, g: static_hit_rate(steps, scales, warm, g.capacity),
    "lfu": lambda steps, _s, warm, g: lfu_hit_rate(steps, warm, g.capacity, experts=g.experts),
    "lfu passes": lambda steps, _s, warm, g: lfu_passes_hit_rate(
        steps, warm, g.capacity, experts=g.experts
    ),
    "bound": lambda steps, _s, warm, g: bound_hit_rate(steps, warm, g.capacity),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="policy_study", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.warm >= ns.steps:
        ap.error(f"--warm {ns.warm} must be below --steps {ns.steps}")
    g = MODELS[ns.model]
    print(
        f"{ns.model}: hit rate, E={g.experts} C={g.capacity} top-{g.top_k}, alpha {ns.alpha}, "
        f"{ns.steps - ns.warm} steps after {ns.warm} (predicted x UVA in brackets)"
    )
    print(f"{'rows':>4} {'distinct':>8}" + "".join(f"{n:>15}" for n in POLICIES))
    for rows in (int(r) for r in ns.rows.split(",")):
        steps, scales = skewed_steps(ns.alpha, rows, ns.steps, ns.seed, g)
        distinct = sum(len(_distinct(s)) for s in steps) / len(steps)
        rates = [policy(steps, scales, ns.warm, g) for policy in POLICIES.values()]
        cells = "".join(f"{r:>7.3f} ({uva_ratio(r):>4.2f})" for r in rates)
        print(f"{rows:>4} {distinct:>8.1f}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

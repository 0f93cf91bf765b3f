"""A synthetic routing trace with temporal locality, and its replay on a provider.

Generation (seeded, ``random.Random(seed)``): expert popularity follows a Zipf law over a
random permutation of the ``E`` experts (weight of the expert of rank r is ``1 / r**s``).
Step 0 draws ``k`` distinct experts by popularity. Every later step keeps each of the previous
step's experts independently with probability ``p`` and draws the rest, distinct and not
already chosen, by popularity. With ``p = 0.5`` and ``s = 1.0`` a 32-slot cache over 128
experts sees a mix of locality and churn like decode steps of one MoE layer.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from itertools import accumulate

import torch

from rowcache.bench.cells import timed_step
from rowcache.bench.providers import BenchProvider
from rowcache.bench.steps import request_tensor

__all__ = ["TraceSpec", "generate_trace", "replay"]


@dataclass(frozen=True)
class TraceSpec:
    steps: int = 1000
    keep: float = 0.5
    zipf_s: float = 1.0
    seed: int = 1234

    def describe(self, num_experts: int, top_k: int) -> str:
        return (
            f"{self.steps} steps of top-{top_k} from {num_experts} experts; each step keeps "
            f"each of the previous step's experts with probability {self.keep} and draws the "
            f"rest without repetition from a Zipf(s={self.zipf_s}) popularity over a seeded "
            f"random permutation of the experts (seed {self.seed})"
        )


def generate_trace(spec: TraceSpec, num_experts: int, top_k: int) -> list[list[int]]:
    rng = random.Random(spec.seed)
    order = list(range(num_experts))
    rng.shuffle(order)
    weights = [0.0] * num_experts
    for rank, expert in enumerate(order, start=1):
        weights[expert] = 1.0 / rank**spec.zipf_s
    cumulative = list(accumulate(weights))
    trace: list[list[int]] = []
    previous: list[int] = []
    for _ in range(spec.steps):
        chosen = {e for e in previous if rng.random() < spec.keep}
        while len(chosen) < top_k:
            chosen.add(rng.choices(range(num_experts), cum_weights=cumulative)[0])
        step = sorted(chosen)
        trace.append(step)
        previous = step
    return trace


def replay(
    provider: BenchProvider, trace: list[list[int]], device: torch.device
) -> dict[str, float]:
    """Hit rate and time per step (every step isolated, as in ``cells``)."""
    stats0 = provider.stats()
    hosts: list[float] = []
    devices: list[float] = []
    for ids in trace:
        timing = timed_step(provider, request_tensor(ids), device)
        hosts.append(timing.host_s)
        devices.append(timing.device_s)
    stats1 = provider.stats()
    hits = stats1["hits"] - stats0["hits"]
    misses = stats1["misses"] - stats0["misses"]
    return {
        "steps": len(trace),
        "hit_rate": hits / max(1, hits + misses),
        "misses_per_step": misses / len(trace),
        "host_us_median": statistics.median(hosts) * 1e6,
        "host_us_mean": statistics.fmean(hosts) * 1e6,
        "device_us_median": statistics.median(devices) * 1e6,
        "device_us_mean": statistics.fmean(devices) * 1e6,
    }

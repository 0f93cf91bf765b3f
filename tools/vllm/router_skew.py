"""Skewed routers for random-weight MoE checkpoints, and what LRU makes of them.

A random router sends every token to nearly uniform experts, so an LRU cache of 32 of 128
experts hits about 0.5 of the time (``docs/RUNNING.md``), far below what public traces of real
models report (about 0.9 with 40% of the experts resident). ``skew_router_`` scales each row
of a router's weight by a Zipf factor: the logit of expert ``e`` becomes ``scale[e] * (w_e . h)``,
so high-scale experts win the top-k more often. The scales are normalized to a root mean
square of 1 (the logits keep their overall size) and assigned to experts by a seeded
permutation per layer (each layer has its own popular experts).

``estimate_hit_rate`` simulates decode steps with isotropic hidden states (each ``w_e . h`` an
independent standard normal): an estimate for choosing ``alpha``, not a measurement; the
hit rate an engine sees depends on its real hidden states and is measured by the e2e. A top-k
of softmax scores does not depend on the logits' size; DeepSeek-V3's router does
(``GroupedSigmoid``): its sigmoid scores saturate near 1 for large logits, and among saturated
experts a fixed per-expert correction bias decides. With the builder's router (logits of
standard deviation 0.08 x sqrt(2048) = 3.6) and a bias drawn N(0, 0.08), the simulated hit
rate of 64 of 256 slots is 0.95 to 0.98 (seeds 0 to 2), what the reduced DeepSeek-V3 engine
measured (0.97 on both routers, 2026-12-06); without the bias it is 0.250, a quarter's share.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GroupedSigmoid",
    "estimate_hit_rate",
    "grouped_sigmoid_topk",
    "lru_hit_rate",
    "skew_router_",
    "zipf_scales",
]


def zipf_scales(num_experts: int, alpha: float, seed: int) -> Tensor:
    """Per-expert factors ``(rank + 1) ** -alpha`` (root mean square 1), ranks permuted by
    ``seed``. ``alpha = 0`` gives all ones."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    scales = (ranks.to(torch.float64) + 1.0) ** -alpha
    return (scales / scales.square().mean().sqrt()).to(torch.float32)


def skew_router_(weight: Tensor, alpha: float, seed: int) -> Tensor:
    """Scale the rows of a router weight ``[E, H]`` in place by ``zipf_scales``; returns the
    scales."""
    scales = zipf_scales(weight.shape[0], alpha, seed)
    with torch.no_grad():
        weight.mul_(scales.to(device=weight.device, dtype=weight.dtype).unsqueeze(1))
    return scales


def lru_hit_rate(steps: list[list[int]], capacity: int, warm: int = 0) -> float:
    """Hits over requests of an LRU cache of ``capacity`` experts fed ``steps`` (each a list
    of distinct experts), counted after the first ``warm`` steps. The cache's own order: a
    step's hits are served first, then its misses, and the least recently served leave first
    (residents the step did not request before any it did), so a step of more experts than
    slots keeps those it served last."""
    resident: OrderedDict[int, None] = OrderedDict()
    hits = requests = 0
    for index, step in enumerate(steps):
        found = [e for e in sorted(step) if e in resident]
        if index >= warm:
            hits += len(found)
            requests += len(step)
        for expert in found + [e for e in sorted(step) if e not in resident]:
            resident.pop(expert, None)
            resident[expert] = None
        while len(resident) > capacity:
            resident.popitem(last=False)
    return hits / max(1, requests)


@dataclass(frozen=True)
class GroupedSigmoid:
    """DeepSeek-V3's routing (``scoring_func: sigmoid``, ``topk_method: noaux_tc``): ``groups``
    groups of experts, the best ``topk_group`` of them, logits of standard deviation
    ``logit_std`` and a correction bias drawn N(0, ``bias_std``) per expert."""

    groups: int
    topk_group: int
    logit_std: float
    bias_std: float


def grouped_sigmoid_topk(
    logits: Tensor, bias: Tensor, groups: int, topk_group: int, top_k: int
) -> Tensor:
    """The ``top_k`` experts DeepSeek-V3's router picks for each row of ``logits`` ``[T, E]``:
    sigmoid scores plus ``bias`` ``[E]``, each group's score the sum of its two best, the best
    ``topk_group`` groups, then the best experts inside them (vLLM's ``grouped_topk``
    selection; the weights, which the cache never sees, are left out)."""
    rows, experts = logits.shape
    choice = torch.sigmoid(logits) + bias
    group_scores = choice.view(rows, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    allowed = torch.zeros(rows, groups, dtype=torch.bool, device=logits.device)
    allowed = allowed.scatter_(1, best, True)
    allowed = allowed.repeat_interleave(experts // groups, dim=1)
    return choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices


def estimate_hit_rate(
    num_experts: int,
    top_k: int,
    capacity: int,
    alpha: float,
    *,
    steps: int = 2000,
    seed: int = 0,
    grouped: GroupedSigmoid | None = None,
) -> float:
    """LRU hit rate of one layer over ``steps`` decode steps of one token, with isotropic
    hidden states (see the module docstring); ``grouped``: DeepSeek-V3's routing, else a
    top-k of the logits (softmax's)."""
    scales = zipf_scales(num_experts, alpha, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(steps, num_experts, generator=gen) * scales
    if grouped is None:
        chosen = logits.topk(top_k, dim=1).indices
    else:
        bias = torch.randn(num_experts, generator=gen) * grouped.bias_std
        chosen = grouped_sigmoid_topk(
            logits * grouped.logit_std, bias, grouped.groups, grouped.topk_group, top_k
        )
    return lru_hit_rate(chosen.tolist(), capacity)

"""A small reference MoE layer and a cached consumer for any ExpertWeightProvider.

Both paths compute every token row with the same sequence of operations (one
SiLU-gated MLP per routed expert, summed in the routing order, then the shared
expert), so a provider that puts the right expert's bytes in the right slot
gives bit-identical rows; only the expert split, which sums partial outputs in
float32, may differ by rounding. A -1 in ``topk_ids`` is padding: both paths
skip it. Weights are unquantized: the scale buffers are not read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rowcache.forward import RunFn, run_with_expert_cache
from rowcache.types import ExpertWeightProvider, ExpertWeightResult
from rowcache.validation import PADDING


@dataclass(frozen=True)
class MoELayer:
    """Expert-major weights: w13 [E, 2I, H] (gate then up), w2 [E, H, I]."""

    w13: Tensor
    w2: Tensor
    shared_w13: Tensor | None = None
    shared_w2: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def make_layer(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    dtype: torch.dtype = torch.float32,
    shared: bool = True,
    seed: int = 0,
) -> MoELayer:
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).div_(math.sqrt(shape[-1])).to(dtype)

    return MoELayer(
        w13=weight(num_experts, 2 * intermediate, hidden),
        w2=weight(num_experts, hidden, intermediate),
        shared_w13=weight(2 * intermediate, hidden) if shared else None,
        shared_w2=weight(hidden, intermediate) if shared else None,
    )


def make_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Distinct experts per row and softmax weights, like a top-k router."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    values, ids = logits.topk(top_k, dim=-1)
    return ids, values.softmax(dim=-1).to(dtype)


def _mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


ExpertLookup = Callable[[int], tuple[Tensor, Tensor] | None]


def _moe_rows(
    layer_shared: tuple[Tensor, Tensor] | None,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    rows: slice,
    lookup: ExpertLookup,
    include_shared: bool,
) -> Tensor:
    ids = topk_ids[rows].tolist()
    out = x.new_zeros((len(ids), x.shape[1]))
    for local, (token, experts) in enumerate(zip(range(rows.start, rows.stop), ids, strict=True)):
        row = x[token : token + 1]
        acc = x.new_zeros((1, x.shape[1]))
        for j, expert in enumerate(experts):
            if expert == PADDING:  # no expert: contributes nothing, never looked up
                continue
            weights = lookup(expert)
            if weights is None:
                continue
            acc = acc + topk_weights[token, j] * _mlp(row, *weights)
        if include_shared and layer_shared is not None:
            acc = acc + _mlp(row, *layer_shared)
        out[local] = acc[0]
    return out


def _shared(layer: MoELayer) -> tuple[Tensor, Tensor] | None:
    if layer.shared_w13 is None or layer.shared_w2 is None:
        return None
    return layer.shared_w13, layer.shared_w2


def reference_moe(layer: MoELayer, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """The uncached layer: every routed expert read straight from the host weights."""
    return _moe_rows(
        _shared(layer),
        x,
        topk_ids,
        topk_weights,
        slice(0, x.shape[0]),
        lambda e: (layer.w13[e], layer.w2[e]),
        True,
    )


def cached_run(layer: MoELayer, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> RunFn:
    """The ``run`` callback: reads slots through the map, skips experts mapped to -1."""

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        expert_map: list[int] = weights.expert_map.tolist()

        def lookup(expert: int) -> tuple[Tensor, Tensor] | None:
            slot = expert_map[expert]
            if slot < 0:
                return None
            return weights.w1[slot], weights.w2[slot]

        return _moe_rows(_shared(layer), x, topk_ids, topk_weights, rows, lookup, include_shared)

    return run


def cached_moe(
    provider: ExpertWeightProvider,
    layer: MoELayer,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
) -> Tensor:
    """The layer evaluated through ``provider``'s slots (any provider with the shared surface)."""
    return run_with_expert_cache(provider, topk_ids, cached_run(layer, x, topk_ids, topk_weights))


def term_magnitude(layer: MoELayer, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> float:
    """Largest sum of |term| over a row (routed terms and shared), in float32.

    Bounds every partial sum either path can form, hence the size of one
    rounding step in the error analysis of the expert split.
    """
    shared = _shared(layer)
    x32 = x.float()
    total = 0.0
    for token, experts in enumerate(topk_ids.tolist()):
        row = x32[token : token + 1]
        acc = torch.zeros(x.shape[1])
        for j, e in enumerate(experts):
            if e == PADDING:
                continue
            term = topk_weights[token, j].float() * _mlp(
                row, layer.w13[e].float(), layer.w2[e].float()
            )
            acc += term[0].abs()
        if shared is not None:
            acc += _mlp(row, shared[0].float(), shared[1].float())[0].abs()
        total = max(total, float(acc.max()))
    return total

"""A small reference MoE layer and a cached consumer for any ExpertWeightProvider.

Both paths compute every token row with the same sequence of operations (one
SiLU-gated MLP per routed expert, summed in the routing order, then the shared
expert), so a provider that puts the right expert's bytes in the right slot
gives bit-identical rows; only the expert split, which sums partial outputs in
float32, may differ by rounding. ``UnreducedKernel`` computes as vLLM's Triton
experts do (per-entry outputs ``[M, top_k, H]``, then one ``moe_sum``), for the
exact route ``run_unreduced_with_expert_cache``. A -1 in ``topk_ids`` is padding: both paths
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


# -- a kernel shaped like vLLM's TritonExperts: unreduced per-entry outputs, then moe_sum ------


def moe_sum_bf16(unreduced: Tensor, output: Tensor) -> None:
    """Each token's top-k entries added in order in the entries' dtype (one rounding per
    addition, like vLLM's ``moe_sum`` kernel for small top-k): ``output[t] = sum_j in[t, j]``."""
    acc = unreduced[:, 0].clone()
    for j in range(1, unreduced.shape[1]):
        acc = acc + unreduced[:, j]
    output.copy_(acc)


class UnreducedKernel:
    """vLLM's Triton MoE arithmetic on the CPU, for one layer input.

    Entry ``[t, j]`` is token ``t``'s output for its routing entry ``j``: the first GEMM in
    float32 from the bf16 weights, the activation rounded to the input dtype (vLLM's
    intermediate cache), the second GEMM in float32 times the router weight, rounded to the
    input dtype. It depends on that expert's weights alone, so it has the same bits whichever
    other experts are resident. An entry whose expert the map marks -1 is zero, or NaN with
    ``unexposed_nan`` (a kernel that leaves such entries unwritten, as vLLM 0.33.0's does under
    an expert map); padding (-1) is zero. ``reduce`` is ``moe_sum_bf16`` plus the shared
    expert's output when the layer has one.
    """

    def __init__(
        self,
        layer: MoELayer,
        x: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        unexposed_nan: bool = False,
    ) -> None:
        self.layer, self.x, self.topk_ids, self.topk_weights = layer, x, topk_ids, topk_weights
        self.unexposed_nan = unexposed_nan
        self.shared_out = x.new_zeros(x.shape)
        self.reduce_calls = 0
        self.calls = 0

    def _entry(self, token: int, j: int, w13: Tensor, w2: Tensor) -> Tensor:
        row = self.x[token : token + 1].float()
        gate, up = (row @ w13.float().t()).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(self.x.dtype).float()
        out = (act @ w2.float().t()) * self.topk_weights[token, j].float()
        return out[0].to(self.x.dtype)

    def run_unreduced(
        self, weights: ExpertWeightResult, rows: slice, include_shared: bool
    ) -> Tensor:
        self.calls += 1
        expert_map: list[int] = weights.expert_map.tolist()
        ids = self.topk_ids[rows].tolist()
        out = self.x.new_zeros((len(ids), self.topk_ids.shape[1], self.x.shape[1]))
        for local, experts in enumerate(ids):
            token = rows.start + local
            for j, expert in enumerate(experts):
                if expert == PADDING:
                    continue
                slot = expert_map[expert]
                if slot < 0:
                    if self.unexposed_nan:
                        out[local, j] = float("nan")
                    continue
                out[local, j] = self._entry(token, j, weights.w1[slot], weights.w2[slot])
        shared = _shared(self.layer)
        if include_shared and shared is not None:
            x = self.x[rows].float()
            self.shared_out[rows] = _mlp(x, shared[0].float(), shared[1].float()).to(self.x.dtype)
        return out

    def reduce(self, unreduced: Tensor, output: Tensor) -> None:
        self.reduce_calls += 1
        moe_sum_bf16(unreduced, output)
        if _shared(self.layer) is not None:
            output.add_(self.shared_out[: output.shape[0]])

    def run(self, weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        """The reduced callback (``RunFn``): one call's entries reduced by ``moe_sum_bf16``
        (plus the shared output of these rows when ``include_shared``)."""
        part = self.run_unreduced(weights, rows, include_shared)
        output = part.new_empty((part.shape[0], part.shape[2]))
        moe_sum_bf16(part, output)
        if include_shared and _shared(self.layer) is not None:
            output.add_(self.shared_out[rows])
        return output

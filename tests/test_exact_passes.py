"""Exact steps: a step served by several passes (device planner) or expert groups (host
planner's ``"expert"`` split) gives the bits of one kernel call with every expert resident,
through ``run_unreduced_with_expert_cache``; the float32 sum of reduced outputs does not.

The kernel is ``moe_reference.UnreducedKernel``: bf16 weights, per-(token, entry) outputs
weighted by the router weights in ``[M, top_k, H]``, reduced over top-k in bf16 as vLLM's
``moe_sum`` does. Routings hold -1 padding; one provider serves a whole sequence of steps, so
residency carries over from step to step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from moe_reference import MoELayer, UnreducedKernel, make_layer, moe_sum_bf16
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.cached import CachedWeightProvider
from rowcache.device_plan.forward import exposed_entries, merge_pass
from rowcache.errors import RowCacheError
from rowcache.forward import run_unreduced_with_expert_cache, run_with_expert_cache
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

E, C, TOP_K, HIDDEN, INTER = 12, 4, 4, 16, 8
BF16 = torch.bfloat16

ProviderFactory = Callable[[MoELayer], ExpertWeightProvider]


def device_planned(layer: MoELayer) -> ExpertWeightProvider:
    return RowCacheWeightProvider(layer.w13, layer.w2, capacity=C, device="cpu", planner="device")


def host_expert_split(layer: MoELayer) -> ExpertWeightProvider:
    return RowCacheWeightProvider(layer.w13, layer.w2, capacity=C, split="expert", device="cpu")


def host_token_split(layer: MoELayer) -> ExpertWeightProvider:
    return RowCacheWeightProvider(layer.w13, layer.w2, capacity=C, split="token", device="cpu")


def cached_expert_split(layer: MoELayer) -> ExpertWeightProvider:
    return CachedWeightProvider(layer.w13, layer.w2, capacity=C, split="expert", device="cpu")


PROVIDERS = {
    "device": device_planned,
    "host-expert": host_expert_split,
    "host-token": host_token_split,
    "cached-expert": cached_expert_split,
}


def everything_resident(layer: MoELayer) -> ExpertWeightProvider:
    return RowCacheWeightProvider(layer.w13, layer.w2, capacity=E, device="cpu")


def steps(count: int, seed: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(x, topk_ids, topk_weights) with 1 to 6 rows, distinct experts per row, about one entry
    in six padding (-1), sometimes a whole row of padding."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        rows = int(torch.randint(1, 7, (1,), generator=gen))
        logits = torch.randn(rows, E, generator=gen)
        values, ids = logits.topk(TOP_K, dim=-1)
        weights = values.softmax(dim=-1).to(BF16)
        pad = torch.rand(rows, TOP_K, generator=gen) < 1 / 6
        if rows > 1 and bool(torch.rand(1, generator=gen) < 0.2):
            pad[0] = True
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        x = torch.randn(rows, HIDDEN, generator=gen).to(BF16)
        yield x, ids, weights


def bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.int16)


def single_call(full: ExpertWeightProvider, kernel: UnreducedKernel) -> Tensor:
    out = run_with_expert_cache(full, kernel.topk_ids, kernel.run)
    assert full.stats()["prepare_calls"] >= 1
    return out


@pytest.mark.parametrize("name", sorted(PROVIDERS))
@pytest.mark.parametrize("shared", [False, True])
def test_a_cut_step_is_bit_identical_to_one_call(name: str, shared: bool) -> None:
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=shared, seed=11)
    cached, full = PROVIDERS[name](layer), everything_resident(layer)
    cut_steps = 0
    for x, ids, weights in steps(80, seed=3 if shared else 4):
        expected = single_call(full, UnreducedKernel(layer, x, ids, weights))
        kernel = UnreducedKernel(layer, x, ids, weights)
        got = run_unreduced_with_expert_cache(cached, ids, kernel.run_unreduced, kernel.reduce)
        assert got.dtype == BF16 and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected)), (name, ids.tolist())
        assert kernel.reduce_calls == 1
        cut_steps += kernel.calls > 1
    assert cut_steps >= 40  # most steps need several passes or groups: the test is not vacuous


@pytest.mark.parametrize("name", ["device", "host-expert"])
def test_exact_without_zeros_for_unexposed_entries(name: str) -> None:
    """The merge takes each entry from the pass that exposed it: a kernel that leaves the
    entries of unexposed experts unwritten (NaN here) gives the same bits."""
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=False, seed=12)
    cached, full = PROVIDERS[name](layer), everything_resident(layer)
    for x, ids, weights in steps(40, seed=5):
        expected = single_call(full, UnreducedKernel(layer, x, ids, weights))
        kernel = UnreducedKernel(layer, x, ids, weights, unexposed_nan=True)
        got = run_unreduced_with_expert_cache(cached, ids, kernel.run_unreduced, kernel.reduce)
        assert torch.equal(bits(got), bits(expected)), ids.tolist()


@pytest.mark.parametrize("name", ["device", "host-expert"])
def test_the_float32_sum_of_passes_is_not_bit_identical(name: str) -> None:
    """The old route (reduced outputs, summed in float32) differs in the last bits on some
    routing, so the exactness test above checks something."""
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=False, seed=11)
    cached, full = PROVIDERS[name](layer), everything_resident(layer)
    differing = 0
    for x, ids, weights in steps(40, seed=4):
        expected = single_call(full, UnreducedKernel(layer, x, ids, weights))
        kernel = UnreducedKernel(layer, x, ids, weights)
        summed = run_with_expert_cache(cached, ids, kernel.run)
        torch.testing.assert_close(summed, expected, rtol=2e-2, atol=2e-2)
        differing += not torch.equal(bits(summed), bits(expected))
    assert differing > 0


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_reduce_runs_once_per_step_and_shared_work_once(name: str) -> None:
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=True, seed=13)
    cached = PROVIDERS[name](layer)
    seen: list[tuple[int, bool]] = []
    for x, ids, weights in steps(20, seed=6):
        kernel = UnreducedKernel(layer, x, ids, weights)
        calls: list[bool] = []

        def run_unreduced(w: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
            calls.append(include_shared)  # noqa: B023
            return kernel.run_unreduced(w, rows, include_shared)  # noqa: B023

        run_unreduced_with_expert_cache(cached, ids, run_unreduced, kernel.reduce)
        assert kernel.reduce_calls == 1
        seen.append((len(calls), all(calls)))
        if name != "host-token":  # a token split runs shared work with every chunk (its rows)
            assert calls[0] and not any(calls[1:])
    assert any(count > 1 for count, _ in seen)


def test_a_single_call_reduces_the_kernels_output_as_it_is() -> None:
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=False, seed=14)
    full = everything_resident(layer)
    x, ids, weights = next(steps(1, seed=7))
    kernel = UnreducedKernel(layer, x, ids, weights)
    handed: list[Tensor] = []
    parts: list[Tensor] = []

    def run_unreduced(w: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        parts.append(kernel.run_unreduced(w, rows, include_shared))
        return parts[-1]

    def reduce(unreduced: Tensor, output: Tensor) -> None:
        handed.append(unreduced)
        moe_sum_bf16(unreduced, output)

    run_unreduced_with_expert_cache(full, ids, run_unreduced, reduce)
    assert len(parts) == 1 and handed[0] is parts[0]


def test_merge_keeps_signed_zeros_and_reads_no_unexposed_entry() -> None:
    step = torch.zeros(2, 3, 1, dtype=BF16)
    first = torch.tensor([[[-0.0], [float("nan")], [1.5]], [[float("nan")], [2.0], [0.0]]])
    second = torch.tensor([[[float("nan")], [-0.0], [float("nan")]], [[-0.0], [7.0], [9.0]]])
    expert_map_1 = torch.tensor([0, -1, 1, -1])
    expert_map_2 = torch.tensor([-1, 0, -1, 1])
    ids = torch.tensor([[0, 1, 2], [3, 2, -1]])
    merge_pass(step, first.to(BF16), exposed_entries(expert_map_1, ids))
    merge_pass(step, second.to(BF16), exposed_entries(expert_map_2, ids))
    assert step.flatten().tolist() == [0.0, 0.0, 1.5, 0.0, 2.0, 0.0]
    signs = torch.signbit(step.float()).flatten().tolist()
    assert signs == [True, True, False, True, False, False]  # padding stays +0
    # Adding the passes would turn the -0.0 of entry [0, 0] (pass 1) into +0.0.
    assert not torch.signbit(torch.tensor(-0.0) + torch.tensor(0.0))


def test_exposed_entries_ignores_ids_outside_the_map() -> None:
    expert_map = torch.tensor([1, -1, 0])
    ids = torch.tensor([[0, 1, 2, -1, 3, -7]])
    assert exposed_entries(expert_map, ids).tolist() == [[True, False, True, False, False, False]]


@pytest.mark.parametrize("name", ["device", "host-expert", "host-token"])
def test_wrong_unreduced_shape_is_rejected(name: str) -> None:
    layer = make_layer(E, HIDDEN, INTER, dtype=BF16, shared=False, seed=15)
    cached = PROVIDERS[name](layer)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])

    def reduced(w: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        return torch.zeros(rows.stop - rows.start, HIDDEN, dtype=BF16)

    with pytest.raises(RowCacheError, match=r"expected \[\d+, 4, \.\.\.\]"):
        run_unreduced_with_expert_cache(cached, ids, reduced, moe_sum_bf16)

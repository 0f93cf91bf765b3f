"""run_with_expert_cache: both splits against the uncached layer, and the callback contract."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
from moe_reference import (
    MoELayer,
    cached_moe,
    make_layer,
    make_routing,
    reference_moe,
    term_magnitude,
)

from rowcache.cached import CachedWeightProvider
from rowcache.errors import InvalidInputError, RowCacheError
from rowcache.forward import run_with_expert_cache
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.types import ExpertWeightResult, Split, UniqueIds

E, HIDDEN, INTER, T = 8, 16, 8, 12
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def setup(
    dtype: torch.dtype, top_k: int, seed: int = 0
) -> tuple[MoELayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = make_layer(E, HIDDEN, INTER, dtype=dtype, seed=seed)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    topk_ids, topk_weights = make_routing(T, E, top_k, dtype=dtype, seed=seed + 2)
    return layer, x, topk_ids, topk_weights


def provider_for(layer: MoELayer, capacity: int, split: Split) -> CachedWeightProvider:
    return CachedWeightProvider(
        layer.w13,
        layer.w2,
        capacity=capacity,
        split=split,
        device=CPU,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_token_split_is_exact(dtype: torch.dtype, seed: int) -> None:
    layer, x, topk_ids, topk_weights = setup(dtype, top_k=2, seed=seed)
    capacity = 3
    assert len(set(topk_ids.flatten().tolist())) > capacity
    provider = provider_for(layer, capacity, "token")
    out = cached_moe(provider, layer, x, topk_ids, topk_weights)
    # Each row runs the same operations on the same bytes as the uncached layer.
    assert torch.equal(out, reference_moe(layer, x, topk_ids, topk_weights))
    assert out.dtype == dtype
    assert provider.stats()["prepare_calls"] == len(plan_chunks(topk_ids, capacity)) > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("top_k", "capacity"), [(2, 3), (3, 2)])
def test_expert_split_matches_within_rounding(
    dtype: torch.dtype, top_k: int, capacity: int
) -> None:
    layer, x, topk_ids, topk_weights = setup(dtype, top_k=top_k)
    provider = provider_for(layer, capacity, "expert")
    out = cached_moe(provider, layer, x, topk_ids, topk_weights)
    ref = reference_moe(layer, x, topk_ids, topk_weights)
    groups = plan_expert_groups(topk_ids, capacity)
    assert provider.stats()["prepare_calls"] == len(groups) > 1
    assert out.dtype == dtype
    # Both paths compute identical per-expert terms (same ops on the same
    # bytes); they differ only in how the sums round. Per row, the reference
    # rounds at each of its k + 1 additions; the split rounds at most at k + 1
    # additions inside groups, at most k float32 additions across groups (only
    # groups holding one of the row's experts add a nonzero value) and once at
    # the final cast. To first order each rounding moves a value by at most
    # u * S, where u is the unit roundoff (2^-8 for bf16, 2^-24 for float32)
    # and S = max over rows of sum |term| bounds every partial sum, so
    #   |out - ref| <= 3 (k + 1) * u * S.
    # On these seeds the bound is 6 to 8 times the measured difference, so it
    # is tight enough to catch a wrong or missing term.
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    bound = 3 * (top_k + 1) * unit * term_magnitude(layer, x, topk_ids, topk_weights)
    torch.testing.assert_close(out, ref, rtol=0.0, atol=bound)


def test_token_split_rejects_a_row_wider_than_capacity() -> None:
    layer, x, topk_ids, topk_weights = setup(torch.float32, top_k=3)
    provider = provider_for(layer, 2, "token")
    with pytest.raises(InvalidInputError, match="routes to 3 distinct experts but capacity is 2"):
        cached_moe(provider, layer, x, topk_ids, topk_weights)
    assert provider.stats()["prepare_calls"] == 0


# -- the callback contract, with a recording provider ---------------------------------------


class RecordingProvider:
    """Accepts everything, records each prepare; the map exposes the requested set."""

    def __init__(self, split: str, capacity: int) -> None:
        self._split = split
        self.capacity = capacity
        self.num_experts = E
        self.buf_w13 = torch.zeros(capacity, 1)
        self.buf_w2 = torch.zeros(capacity, 1)
        self.buf_w13_scale: torch.Tensor | None = None
        self.buf_w2_scale: torch.Tensor | None = None
        self.buf_w13_scale_2: torch.Tensor | None = None
        self.buf_w2_scale_2: torch.Tensor | None = None
        self.calls: list[tuple[torch.Tensor, list[int] | None]] = []

    @property
    def split(self) -> Split:
        return self._split  # type: ignore[return-value]

    def prepare(
        self, topk_ids: torch.Tensor, unique_ids: UniqueIds | None = None
    ) -> ExpertWeightResult:
        group = None if unique_ids is None else list(unique_ids)
        self.calls.append((topk_ids, group))
        routed = set(topk_ids.flatten().tolist()) - {-1}  # -1 is padding
        requested = group if group is not None else sorted(routed)
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[requested] = torch.arange(len(requested), dtype=torch.int32)
        return ExpertWeightResult(self.buf_w13, self.buf_w2, expert_map)

    def invalidate(self, expert_id: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def topk(*rows: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)


ROUTING = topk([0, 1], [1, 2], [3, 4], [4, 3], [0, 5])


def test_token_split_contract() -> None:
    provider = RecordingProvider("token", capacity=3)
    seen: list[tuple[slice, bool]] = []

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        seen.append((rows, include_shared))
        return torch.arange(rows.start, rows.stop, dtype=torch.float32).view(-1, 1).repeat(1, 2)

    out = run_with_expert_cache(provider, ROUTING, run)
    chunks = plan_chunks(ROUTING, 3)
    assert seen == [(slice(a, b), True) for a, b in chunks]
    assert [(t.tolist(), g) for t, g in provider.calls] == [
        (ROUTING[a:b].tolist(), None) for a, b in chunks
    ]
    # Each chunk's output lands in its own rows.
    assert torch.equal(out, torch.arange(5, dtype=torch.float32).view(-1, 1).repeat(1, 2))


def test_expert_split_contract() -> None:
    provider = RecordingProvider("expert", capacity=2)
    seen: list[tuple[slice, bool]] = []

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        seen.append((rows, include_shared))
        return torch.ones(5, 3, dtype=torch.bfloat16)

    out = run_with_expert_cache(provider, ROUTING, run)
    groups = plan_expert_groups(ROUTING, 2)
    assert len(groups) == 3
    # Shared work exactly once: with the first group.
    assert seen == [(slice(0, 5), True), (slice(0, 5), False), (slice(0, 5), False)]
    assert [g for _, g in provider.calls] == groups
    assert all(t is ROUTING for t, _ in provider.calls)
    assert out.dtype == torch.bfloat16 and torch.equal(
        out, torch.full((5, 3), 3.0, dtype=torch.bfloat16)
    )


def test_expert_split_sums_in_float32() -> None:
    provider = RecordingProvider("expert", capacity=2)
    parts = iter([256.0, 1.0, 1.0])

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        return torch.full((5, 1), next(parts), dtype=torch.bfloat16)

    # In bf16, 256 + 1 rounds back to 256 (twice); in float32 the sum is 258,
    # which bf16 represents exactly.
    out = run_with_expert_cache(provider, ROUTING, run)
    assert torch.equal(out, torch.full((5, 1), 258.0, dtype=torch.bfloat16))


def test_expert_split_does_not_alias_a_reused_output_buffer() -> None:
    provider = RecordingProvider("expert", capacity=2)
    buffer = torch.empty(5, 1)
    values = iter([1.0, 2.0, 3.0])

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        return buffer.fill_(next(values))

    assert torch.equal(run_with_expert_cache(provider, ROUTING, run), torch.full((5, 1), 6.0))


@pytest.mark.parametrize("split", ["token", "expert"])
def test_fast_path_is_one_prepare_and_returns_run_output_as_is(split: str) -> None:
    provider = RecordingProvider(split, capacity=E)
    produced: list[torch.Tensor] = []

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        assert rows == slice(0, 5) and include_shared
        produced.append(torch.zeros(5, 2))
        return produced[-1]

    out = run_with_expert_cache(provider, ROUTING, run)
    assert out is produced[0]
    assert len(provider.calls) == 1 and provider.calls[0] == (ROUTING, None)


@pytest.mark.parametrize("split", ["token", "expert"])
def test_empty_batch_still_runs_once(split: str) -> None:
    provider = RecordingProvider(split, capacity=2)
    empty = torch.empty(0, 2, dtype=torch.int64)

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        assert rows == slice(0, 0)
        return torch.empty(0, 4)

    assert run_with_expert_cache(provider, empty, run).shape == (0, 4)
    assert len(provider.calls) == 1


@pytest.mark.parametrize("split", ["token", "expert"])
def test_wrong_output_rows_rejected(split: str) -> None:
    provider = RecordingProvider(split, capacity=2)

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        return torch.zeros(rows.stop - rows.start + 1, 2)

    rows = "0:1, expected a first dimension of 1" if split == "token" else "0:5, expected"
    with pytest.raises(RowCacheError, match=re.escape(f"for rows {rows}")):
        run_with_expert_cache(provider, ROUTING, run)


PADDED = topk([0, -1], [-1, -1], [1, 2], [-1, 3], [3, -1])


def test_token_split_does_not_count_padding() -> None:
    provider = RecordingProvider("token", capacity=2)
    seen: list[slice] = []

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> torch.Tensor:
        seen.append(rows)
        return torch.zeros(rows.stop - rows.start, 1)

    run_with_expert_cache(provider, PADDED, run)
    # {0} + padding + {1, 2} would be 3 experts: the cut falls before row 2, and the padding
    # rows join the chunks around them.
    assert seen == [slice(0, 2), slice(2, 3), slice(3, 5)]
    assert [sorted(set(t.flatten().tolist()) - {-1}) for t, _ in provider.calls] == [
        [0],
        [1, 2],
        [3],
    ]


def test_expert_split_groups_hold_no_padding() -> None:
    provider = RecordingProvider("expert", capacity=2)
    run_with_expert_cache(provider, PADDED, lambda w, rows, shared: torch.zeros(5, 1))
    assert [g for _, g in provider.calls] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("split", ["token", "expert"])
def test_a_routing_of_only_padding_runs_once(split: str) -> None:
    provider = RecordingProvider(split, capacity=1)
    padding = torch.full((3, 2), -1, dtype=torch.int64)
    out = run_with_expert_cache(provider, padding, lambda w, rows, shared: torch.ones(3, 1))
    assert torch.equal(out, torch.ones(3, 1))
    assert len(provider.calls) == 1 and provider.calls[0] == (padding, None)


def test_unknown_split_rejected() -> None:
    provider = RecordingProvider("rows", capacity=2)
    with pytest.raises(InvalidInputError, match="unknown split 'rows'"):
        run_with_expert_cache(provider, ROUTING, lambda w, r, s: torch.zeros(5, 1))

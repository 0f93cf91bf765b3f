"""What each split of the host planner copies on steps larger than its slots: the figures the
default split's docs quote (``rowcache.vllm.defaults``, docs/VLLM.md "The host planner's
split"), measured on the CPU provider with uniform top-8 routing over 128 experts, 32 slots.

The token split cuts a step into row ranges whose experts fit the slots, and each range copies
most of its experts again; the expert split copies each routed expert of the step once."""

from __future__ import annotations

import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.forward import run_with_expert_cache
from rowcache.types import ExpertWeightResult

EXPERTS, SLOTS, TOP_K = 128, 32, 8


def _misses_by_rows(split: str) -> dict[int, int]:
    """Misses of one layer's step of 1, 8, 32 and 2,048 rows, after 20 one-row steps."""
    provider = RowCacheWeightProvider(
        torch.zeros(EXPERTS, 4, 2),
        torch.zeros(EXPERTS, 2, 2),
        capacity=SLOTS,
        device="cpu",
        split=split,  # type: ignore[arg-type]
    )
    generator = torch.Generator().manual_seed(0)

    def run(weights: ExpertWeightResult, rows: slice, shared: bool) -> Tensor:
        return torch.zeros(rows.stop - rows.start, 2)

    def step(rows: int) -> int:
        ids = torch.stack(
            [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)]
        )
        before = provider.stats()["misses"]
        run_with_expert_cache(provider, ids, run)
        return int(provider.stats()["misses"] - before)

    for _ in range(20):
        step(1)
    return {rows: step(rows) for rows in (1, 8, 32, 2048)}


def test_the_token_split_copies_far_more_on_large_steps() -> None:
    token, expert = _misses_by_rows("token"), _misses_by_rows("expert")
    # The figures docs/VLLM.md quotes (this seed, torch's CPU generator).
    assert (token[32], expert[32]) == (174, 83)
    assert (token[2048], expert[2048]) == (11259, 96)
    # What does not depend on the seed: one row is one pass either way; a prompt that routes
    # to every expert costs the expert split exactly the 96 non-residents.
    assert token[1] == expert[1]
    assert expert[2048] == EXPERTS - SLOTS
    assert token[32] >= 2 * expert[32] and token[2048] >= 100 * expert[2048]

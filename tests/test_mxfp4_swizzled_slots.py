"""The slot side of gpt-oss's swizzled MXFP4 experts in vLLM (``rowcache.vllm.mxfp4_slots``):
expert rows of an ``.mT`` storage, slot views with the storage's strides, the wrapper rebuilt
over the slots, and the masked-sum tap's exact route, against one call over every expert."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_wrappers import Storage, Wrapper

from rowcache.errors import InvalidInputError
from rowcache.forward import run_unreduced_with_expert_cache
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.types import ExpertWeightResult
from rowcache.vllm.mxfp4_slots import MaskedSumTap, expert_rows, rewrapped, slot_view

E, A, B = 6, 5, 12  # experts; the swizzled storage is .mT of a contiguous [E, A, B]


def swizzled(seed: int = 0) -> torch.Tensor:
    """Like the Hopper value layout's storage: ``[E, B, A]`` as ``.mT`` of contiguous data."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (E, A, B), generator=gen, dtype=torch.uint8).mT


def test_expert_rows_are_each_experts_storage_range() -> None:
    t = swizzled()
    rows = expert_rows(t)
    assert rows.shape == (E, A * B) and rows.data_ptr() == t.data_ptr()
    for e in range(E):
        assert torch.equal(rows[e], t[e].mT.contiguous().flatten())  # storage order
    contiguous = torch.arange(E * 7, dtype=torch.float32).reshape(E, 7)  # a bias
    assert torch.equal(expert_rows(contiguous), contiguous)


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(E, A, B, dtype=torch.uint8).transpose(0, 1),  # experts not outermost
        torch.zeros(E, A, 2 * B, dtype=torch.uint8)[:, :, :B],  # gaps inside an expert
        torch.zeros(E, dtype=torch.uint8),  # no expert contents
    ],
)
def test_what_is_not_dense_expert_ranges_is_refused(bad: torch.Tensor) -> None:
    with pytest.raises(InvalidInputError, match=r"expert rows need .* got shape"):
        expert_rows(bad)


def test_a_slot_view_holds_what_the_experts_storage_held() -> None:
    t = swizzled()
    rows = expert_rows(t)
    slots = torch.zeros(3, A * B, dtype=torch.uint8)
    for slot, expert in enumerate((4, 0, 2)):
        slots[slot] = rows[expert]
    view = slot_view(slots, t)
    assert view.shape == (3, B, A) and view.stride() == t.stride()
    for slot, expert in enumerate((4, 0, 2)):
        assert torch.equal(view[slot], t[expert])
    with pytest.raises(InvalidInputError, match=r"needs a \[C, 60\] torch.uint8 buffer"):
        slot_view(torch.zeros(3, 59, dtype=torch.uint8), t)
    with pytest.raises(InvalidInputError, match="needs a contiguous buffer"):
        slot_view(torch.zeros(A * B, 3, dtype=torch.uint8).T, t)


def test_the_wrapper_is_rebuilt_over_the_slots() -> None:
    t = swizzled()
    layout = object()
    wrapper = Wrapper(Storage(t, layout), "FP4", [E, 2 * B, A], [E, 2 * B, A])
    slots = slot_view(torch.zeros(3, A * B, dtype=torch.uint8), t)
    new = rewrapped(wrapper, slots)
    assert new.storage.data is slots and new.storage.layout is layout and new.dtype == "FP4"
    assert new.shape == [3, 2 * B, A] and new.shape_max == [3, 2 * B, A]
    assert wrapper.shape[0] == E and wrapper.storage.data is t  # the original is unchanged


def masked_moe_sum(intermediate: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's reduction: float32 from 0 in k order, entries with id < 0 not read."""
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for k in range(intermediate.shape[1]):
        valid = (topk_ids[:, k] >= 0).unsqueeze(1)
        acc = torch.where(valid, acc + intermediate[:, k].float(), acc)
    out.copy_(acc.to(out.dtype))


def experts_call(
    x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor, tap: Any
) -> torch.Tensor:
    """A stand-in for ``UnfusedOAITritonExperts.apply`` over ``w`` ([slots, H, H], one per
    slot) and local ids: rows of unmapped entries are NaN (the kernel leaves them as they
    are), then the module's ``masked_moe_sum``."""
    m, k = topk_ids.shape
    rows = torch.full((m, k, x.shape[1]), float("nan"), dtype=x.dtype)
    for i in range(m):
        for j in range(k):
            slot = int(topk_ids[i, j])
            if slot >= 0:
                rows[i, j] = (x[i].float() @ w[slot].float() * weights[i, j]).to(x.dtype)
    out = torch.empty_like(x)
    tap(rows, topk_ids, out)
    return out


@pytest.mark.parametrize("capacity", [2, 3, 8])
def test_the_taps_route_gives_one_calls_bits(capacity: int) -> None:
    """A step cut into passes by a host-planned provider (expert split), each pass's rows
    taken through the tap and merged by the provider's map, then reduced once: bit for bit
    the reduction of one call with every expert mapped; the tap passes other calls through."""
    gen = torch.Generator().manual_seed(1)
    hidden, rows, k = 16, 7, 3
    w = (torch.randn(8, hidden, hidden, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(rows)])
    topk_weights = torch.rand(rows, k, generator=gen).to(torch.bfloat16)
    tap = MaskedSumTap(masked_moe_sum)
    expected = experts_call(x, w, ids, topk_weights, tap)  # not taking: the original
    provider = RowCacheWeightProvider(
        w.flatten(1), w.flatten(1)[:, :1], capacity=capacity, split="expert", device="cpu"
    )

    def run(result: ExpertWeightResult, rows_: slice, shared: bool) -> torch.Tensor:
        local = result.expert_map[ids[rows_]]
        slots = result.w1.view(-1, hidden, hidden)
        return tap.unreduced(lambda: experts_call(x[rows_], slots, local, topk_weights, tap))

    got = run_unreduced_with_expert_cache(
        provider, ids, run, lambda part, out: tap.reduce(part, out, ids)
    )
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    calls = provider.stats()
    assert capacity >= 8 or calls["prepare_calls"] > 1  # cut into passes where it must be


def test_a_call_that_never_reduces_is_an_error() -> None:
    tap = MaskedSumTap(masked_moe_sum)
    with pytest.raises(RuntimeError, match="returned without calling masked_moe_sum"):
        tap.unreduced(lambda: None)
    assert not tap._take  # the tap passes through again


@pytest.mark.parametrize(
    ("shape", "stride", "per_expert"),
    [  # gpt-oss-20b's storages after vLLM's Hopper swizzle (tests/test_gpt_oss_swizzle.py)
        ((2, 5760, 1440), (8_294_400, 1, 5760), 8_294_400),
        ((2, 5760, 720), (4_147_200, 1, 5760), 4_147_200),
        ((2, 2880, 184), (529_920, 1, 2880), 529_920),
        ((2, 2880, 96), (276_480, 1, 2880), 276_480),
    ],
)
def test_the_hopper_swizzles_storages_are_expert_rows(
    shape: tuple[int, ...], stride: tuple[int, ...], per_expert: int
) -> None:
    t = torch.empty_strided(shape, stride, dtype=torch.uint8, device="meta")
    assert expert_rows(t).shape == (2, per_expert)
    slots = torch.empty(5, per_expert, dtype=torch.uint8, device="meta")
    view = slot_view(slots, t)
    assert view.shape == (5, *shape[1:]) and view.stride() == stride

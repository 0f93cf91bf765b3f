"""The packed slot layout (``rowcache.packing``): views over one byte range per expert, the
batched copy's one entry per miss, and a packed provider in lockstep with a separate one."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.backends.batched_copy import RowLayout
from rowcache.errors import InvalidInputError
from rowcache.packing import PACK_ALIGN, pack_offsets, packed_storage, packed_views
from rowcache.sources import SOURCE_NAMES, ExpertSources, allocate_slot_buffers

E = 9
CPU = torch.device("cpu")


def nvfp4_like(num_experts: int = E, seed: int = 0) -> dict[str, Tensor]:
    """Every source: six tensors of the NVFP4 kinds (packed fp4 bytes, fp8 block scales, fp32
    globals) and a pair of biases (bf16 rows of 22 and 10 bytes: odd lengths to pad), every
    expert's bytes distinct."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(num_experts, dtype=torch.float32)
    return {
        "w13": torch.randint(0, 256, (num_experts, 12, 8), generator=g, dtype=torch.uint8),
        "w2": torch.randint(0, 256, (num_experts, 8, 6), generator=g, dtype=torch.uint8),
        "w13_scale": (torch.rand(num_experts, 12, 1, generator=g) + ids[:, None, None]).to(
            torch.float8_e4m3fn
        ),
        "w2_scale": (torch.rand(num_experts, 8, 3, generator=g) + ids[:, None, None]).to(
            torch.float8_e4m3fn
        ),
        "w13_scale_2": ids * 3 + 0.5,
        "w2_scale_2": ids * 5 + 0.25,
        "w13_bias": (torch.rand(num_experts, 11, generator=g) + ids[:, None]).to(torch.bfloat16),
        "w2_bias": (torch.rand(num_experts, 5, generator=g) - ids[:, None]).to(torch.bfloat16),
    }


def raw(t: Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def test_offsets_are_aligned_and_views_round_trip() -> None:
    host = nvfp4_like()
    templates = [host[n] for n in SOURCE_NAMES]
    offsets, size = pack_offsets(templates)
    assert all(o % PACK_ALIGN == 0 for o in offsets) and size % PACK_ALIGN == 0
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    storage = packed_storage(E, size, device=CPU)
    views = packed_views(storage, templates, offsets)
    for view, source in zip(views, templates, strict=True):
        assert view is not None
        view.copy_(source)
        assert view.shape == source.shape and view.dtype == source.dtype
        assert view.stride(0) * view.element_size() == size
        assert raw(view) == raw(source)


def test_absent_tensors_stay_absent() -> None:
    host = nvfp4_like()
    templates: list[Tensor | None] = [host["w13"], host["w2"], None, None, None, None]
    offsets, size = pack_offsets(templates)
    assert offsets[2:] == [-1, -1, -1, -1]
    views = packed_views(packed_storage(E, size, device=CPU), templates, offsets)
    assert views[2:] == [None, None, None, None]


def test_packed_sources_hold_one_copy_in_one_buffer() -> None:
    host = nvfp4_like()
    sources = ExpertSources(**host, device=CPU, layout="packed")  # type: ignore[arg-type]
    assert sources.pack is not None
    _, size = sources.pack
    assert sources.host_bytes == E * size
    for name, t in zip(SOURCE_NAMES, sources.tensors(), strict=True):
        assert t is not None and raw(t) == raw(host[name])
    slots = allocate_slot_buffers(sources, 4, CPU)
    assert slots.slot_bytes == 4 * size


def _pairs(layout: str) -> list[tuple[Tensor, Tensor, str]]:
    sources = ExpertSources(**nvfp4_like(), device=CPU, layout=layout)  # type: ignore[arg-type]
    slots = allocate_slot_buffers(sources, 4, CPU)
    return [
        (buf, src, name)
        for buf, src, name in zip(slots.tensors(), sources.tensors(), SOURCE_NAMES, strict=True)
        if buf is not None and src is not None
    ]


def test_a_packed_miss_is_one_batch_entry_covering_every_tensor() -> None:
    pairs = _pairs("packed")
    layout = RowLayout(pairs)
    assert layout.merged
    copies = [(7, 0), (2, 3)]
    dsts, srcs, sizes = layout.addresses(copies)
    assert len(dsts) == len(copies)
    for (expert, slot), dst, src, size in zip(copies, dsts, srcs, sizes, strict=True):
        for buf, source, _ in pairs:
            # Every tensor's row lies inside the one range, at the same offset on both sides.
            row = buf[slot].numel() * buf.element_size()
            assert dst <= buf[slot].data_ptr() and buf[slot].data_ptr() + row <= dst + size
            assert buf[slot].data_ptr() - dst == source[expert].data_ptr() - src
    assert layout.row_addresses(copies) == [
        buf[slot].data_ptr() for _, slot in copies for buf, _, _ in pairs
    ]


def test_separate_buffers_are_not_merged() -> None:
    layout = RowLayout(_pairs("separate"))
    assert not layout.merged
    dsts, _, _ = layout.addresses([(1, 1)])
    assert len(dsts) == len(SOURCE_NAMES)


def test_packed_slots_with_sources_at_other_offsets_are_not_merged() -> None:
    """A packed slot side with separate sources cannot be one range per miss."""
    packed = _pairs("packed")
    separate = _pairs("separate")
    mixed = [(buf, src, name) for (buf, _, name), (_, src, _) in zip(packed, separate, strict=True)]
    assert not RowLayout(mixed).merged


def _provider(layout: str, capacity: int = 4) -> RowCacheWeightProvider:
    return RowCacheWeightProvider(
        **nvfp4_like(),  # type: ignore[arg-type]
        capacity=capacity,
        device="cpu",
        layout=layout,  # type: ignore[arg-type]
    )


def test_a_packed_provider_matches_a_separate_one_step_by_step() -> None:
    packed, separate = _provider("packed"), _provider("separate")
    assert packed.layout == "packed" and separate.layout == "separate"
    host = nvfp4_like()
    rng = random.Random(5)
    for step in range(60):
        ids = rng.sample(range(E), rng.randint(1, 4))
        if step % 7 == 6:
            for p in (packed, separate):
                p.invalidate(ids[0])
        request = torch.tensor([ids])
        a, b = packed.prepare(request), separate.prepare(request)
        assert torch.equal(a.expert_map, b.expert_map)
        assert packed.lru_order() == separate.lru_order()
        for expert, slot in packed.forward_pairs or ():
            for name, buf in zip(SOURCE_NAMES, packed._slots.tensors(), strict=True):
                assert buf is not None and raw(buf[slot]) == raw(host[name][expert]), (
                    f"step {step}: {name}[slot {slot}] does not hold expert {expert}"
                )
    assert packed.stats()["misses"] == separate.stats()["misses"] > 0


def test_an_unknown_layout_is_rejected_naming_it() -> None:
    with pytest.raises(InvalidInputError, match=r"layout must be one of \['separate', 'packed'\]"):
        _provider("interleaved")

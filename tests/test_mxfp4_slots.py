"""MXFP4 experts in the slots, on the CPU: gpt-oss's geometry (issue 34) through the same slot
surface as every other one.

vLLM 0.25.0 loads a gpt-oss expert as two 4-bit values per ``uint8`` (``w13`` ``[E, 2I, H/2]``,
``w2`` ``[E, H, I/2]``), one e8m0 ``uint8`` scale per 32 values (``w13_scale`` ``[E, 2I, H/32]``,
``w2_scale`` ``[E, H, I/32]``) and float32 output biases (``w13_bias`` ``[E, 2I]``, ``w2_bias``
``[E, H]``). To the cache all six are bytes: every provider, in both slot layouts, must serve an
expert's values, scales and biases together and exactly (drawn as raw bytes, NaN patterns
included), a miss must copy exactly the expert's bytes, the device planner's gather must cover
every byte of every region once, and the biases must come as a pair.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_slots import KINDS, covered_pieces, raw_bytes
from torch import Tensor

from rowcache import InvalidInputError, RowCacheWeightProvider
from rowcache.device_plan.regions import chunk_table, copy_regions
from rowcache.packing import PACK_ALIGN, pack_offsets
from rowcache.sources import SOURCE_NAMES

E, C = 8, 3
BLOCK = 32  # values per e8m0 scale
NAMES = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")


def mxfp4_sources(hidden: int = 96, inter: int = 64, experts: int = E) -> dict[str, Tensor]:
    """Random bytes in vLLM's MXFP4 MoE shapes (the module docstring)."""
    assert hidden % BLOCK == 0 and inter % BLOCK == 0
    gen = torch.Generator().manual_seed(13)

    def raw(*shape: int) -> Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    return {
        "w13": raw(experts, 2 * inter, hidden // 2),
        "w2": raw(experts, hidden, inter // 2),
        "w13_scale": raw(experts, 2 * inter, hidden // BLOCK),
        "w2_scale": raw(experts, hidden, inter // BLOCK),
        "w13_bias": raw(experts, 2 * inter * 4).view(torch.float32),
        "w2_bias": raw(experts, hidden * 4).view(torch.float32),
    }


def test_the_geometry_has_vllms_shapes() -> None:
    src = mxfp4_sources()
    assert {n: (tuple(t.shape), t.dtype) for n, t in src.items()} == {
        "w13": ((E, 128, 48), torch.uint8),
        "w2": ((E, 96, 32), torch.uint8),
        "w13_scale": ((E, 128, 3), torch.uint8),
        "w2_scale": ((E, 96, 2), torch.uint8),
        "w13_bias": ((E, 128), torch.float32),
        "w2_bias": ((E, 96), torch.float32),
    }
    assert set(NAMES) <= set(SOURCE_NAMES)


@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mxfp4_experts_are_served_byte_exact(layout: str, kind: str) -> None:
    src = mxfp4_sources()
    p = KINDS[kind](**src, capacity=C, device="cpu", layout=layout)
    if layout == "packed":
        offsets, size = pack_offsets([src.get(n) for n in SOURCE_NAMES])
        assert all(o % PACK_ALIGN == 0 for o in offsets if o >= 0)
        expert_bytes = size
    else:
        expert_bytes = sum(t[0].nbytes for t in src.values())
    gen = torch.Generator().manual_seed(5)
    served = 0
    for _ in range(40):
        pair = torch.randperm(E, generator=gen)[:2].tolist()
        resident = set(p.resident_experts())
        result = p.prepare(torch.tensor([pair], dtype=torch.int64))
        misses = len(set(pair) - resident)
        assert p.stats()["last_copy_bytes"] == misses * expert_bytes
        assert result.w1 is p.buf_w13 and result.w2 is p.buf_w2
        for expert in pair:
            slot = int(result.expert_map[expert])
            assert slot >= 0
            for name in NAMES:
                buf = getattr(p, f"buf_{name}")
                assert buf.dtype == src[name].dtype and buf.shape[1:] == src[name].shape[1:]
                assert torch.equal(raw_bytes(buf[slot]), raw_bytes(src[name][expert])), name
                served += 1
    assert served == 40 * 2 * len(NAMES)
    assert p.slot_mismatches(p.resident_experts()) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_corrupted_bias_or_scale_in_a_slot_is_found(kind: str) -> None:
    """The slot check reads every source, biases and scales included: a checker of the new
    geometry that looked at the values alone would pass this."""
    p = KINDS[kind](**mxfp4_sources(), capacity=C, device="cpu")
    p.prepare(torch.tensor([[1, 4]]))
    slot = p.resident_experts()[4]
    p.buf_w2_bias[slot, 7] += 1.0
    p.buf_w13_scale[p.resident_experts()[1], 0, 0] ^= 1
    found = p.slot_mismatches(p.resident_experts())
    assert len(found) == 2 and all(("w2_bias" in f) != ("w13_scale" in f) for f in found), found


@pytest.mark.parametrize("missing", ["w13_bias", "w2_bias"])
def test_biases_come_as_a_pair(missing: str) -> None:
    src = mxfp4_sources()
    present = "w2_bias" if missing == "w13_bias" else "w13_bias"
    del src[missing]
    with pytest.raises(
        InvalidInputError,
        match=rf"{present} was given without {missing}: per-expert biases must be given together",
    ):
        RowCacheWeightProvider(**src, capacity=C, device="cpu")


def test_a_bias_with_another_expert_count_is_rejected() -> None:
    src = mxfp4_sources()
    src["w2_bias"] = src["w2_bias"][:-1]
    with pytest.raises(InvalidInputError, match=f"w2_bias has E={E - 1}"):
        RowCacheWeightProvider(**src, capacity=C, device="cpu")


@pytest.mark.parametrize("layout", ["separate", "packed"])
def test_gather_pieces_of_a_gpt_oss_20b_expert(layout: str) -> None:
    """At gpt-oss-20b's shapes (H = I = 2880): every region is covered once and exactly, and a
    packed expert is one region."""
    from rowcache.bench.geometry import MXFP4

    src = mxfp4_sources(hidden=2880, inter=2880, experts=2)
    assert {n: (tuple(t.shape[1:]), t.dtype) for n, t in src.items()} == {
        t.name: (t.row_shape, t.dtype) for t in MXFP4.tensors
    }
    assert MXFP4.expert_bytes == sum(t[0].nbytes for t in src.values()) == 13_253_760
    p = RowCacheWeightProvider(**src, capacity=1, device="cpu", layout=layout, planner="device")
    regions = copy_regions(p._sources, p._slots)
    if layout == "packed":
        assert [r.name for r in regions] == ["packed"]
        assert regions[0].row_bytes == p._sources.pack[1] >= MXFP4.expert_bytes
    else:
        assert [(r.name, r.row_bytes) for r in regions] == [(n, src[n][0].nbytes) for n in NAMES]
    pieces = covered_pieces(chunk_table(regions, torch.device("cpu")))
    for region in regions:
        at = 0
        for offset, length, _ in sorted(pieces[(region.src_ptr, region.dst_ptr)]):
            assert offset == at
            at += length
        assert at == region.row_bytes

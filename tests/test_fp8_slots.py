"""FP8 experts in the slots, on the CPU: float8_e4m3fn weights with float32 scales, as vLLM
0.25.0's FP8 MoE methods keep them (docs/PLUGIN.md, "FP8 experts"):

* ``fp8_block``: a checkpoint with 128 x 128 block scales (``Fp8MoEMethod``): ``w13`` ``[E, 2I,
  H]`` and ``w2`` ``[E, H, I]`` in e4m3, ``w13_weight_scale_inv`` ``[E, 2 ceil(I/128),
  ceil(H/128)]`` and ``w2_weight_scale_inv`` ``[E, ceil(H/128), ceil(I/128)]`` in float32. H=384
  and I=128 make the w2 scale row 12 bytes, which the device planner's gather copies in bytes
  (the separate layout) where every other row goes in 8-byte words;
* ``fp8_tensor``: online per-tensor quantization (``Fp8PerTensorOnlineMoEMethod``): the same
  weights and one float32 scale per expert and tensor, ``[E]`` (4-byte rows).

Every provider serves them byte for byte in both slot layouts (weights and scales drawn as raw
bytes, so NaN patterns included), a miss copies exactly the expert's bytes, and the gather's
chunk table covers every byte of every region once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from rowcache import CachedWeightProvider, RowCacheWeightProvider
from rowcache.device_plan.regions import chunk_table, copy_regions
from rowcache.packing import PACK_ALIGN, pack_offsets
from rowcache.sources import SOURCE_NAMES

E, C = 8, 3
FP8 = torch.float8_e4m3fn
BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_sources(
    geometry: str, hidden: int = 384, inter: int = 128, experts: int = E
) -> dict[str, Tensor]:
    """Random bytes in vLLM's FP8 MoE shapes (see the module docstring)."""
    gen = torch.Generator().manual_seed(11)

    def raw(*shape: int) -> Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    w13 = raw(experts, 2 * inter, hidden).view(FP8)
    w2 = raw(experts, hidden, inter).view(FP8)
    if geometry == "fp8_block":
        w13_scale = raw(experts, 2 * _cdiv(inter, BLOCK), 4 * _cdiv(hidden, BLOCK))
        w2_scale = raw(experts, _cdiv(hidden, BLOCK), 4 * _cdiv(inter, BLOCK))
        scales = (w13_scale.view(torch.float32), w2_scale.view(torch.float32))
    else:
        scales = tuple(raw(experts, 4).view(torch.float32).reshape(experts) for _ in range(2))
    return {"w13": w13, "w2": w2, "w13_scale": scales[0], "w2_scale": scales[1]}


def raw_bytes(t: Tensor) -> Tensor:
    """The bytes of a tensor or a strided view (fp8 has no equality on the CPU)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _row(**kw: Any) -> Any:
    return RowCacheWeightProvider(split="token", **kw)


def _device(**kw: Any) -> Any:
    return RowCacheWeightProvider(planner="device", split="expert", **kw)


def _cached(layout: str = "separate", **kw: Any) -> Any:
    if layout != "separate":
        pytest.skip("the cached baseline has the separate layout only")
    return CachedWeightProvider(**kw)


KINDS: dict[str, Callable[..., Any]] = {"row": _row, "device": _device, "cached": _cached}


def test_the_geometries_have_vllms_shapes() -> None:
    block = fp8_sources("fp8_block")
    assert block["w13"].shape == (E, 256, 384) and block["w13"].dtype == FP8
    assert block["w2"].shape == (E, 384, 128) and block["w2"].dtype == FP8
    assert block["w13_scale"].shape == (E, 2, 3) and block["w13_scale"].dtype == torch.float32
    assert block["w2_scale"].shape == (E, 3, 1) and block["w2_scale"].dtype == torch.float32
    assert block["w2_scale"][0].nbytes == 12  # not a multiple of 8: the gather's byte path
    tensor = fp8_sources("fp8_tensor")
    assert tensor["w13_scale"].shape == tensor["w2_scale"].shape == (E,)
    assert tensor["w13_scale"].dtype == tensor["w2_scale"].dtype == torch.float32


@pytest.mark.parametrize("geometry", ["fp8_block", "fp8_tensor"])
@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fp8_experts_are_served_byte_exact(geometry: str, layout: str, kind: str) -> None:
    src = fp8_sources(geometry)
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
        buffers = (result.w1, result.w2, result.w1_scale, result.w2_scale)
        assert result.w1.dtype == result.w2.dtype == FP8
        assert result.w1_scale is not None and result.w1_scale.dtype == torch.float32
        for expert in pair:
            slot = int(result.expert_map[expert])
            assert slot >= 0
            for name, buf in zip(("w13", "w2", "w13_scale", "w2_scale"), buffers, strict=True):
                assert buf is not None
                assert torch.equal(raw_bytes(buf[slot]), raw_bytes(src[name][expert])), name
                served += 1
    assert served == 40 * 2 * 4


def test_packed_scale_views_are_strided_and_the_per_tensor_one_is_not_contiguous() -> None:
    """vLLM's Triton kernel reads block scales through their strides, but the per-tensor scale
    as ``b_scale_ptr + slot`` (``fused_moe.py:480-482``): it needs the separate layout."""
    block = RowCacheWeightProvider(
        **fp8_sources("fp8_block"), capacity=C, device="cpu", layout="packed"
    )
    _, size = block._sources.pack
    assert block.buf_w13_scale.stride() == (size // 4, 3, 1)
    assert block.buf_w2_scale.stride() == (size // 4, 1, 1)
    assert block.buf_w13.stride() == (size, 384, 1)
    tensor = RowCacheWeightProvider(
        **fp8_sources("fp8_tensor"), capacity=C, device="cpu", layout="packed"
    )
    assert tensor.buf_w13_scale.stride() != (1,) and not tensor.buf_w13_scale.is_contiguous()
    separate = RowCacheWeightProvider(**fp8_sources("fp8_tensor"), capacity=C, device="cpu")
    assert separate.buf_w13_scale.is_contiguous() and separate.buf_w13_scale.shape == (C,)


def covered_pieces(table: Tensor) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    pieces: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for src, _, dst, _, offset, length, wide in table.tolist():
        pieces.setdefault((src, dst), []).append((offset, length, wide))
    return pieces


@pytest.mark.parametrize(
    ("geometry", "layout", "byte_rows"),
    [
        ("fp8_block", "separate", set()),  # 768- and 384-byte scale rows: words
        ("fp8_block", "packed", set()),
        ("fp8_tensor", "separate", {"w13_scale", "w2_scale"}),  # 4-byte rows: bytes
        ("fp8_tensor", "packed", set()),
    ],
)
def test_gather_pieces_of_a_qwen3_30b_a3b_fp8_expert(
    geometry: str, layout: str, byte_rows: set[str]
) -> None:
    """At Qwen3-30B-A3B shapes (H 2048, I 768): every region is covered once, in 8-byte words
    where its addresses allow it, and a packed expert is one region."""
    src = fp8_sources(geometry, hidden=2048, inter=768, experts=2)
    if geometry == "fp8_block":
        assert src["w13_scale"][0].nbytes == 768 and src["w2_scale"][0].nbytes == 384
    p = RowCacheWeightProvider(**src, capacity=1, device="cpu", layout=layout, planner="device")
    regions = copy_regions(p._sources, p._slots)
    if layout == "packed":
        assert [r.name for r in regions] == ["packed"]
        assert regions[0].row_bytes == p._sources.pack[1] >= sum(t[0].nbytes for t in src.values())
    else:
        assert [(r.name, r.row_bytes) for r in regions] == [
            (name, src[name][0].nbytes) for name in ("w13", "w2", "w13_scale", "w2_scale")
        ]
    pieces = covered_pieces(chunk_table(regions, torch.device("cpu")))
    for region in regions:
        got = sorted(pieces[(region.src_ptr, region.dst_ptr)])
        at = 0
        for offset, length, _ in got:
            assert offset == at
            at += length
        assert at == region.row_bytes
        narrow = any(wide == 0 for _, _, wide in got)
        assert narrow == (region.name in byte_rows), region.name


def test_the_bench_geometry_is_a_qwen3_30b_a3b_fp8_expert() -> None:
    from rowcache.bench.geometry import FP8_BLOCK

    assert FP8_BLOCK.expert_bytes == 1536 * 2048 + 2048 * 768 + (12 * 16 + 16 * 6) * 4
    assert FP8_BLOCK.expert_bytes == 4_719_744
    assert [t.row_bytes for t in FP8_BLOCK.tensors[2:]] == [768, 384]
    shapes = {t.name: (t.row_shape, t.dtype) for t in FP8_BLOCK.tensors}
    mini = fp8_sources("fp8_block", hidden=2048, inter=768, experts=1)
    assert {n: (tuple(t.shape[1:]), t.dtype) for n, t in mini.items()} == shapes

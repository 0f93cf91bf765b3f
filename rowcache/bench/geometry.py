"""Expert geometries and their pinned host sources."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FP8_BLOCK",
    "GEOMETRIES",
    "KNOWN_GEOMETRIES",
    "MXFP4",
    "Geometry",
    "TensorSpec",
    "make_sources",
]


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor: its keyword for the provider, row shape and dtype."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        count = 1
        for size in self.row_shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Geometry:
    """An expert layout: the tensors every expert has, in provider keyword order."""

    name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(t.row_bytes for t in self.tensors)


BF16 = Geometry(
    "bf16",
    (
        TensorSpec("w13", (1536, 2048), torch.bfloat16),
        TensorSpec("w2", (2048, 768), torch.bfloat16),
    ),
)
"""Qwen3-30B-A3B-like: w13 [1536, 2048], w2 [2048, 768] in bf16 (9.44 MB per expert)."""

NVFP4 = Geometry(
    "nvfp4",
    (
        TensorSpec("w13", (1536, 1024), torch.uint8),
        TensorSpec("w2", (2048, 384), torch.uint8),
        TensorSpec("w13_scale", (1536, 128), torch.float8_e4m3fn),
        TensorSpec("w2_scale", (2048, 48), torch.float8_e4m3fn),
        TensorSpec("w13_scale_2", (), torch.float32),
        TensorSpec("w2_scale_2", (), torch.float32),
    ),
)
"""The same expert NVFP4-like: packed uint8 weights, fp8_e4m3 block scales, fp32 global
scales; six tensors, 2.65 MB per expert."""

BF16_LARGE = Geometry(
    "bf16_large",
    (
        TensorSpec("w13", (8192, 4096), torch.bfloat16),
        TensorSpec("w2", (4096, 4096), torch.bfloat16),
    ),
)
"""One large bf16 expert (issue 4: at least 100 MB): w13 [8192, 4096] (64 MiB), w2
[4096, 4096] (32 MiB); 100.66 MB per expert, 12.9 GB of pinned sources for 128 experts."""

FP8_BLOCK = Geometry(
    "fp8_block",
    (
        TensorSpec("w13", (1536, 2048), torch.float8_e4m3fn),
        TensorSpec("w2", (2048, 768), torch.float8_e4m3fn),
        TensorSpec("w13_scale", (12, 16), torch.float32),
        TensorSpec("w2_scale", (16, 6), torch.float32),
    ),
)
"""The same expert as vLLM's block-scaled FP8 keeps it (``Fp8MoEMethod``, weight_block_size
[128, 128]; docs/PLUGIN.md "FP8 experts"): float8_e4m3fn weights, float32 block scales
``[2I/128, H/128]`` and ``[H/128, I/128]`` (768 and 384 bytes, both copied in 8-byte words);
four tensors, 4.72 MB per expert. Not in ``GEOMETRIES`` yet: the benches run every geometry
there by default, and their recorded defaults are bf16, nvfp4 and bf16_large."""

MXFP4 = Geometry(
    "mxfp4",
    (
        TensorSpec("w13", (5760, 1440), torch.uint8),
        TensorSpec("w2", (2880, 1440), torch.uint8),
        TensorSpec("w13_scale", (5760, 90), torch.uint8),
        TensorSpec("w2_scale", (2880, 90), torch.uint8),
        TensorSpec("w13_bias", (5760,), torch.float32),
        TensorSpec("w2_bias", (2880,), torch.float32),
    ),
)
"""A gpt-oss-20b expert in MXFP4 (hidden 2880, intermediate 2880): two 4-bit values per
``uint8`` (``[2I, H/2]`` and ``[H, I/2]``), one e8m0 ``uint8`` scale per 32 values (``[2I,
H/32]``, ``[H, I/32]``) and float32 output biases (``[2I]``, ``[H]``), as vLLM 0.25.0 loads
them before its Hopper swizzle (which keeps each expert's bytes contiguous); six tensors,
13.25 MB per expert. Not in ``GEOMETRIES``, for the reason ``FP8_BLOCK`` gives: a bench takes
it by name (``--geometries mxfp4``)."""

DEEPSEEK_V2_LITE = Geometry(
    "deepseek_v2_lite",
    (
        TensorSpec("w13", (2816, 2048), torch.bfloat16),
        TensorSpec("w2", (2048, 1408), torch.bfloat16),
    ),
)
"""A DeepSeek-V2-Lite routed expert in bf16 (hidden 2048, intermediate 1408): w13 [2816, 2048],
w2 [2048, 1408], 17.30 MB per expert, rows of 4,096 and 2,816 bytes. Taken by name: in the
device-path bench on an H100 the gather moved these experts at 0.93 to 0.94 of the pinned copy,
as it moved ``bf16``'s (docs/records/2026-12-06-deepseek-v2-lite-raw.md)."""

GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (BF16, NVFP4, BF16_LARGE)}
KNOWN_GEOMETRIES: dict[str, Geometry] = {
    **GEOMETRIES,
    FP8_BLOCK.name: FP8_BLOCK,
    MXFP4.name: MXFP4,
    DEEPSEEK_V2_LITE.name: DEEPSEEK_V2_LITE,
}
"""What a bench takes by name: the defaults and those it runs only when named."""

FILL_BLOCK = 64 << 20
"""Sources larger than this many bytes are filled by tiling one random block of this size."""


def _fill(tensor: Tensor, generator: torch.Generator) -> None:
    raw = tensor.view(torch.uint8).reshape(-1)
    total = raw.numel()
    if total <= FILL_BLOCK:
        raw.random_(0, 256, generator=generator)
        return
    # Drawing gigabytes byte by byte takes tens of seconds; the copies do not care what the
    # bytes are (PCIe does not compress), so tile one random block and make every expert's
    # row distinct by redrawing its first bytes.
    block = torch.empty(FILL_BLOCK, dtype=torch.uint8)
    block.random_(0, 256, generator=generator)
    for offset in range(0, total, FILL_BLOCK):
        count = min(FILL_BLOCK, total - offset)
        raw[offset : offset + count].copy_(block[:count])
    rows = raw.view(tensor.shape[0], -1)
    rows[:, : min(16, rows.shape[1])].random_(0, 256, generator=generator)


def make_sources(geometry: Geometry, num_experts: int, *, seed: int) -> dict[str, Tensor]:
    """Pinned host tensors ``[E, *row_shape]`` filled with random bytes (not left zero).

    Random bit patterns may be NaN as floats; the benchmark only copies them. A tensor larger
    than ``FILL_BLOCK`` bytes repeats one random block, each expert's first bytes redrawn.
    """
    generator = torch.Generator().manual_seed(seed)
    sources: dict[str, Tensor] = {}
    for spec in geometry.tensors:
        tensor = torch.empty((num_experts, *spec.row_shape), dtype=spec.dtype, pin_memory=True)
        _fill(tensor, generator)
        sources[spec.name] = tensor
    return sources

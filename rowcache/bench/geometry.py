"""Expert geometries and their pinned host sources."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GEOMETRIES", "Geometry", "TensorSpec", "make_sources"]


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

GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (BF16, NVFP4)}


def make_sources(geometry: Geometry, num_experts: int, *, seed: int) -> dict[str, Tensor]:
    """Pinned host tensors ``[E, *row_shape]`` filled with random bytes (never zeros).

    Random bit patterns may be NaN as floats; the benchmark only copies them.
    """
    generator = torch.Generator().manual_seed(seed)
    sources: dict[str, Tensor] = {}
    for spec in geometry.tensors:
        tensor = torch.empty((num_experts, *spec.row_shape), dtype=spec.dtype, pin_memory=True)
        tensor.view(torch.uint8).random_(0, 256, generator=generator)
        sources[spec.name] = tensor
    return sources

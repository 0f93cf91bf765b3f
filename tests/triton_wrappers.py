"""The fields of triton_kernels' tensor wrappers that the plugin and the harness read, as plain
dataclasses: tests build converted MXFP4 weights from them without triton_kernels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Storage:  # triton_kernels.tensor.Storage's fields
    data: torch.Tensor
    layout: Any = None


@dataclass
class Wrapper:  # triton_kernels.tensor.Tensor's fields
    storage: Storage
    dtype: Any = None
    shape: list[int] = field(default_factory=list)
    shape_max: list[int] = field(default_factory=list)

"""The part of the provider surface both providers share: shape, split and slot buffers."""

from __future__ import annotations

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.sources import SlotBuffers
from rowcache.types import Split

SPLITS: tuple[Split, ...] = ("token", "expert")


def check_split(split: object) -> Split:
    for known in SPLITS:
        if split == known:
            return known
    raise InvalidInputError(f"split must be one of {list(SPLITS)}, got {split!r}")


class SlotSurface:
    """Read-only properties over the attributes every provider sets in its constructor."""

    _capacity: int
    _split: Split
    _num_experts: int
    _device: torch.device
    _slots: SlotBuffers

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def split(self) -> Split:
        return self._split

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def buf_w13(self) -> Tensor:
        return self._slots.w13

    @property
    def buf_w2(self) -> Tensor:
        return self._slots.w2

    @property
    def buf_w13_scale(self) -> Tensor | None:
        return self._slots.w13_scale

    @property
    def buf_w2_scale(self) -> Tensor | None:
        return self._slots.w2_scale

    @property
    def buf_w13_scale_2(self) -> Tensor | None:
        return self._slots.w13_scale_2

    @property
    def buf_w2_scale_2(self) -> Tensor | None:
        return self._slots.w2_scale_2

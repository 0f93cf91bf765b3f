"""The part of the provider surface both providers share: shape, split and slot buffers."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.packing import Layout
from rowcache.sources import SOURCE_NAMES, ExpertSources, SlotBuffers, allocate_slot_buffers
from rowcache.types import ExpertWeightResult, Split

SPLITS: tuple[Split, ...] = ("token", "expert")


def check_split(split: object) -> Split:
    for known in SPLITS:
        if split == known:
            return known
    raise InvalidInputError(f"split must be one of {list(SPLITS)}, got {split!r}")


class SlotSurface:
    """The sources, slot buffers and shape every provider sets up in its constructor
    (``_set_up_slots``), and read-only properties over them."""

    _capacity: int
    _split: Split
    _num_experts: int
    _device: torch.device
    _sources: ExpertSources
    _slots: SlotBuffers

    def _set_up_slots(
        self,
        w13: Tensor,
        w2: Tensor,
        w13_scale: Tensor | None,
        w2_scale: Tensor | None,
        w13_scale_2: Tensor | None,
        w2_scale_2: Tensor | None,
        *,
        w13_bias: Tensor | None = None,
        w2_bias: Tensor | None = None,
        capacity: int,
        split: object,
        device: torch.device,
        layout: Layout = "separate",
        share_sources: bool = False,
        compress: bool = False,
    ) -> None:
        """Validate the split and the sources (copied into host memory the provider owns
        unless ``share_sources``, w13 and w2 as bf16 planes with ``compress``:
        ``rowcache.sources.ExpertSources``), allocate ``capacity`` slots on ``device`` in
        ``layout`` (``rowcache.packing``)."""
        self._split = check_split(split)
        self._device = device
        self._sources = ExpertSources(
            w13,
            w2,
            w13_scale,
            w2_scale,
            w13_scale_2=w13_scale_2,
            w2_scale_2=w2_scale_2,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            device=device,
            layout=layout,
            share=share_sources,
            compress=compress,
        )
        self._slots = allocate_slot_buffers(self._sources, capacity, device)
        self._capacity = capacity
        self._num_experts = self._sources.num_experts

    def _check_expert_id(self, expert_id: object) -> None:
        """Reject an ``invalidate`` argument that is not an int in ``[0, E)``."""
        if isinstance(expert_id, bool) or not isinstance(expert_id, int):
            raise InvalidInputError(
                f"invalidate: expert_id must be an int, got {expert_id!r} "
                f"({type(expert_id).__name__})"
            )
        if not 0 <= expert_id < self._num_experts:
            raise InvalidInputError(
                f"invalidate: expert id {expert_id} outside [0, {self._num_experts})"
            )

    def _result_with(self, expert_map: Tensor) -> ExpertWeightResult:
        """The result every ``prepare`` returns: the live slot buffers and ``expert_map``
        (built once: the buffers and the map keep their addresses)."""
        slots = self._slots
        return ExpertWeightResult(
            w1=slots.w13,
            w2=slots.w2,
            expert_map=expert_map,
            w1_scale=slots.w13_scale,
            w2_scale=slots.w2_scale,
        )

    def slot_mismatches(self, resident: Mapping[int, int]) -> list[str]:
        """Every slot of ``resident`` (expert to slot, as ``resident_experts()`` gives it) whose
        bytes differ from its expert's host bytes, tensor by tensor, as ``"expert E slot S:
        w13"``; empty when every one is exact. Reads the slots back to the host (a blocking
        copy on the current stream): call it with no provider call in flight, after waiting
        for the device. A check for tests and end-of-run audits, not for a forward."""
        bad: list[str] = []
        pairs = zip(SOURCE_NAMES, self._sources.tensors(), self._slots.tensors(), strict=True)
        for name, source, slots in pairs:
            if source is None or slots is None:
                continue
            for expert, slot in sorted(resident.items()):
                host = self._sources.expert_host_bytes(name, expert)
                held = slots[slot].to("cpu").reshape(-1).contiguous().view(torch.uint8)
                if not torch.equal(host, held):
                    bad.append(f"expert {expert} slot {slot}: {name}")
        return bad

    @property
    def compressed(self) -> tuple[str, ...]:
        """The sources held as bf16 planes (``compress=True``: w13 and w2), else none."""
        return tuple(n for n in SOURCE_NAMES if n in self._sources.planes)

    def source_weights(self, name: str, device: torch.device | str) -> Tensor:
        """Every expert of source ``name`` (``"w13"``, ``"w2"``, ...) as the slots hold them,
        on ``device``: the host tensors copied there, or their planes decoded there when the
        provider holds them compressed. For audits and reference forwards (a whole expert set
        on the device), not for a forward."""
        if name not in SOURCE_NAMES:
            raise InvalidInputError(f"unknown source {name!r}; sources: {', '.join(SOURCE_NAMES)}")
        return self._sources.whole(name, device)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def split(self) -> Split:
        return self._split

    @property
    def layout(self) -> Layout:
        """How the slot buffers lie in memory: ``separate`` or ``packed`` (``rowcache.packing``)."""
        return self._sources.layout

    @property
    def share_sources(self) -> bool:
        """Whether the host sources are the caller's tensors (``share_sources=True``) rather
        than the provider's own copy."""
        return self._sources.shared

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

    @property
    def buf_w13_bias(self) -> Tensor | None:
        return self._slots.w13_bias

    @property
    def buf_w2_bias(self) -> Tensor | None:
        return self._slots.w2_bias

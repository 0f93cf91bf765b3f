"""The CPU backend: the table's steps run synchronously on the host.

Streams and events do not exist on a CPU, so ``record_event``, ``wait_event``, ``wait_flag``,
``release_staging`` and ``host_sync`` do nothing: every step has finished when its call returns,
which satisfies every ordering the table asks for. Copies are real tensor copies of each
expert's rows of every present source into its slot (sources held as bf16 planes decoded into
it by the reference decode), and maps are real int32 tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rowcache.backends.base import RINGS, MapContent
from rowcache.compress import Bf16Planes, decode_experts
from rowcache.sources import ExpertSources, SlotBuffers, planes_and_slots

__all__ = ["CPU_STREAM", "CpuBackend"]

CPU_STREAM = "cpu"
"""The one stream of a CPU: every host call is made on it, so the owner never changes."""
COPY_STREAM = "cpu-copy"


class CpuBackend:
    """Synchronous copies into the slot buffers and map writes, on the CPU."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Tensor, Tensor]] = []
        self._decoded: list[tuple[Bf16Planes, Tensor]] = []
        self._maps: dict[str, Tensor] = {}
        self._staged: dict[str, Tensor] = {}

    def bind(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        self._pairs = [
            (buf, src)
            for buf, src in zip(slots.tensors(), sources.copied(), strict=True)
            if buf is not None and src is not None
        ]
        self._decoded = planes_and_slots(sources, slots)
        device = slots.w13.device
        self._maps = {
            ring: torch.full((sources.num_experts,), -1, dtype=torch.int32, device=device)
            for ring in RINGS
        }
        self._staged = {}

    @property
    def forward_map(self) -> Tensor:
        return self._maps["forward"]

    @property
    def resident_map(self) -> Tensor:
        return self._maps["resident"]

    @property
    def copy_stream(self) -> str:
        return COPY_STREAM

    def current_stream(self) -> str:
        return CPU_STREAM

    def record_event(self, stream: str, event: str) -> None:
        pass

    def wait_event(self, stream: str, event: str) -> None:
        pass

    def wait_flag(self, stream: str, event: str) -> None:
        pass

    def copy_rows(self, stream: str, copies: Sequence[tuple[int, int]]) -> None:
        for buf, src in self._pairs:
            for expert, slot in copies:
                buf[slot].copy_(src[expert])
        for planes, buf in self._decoded:  # sources held as bf16 planes: the reference decode
            for expert, slot in copies:
                buf[slot].copy_(decode_experts(planes, [expert])[0])

    def write_staging(self, ring: str, content: MapContent) -> None:
        # A copy: the content may be a live view of the provider's host mirror.
        self._staged[ring] = torch.as_tensor(content, dtype=torch.int32).clone()

    def upload_map(self, stream: str, ring: str) -> None:
        self._maps[ring].copy_(self._staged[ring])

    def release_staging(self, stream: str, ring: str) -> None:
        pass

    def host_sync(self, stream: str | None, role: str) -> None:
        pass

    def consumer_read(self, stream: str, pairs: Sequence[tuple[int, int]]) -> None:
        pass

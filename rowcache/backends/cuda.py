"""The CUDA backend: the table's steps as stream and event operations.

The only module of rowcache that touches ``torch.cuda``. It is thin on purpose: every ordering
decision is in the generated schedule (``rowcache/schedules/_generated.py``, from
``spec/table.toml``), which the model checks; this module maps one step kind to one CUDA
operation and nothing else:

* ``record_event`` / ``wait_event``: one ``torch.cuda.Event`` per event name of the table
  (``release``, ``ready``), created once and re-recorded by every call, exactly where the
  table records it. ``stream.wait_event`` captures the snapshot at the time of the call;
  PyTorch skips a wait on an event never recorded.
* ``copy_rows``: on the copy stream, one non-blocking host-to-device copy per present source
  tensor per miss (all six tensors when scales are given), from the pinned sources into the
  slot rows. No per-element device writes.
* ``write_staging`` / ``upload_map`` / ``release_staging``: each map (``resident``,
  ``forward``) has a ring of pinned int32 staging buffers, each with a reuse event. The host
  writes the map into a buffer whose reuse event has completed (``event.query()``, never
  blocking; a buffer never used counts as free) and appends a fresh pinned buffer when none
  is free; the upload is one non-blocking copy of the whole map; the reuse event is recorded
  on the upload's stream right after it.
* ``host_sync``: ``stream.synchronize()`` (or the device's, for ``all``). The real table has
  none on the provider's path.

Importing this module needs no GPU (nothing touches ``torch.cuda`` until a backend is built).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rowcache.backends.base import RINGS
from rowcache.sources import ExpertSources, SlotBuffers

__all__ = ["CudaBackend"]

EVENTS = ("release", "ready")


class _Ring:
    """Pinned staging buffers of one map, each paired with the event that orders its reuse."""

    __slots__ = ("buffers", "chosen", "events", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: list[Tensor] = []
        self.events: list[torch.cuda.Event] = []
        self.chosen = -1

    def choose(self) -> Tensor:
        for index, event in enumerate(self.events):
            # True once the upload that last read the buffer ran (or when never recorded).
            if event.query():  # type: ignore[no-untyped-call]
                self.chosen = index
                return self.buffers[index]
        self.buffers.append(torch.empty(self.size, dtype=torch.int32, pin_memory=True))
        self.events.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
        self.chosen = len(self.buffers) - 1
        return self.buffers[-1]


class CudaBackend:
    """Stream/event implementation of the table's steps on one CUDA device."""

    def __init__(self, device: torch.device | str) -> None:
        target = torch.device(device)
        if target.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {target}")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        self._device = target
        self._copy_stream = torch.cuda.Stream(device=target)  # type: ignore[no-untyped-call]
        self._events = {
            name: torch.cuda.Event()  # type: ignore[no-untyped-call]
            for name in EVENTS
        }
        self._pairs: list[tuple[Tensor, Tensor]] = []
        self._maps: dict[str, Tensor] = {}
        self._rings: dict[str, _Ring] = {}

    def bind(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        self._pairs = [
            (buf, src)
            for buf, src in zip(slots.tensors(), sources.tensors(), strict=True)
            if buf is not None and src is not None
        ]
        num_experts = sources.num_experts
        self._maps = {
            ring: torch.full((num_experts,), -1, dtype=torch.int32, device=self._device)
            for ring in RINGS
        }
        self._rings = {ring: _Ring(num_experts) for ring in RINGS}
        # Slot buffers and the resident map are written on the copy stream: tell the caching
        # allocator, so that their memory is not handed out again while that stream may still
        # write it (only matters once the provider is gone).
        for buf in (*slots.tensors(), self._maps["resident"]):
            if buf is not None:
                buf.record_stream(self._copy_stream)
        # One-time setup, not a provider call: the allocations and the maps' -1 fill were
        # enqueued on the current stream; later work runs on the copy stream and on whatever
        # stream the first prepare is made on, so let that setup finish here.
        torch.cuda.current_stream(self._device).synchronize()

    @property
    def forward_map(self) -> Tensor:
        return self._maps["forward"]

    @property
    def resident_map(self) -> Tensor:
        return self._maps["resident"]

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._copy_stream

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device)

    def record_event(self, stream: torch.cuda.Stream, event: str) -> None:
        self._events[event].record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: str) -> None:
        stream.wait_event(self._events[event])

    def wait_flag(self, stream: torch.cuda.Stream, event: str) -> None:
        raise NotImplementedError(
            "wait_flag (a device-side wait on an event's latest snapshot) exists only in the "
            "model and the recording backend; the CUDA backend implements wait_event"
        )

    def copy_rows(self, stream: torch.cuda.Stream, copies: Sequence[tuple[int, int]]) -> None:
        pairs = self._pairs
        with torch.cuda.stream(stream):
            for expert, slot in copies:
                for buf, src in pairs:
                    buf[slot].copy_(src[expert], non_blocking=True)

    def write_staging(self, ring: str, content: Sequence[int]) -> None:
        buffer = self._rings[ring].choose()
        buffer.copy_(torch.tensor(content, dtype=torch.int32))

    def upload_map(self, stream: torch.cuda.Stream, ring: str) -> None:
        staging = self._rings[ring]
        with torch.cuda.stream(stream):
            self._maps[ring].copy_(staging.buffers[staging.chosen], non_blocking=True)

    def release_staging(self, stream: torch.cuda.Stream, ring: str) -> None:
        staging = self._rings[ring]
        staging.events[staging.chosen].record(stream)

    def host_sync(self, stream: torch.cuda.Stream | None, role: str) -> None:
        if stream is None:
            torch.cuda.synchronize(self._device)
        else:
            stream.synchronize()

    def staging_buffers(self) -> dict[str, int]:
        """How many pinned staging buffers each ring holds (for stats and tests)."""
        return {ring: len(r.buffers) for ring, r in self._rings.items()}

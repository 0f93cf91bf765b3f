"""A backend with no device at all: it records each step as the model's trace line.

The lines are exactly those ``model_check.streams.queues`` puts in ``Outcome.trace`` for the same
step (``"record release on 0"``, ``"copy expert 2 to slot 0 on 2"``, ``"stage resident"``,
``"host_sync all"``...), so a test can compare a provider's calls with the model's line by
line. Streams are numbered as in the model: consumer streams ``0..n-1``, the copy stream ``n``.
A stream is any hashable label; labels map to indices through ``index`` (given, or assigned in
order of first use), and ``COPY_STREAM`` is the copy stream's label.

Besides the trace, the backend simulates a device that runs every step at once: it keeps the
expert each slot holds (``slot_experts``) and fills two host int32 tensors as the maps, so the
provider built on it returns real maps (the slot buffers themselves are never written).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from rowcache.backends.base import RINGS, MapContent, map_values
from rowcache.sources import ExpertSources, SlotBuffers

__all__ = ["COPY_STREAM", "RecordingBackend"]

COPY_STREAM = "copy"


def pairs_text(pairs: Sequence[tuple[int, int]]) -> str:
    """The model's rendering of an (expert, slot) list: ``{0->slot1, 3->slot0}``."""
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


class RecordingBackend:
    """Records the provider's device calls in the model's trace format."""

    def __init__(
        self,
        consumer_streams: int = 2,
        index: Mapping[Hashable, int] | None = None,
        *,
        current: Hashable = 0,
    ) -> None:
        if consumer_streams <= 0:
            raise ValueError(f"consumer_streams must be positive, got {consumer_streams}")
        self.consumer_streams = consumer_streams
        self._index: dict[Hashable, int] = dict(index or {})
        self._index[COPY_STREAM] = consumer_streams
        self.current: Hashable = current
        self.trace: list[str] = []
        self._staged: dict[str, list[int]] = {}
        self._maps: dict[str, Tensor] = {}
        self.slot_experts: list[int] = []

    # -- the stream -> index hook ---------------------------------------------------

    def stream_index(self, stream: Hashable) -> int:
        """The model's number for ``stream``; a new consumer label gets the lowest free one."""
        found = self._index.get(stream)
        if found is not None:
            return found
        used = set(self._index.values())
        free = next((i for i in range(self.consumer_streams) if i not in used), None)
        if free is None:
            raise ValueError(
                f"stream {stream!r} is a new stream but all {self.consumer_streams} consumer "
                "stream numbers are taken"
            )
        self._index[stream] = free
        return free

    def take(self) -> list[str]:
        """The lines recorded since the last ``take``, clearing them."""
        lines, self.trace = self.trace, []
        return lines

    # -- Backend ----------------------------------------------------------------------

    def bind(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        self._maps = {
            ring: torch.full((sources.num_experts,), -1, dtype=torch.int32) for ring in RINGS
        }
        self.slot_experts = [-1] * slots.capacity

    @property
    def forward_map(self) -> Tensor:
        return self._maps["forward"]

    @property
    def resident_map(self) -> Tensor:
        return self._maps["resident"]

    @property
    def copy_stream(self) -> Hashable:
        return COPY_STREAM

    def current_stream(self) -> Hashable:
        return self.current

    def record_event(self, stream: Hashable, event: str) -> None:
        self.trace.append(f"record {event} on {self.stream_index(stream)}")

    def wait_event(self, stream: Hashable, event: str) -> None:
        self.trace.append(f"wait {event} on {self.stream_index(stream)}")

    def wait_flag(self, stream: Hashable, event: str) -> None:
        self.trace.append(f"waitflag {event} on {self.stream_index(stream)}")

    def copy_rows(self, stream: Hashable, copies: Sequence[tuple[int, int]]) -> None:
        sid = self.stream_index(stream)
        for expert, slot in copies:
            self.trace.append(f"copy expert {expert} to slot {slot} on {sid}")
            self.slot_experts[slot] = expert

    def write_staging(self, ring: str, content: MapContent) -> None:
        self.trace.append(f"stage {ring}")
        self._staged[ring] = map_values(content)

    def upload_map(self, stream: Hashable, ring: str) -> None:
        self.trace.append(f"upload {ring} map on {self.stream_index(stream)}")
        staged = self._staged.get(ring)
        if staged is not None:
            self._maps[ring].copy_(torch.tensor(staged, dtype=torch.int32))

    def release_staging(self, stream: Hashable, ring: str) -> None:
        self.trace.append(f"record {ring} staging reuse on {self.stream_index(stream)}")

    def host_sync(self, stream: Hashable | None, role: str) -> None:
        if stream is not None:
            self.stream_index(stream)  # a stream that syncs is a stream the model numbers
        self.trace.append(f"host_sync {role}")

    # -- ConsumerBackend --------------------------------------------------------------

    def consumer_read(self, stream: Hashable, pairs: Sequence[tuple[int, int]]) -> None:
        self.trace.append(f"read {pairs_text(pairs)} on {self.stream_index(stream)}")

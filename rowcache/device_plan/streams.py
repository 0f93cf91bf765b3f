"""The stream and event primitives the device-planned provider's generated handoff runs on.

The order of a provider call's records and waits, the streams they go to, the stream its other
work runs on and the owner it leaves are the table's (``spec/table.toml``, section ``[device]``),
through the functions ``python -m model_check.codegen`` writes
(``rowcache.schedules._device_generated``: ``handoff_<op>(events, current, owner)``). What a
record, a wait or "run on a stream" means is here, behind ``Streams``:

* ``CudaStreams``: CUDA streams and events (``torch.cuda``); every record is a new event,
  which the following wait of the same name waits for.

The tests put a recording double in its place (``tests/recording_streams.py``), which logs
every record and wait with its stream.

On the CPU the provider has no streams (``None``): it hands nothing over and keeps no owner.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import torch

__all__ = ["CudaStreams", "Streams"]

S = TypeVar("S")


class Streams(Protocol[S]):
    """The current stream, whether it captures, events between streams, work on a stream.

    ``record_event`` and ``wait_event`` are the generated handoff's ``Events``."""

    def current_stream(self) -> S: ...

    def capturing(self) -> bool: ...

    def record_event(self, stream: S, event: str) -> None: ...

    def wait_event(self, stream: S, event: str) -> None: ...

    def on(self, stream: S) -> AbstractContextManager[None]: ...


class CudaStreams:
    """CUDA streams of one device."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._recorded: dict[str, torch.cuda.Event] = {}

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def record_event(self, stream: torch.cuda.Stream, event: str) -> None:
        recorded = torch.cuda.Event()  # type: ignore[no-untyped-call]
        recorded.record(stream)
        self._recorded[event] = recorded

    def wait_event(self, stream: torch.cuda.Stream, event: str) -> None:
        stream.wait_event(self._recorded[event])

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager[None]:
        return torch.cuda.stream(stream)

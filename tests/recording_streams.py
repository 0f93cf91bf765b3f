"""Streams with no device for the device-planned provider's tests: ``RecordingStreams`` logs
every record and wait of the generated handoff with its stream, and keeps a current stream that
``on`` switches as ``torch.cuda.stream`` does, so a test can compare what the provider enqueues
where with the model's program of the same call (the ``Streams`` protocol of
``rowcache.device_plan.streams``)."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

Entry = tuple[str, Hashable, str]
"""``("record", stream, event)``, ``("wait", stream, event)``, or ``("op", stream, kind)`` for
work a test notes (``RecordingStreams.note``) on the stream current at the time."""


class RecordingStreams:
    """Streams with no device: records and waits are logged, nothing runs (tests)."""

    def __init__(self, current: Hashable = 0) -> None:
        self.current: Hashable = current
        self.capture = False  # what ``capturing`` answers (a test sets it)
        self.log: list[Entry] = []

    def current_stream(self) -> Hashable:
        return self.current

    def capturing(self) -> bool:
        return self.capture

    def record_event(self, stream: Hashable, event: str) -> None:
        self.log.append(("record", stream, event))

    def wait_event(self, stream: Hashable, event: str) -> None:
        self.log.append(("wait", stream, event))

    @contextmanager
    def on(self, stream: Hashable) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def note(self, kind: str) -> None:
        """Log work of ``kind`` on the current stream."""
        self.log.append(("op", self.current, kind))

    def take(self) -> list[Entry]:
        """The entries logged since the last ``take``, clearing them."""
        log, self.log = self.log, []
        return log

"""Replaying recorded traces through PyTorch's CUDA stream sanitizer, an independent oracle.

``torch.cuda._sanitizer.EventHandler`` is the analysis half of CSAN (``TORCH_CUDA_SANITIZER``):
pure Python, vector clocks per stream and per recorded event, and an access log per data
pointer; it needs no GPU. Each line of a trace in the model's recording format (the format of
``rowcache.backends.RecordingBackend`` and ``model_check.streams.queues``) becomes the sanitizer
call that a real run would have produced:

  record <event> on <s>                 event record (one synthetic event id per name)
  record <ring> staging reuse on <s>    event record (the ring's reuse event)
  wait <event> on <s>                   stream waits on the event
  waitflag <event> on <s>               approximated as a wait at call time (not exact)
  copy expert <e> to slot <k> on <s>    kernel on s writing slot k
  upload <ring> map on <s>              kernel on s writing the ring's device map
  read {<e>-><slot k>, ...} on <s>      kernel on s reading those slots and the forward map
  stage <ring>                          host write of pinned memory: not a device access
  host_sync all                         device synchronization

Streams are model numbers (consumer streams, then the copy stream), mapped to synthetic
stream ids; slots and maps are synthetic data pointers. The sanitizer reports every pair of
conflicting accesses (write/write or read/write of one pointer) that no chain of event
records and waits orders, whatever the device timing, so a clean replay means the trace's
events order every conflicting access.

**Importing the sanitizer module costs every later GPU operation of the process.** Importing
``torch.cuda._sanitizer`` builds its ``cuda_sanitizer``, whose constructor switches on
PyTorch's GPU trace and registers its event handler for every event, stream, allocation and
synchronization of the process, for the life of the process, whether the sanitizer is ever
enabled or not; that handler's bookkeeping grows with everything it has seen. In a pytest run of
``tests/cuda`` (whose collection imports this module) the device planner's lockstep at 200
examples a cell ran over 550 s for one geometry (two cells) without finishing; one of those
cells in a process without the import took 23 s (H200, 2026-12-01, ``docs/CONFORMANCE.md``,
attempt F; upstream, the same leak is pytorch/pytorch#181865). So, unless the sanitizer is
enabled when this module is imported, the import takes that handler's callbacks back off: only
the analysis half (``EventHandler``, driven by hand below) is used here. A process that
sanitizes must enable the sanitizer before importing this module, as ``TORCH_CUDA_SANITIZER=1``
does (torch enables it as it is imported); ``handlers_attached`` tells, and the GPU suite checks
it at start under ``TORCH_CUDA_SANITIZER``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.cuda._gpu_trace as gpu_trace
import torch.cuda._sanitizer as csan
from torch._utils import CallbackRegistry
from torch.cuda._sanitizer import EventHandler, SynchronizationError, UnsynchronizedAccessError


def _registries() -> list[CallbackRegistry[Any]]:
    return [r for r in vars(gpu_trace).values() if isinstance(r, CallbackRegistry)]


def _is_the_process_handlers(callback: object) -> bool:
    """A callback of the process's sanitizer (``cuda_sanitizer``)."""
    return getattr(callback, "__self__", None) is csan.cuda_sanitizer.dispatch.event_handler


def handlers_attached() -> bool:
    """Whether the process's sanitizer still gets the GPU trace's events."""
    return any(_is_the_process_handlers(cb) for r in _registries() for cb in r.callback_list)


def _detach_unless_enabled() -> None:
    if csan.cuda_sanitizer.enabled:
        return
    for registry in _registries():
        registry.callback_list[:] = [
            cb for cb in registry.callback_list if not _is_the_process_handlers(cb)
        ]


_detach_unless_enabled()

STREAM_BASE = 1000
SLOT_BASE = 10_000
MAP_PTRS = {"resident": 1, "forward": 2}

_RECORD = re.compile(r"record (\w+) on (\d+)")
_RECORD_REUSE = re.compile(r"record (\w+) staging reuse on (\d+)")
_WAIT = re.compile(r"wait (\w+) on (\d+)")
_WAIT_FLAG = re.compile(r"waitflag (\w+) on (\d+)")
_COPY = re.compile(r"copy expert (\d+) to slot (\d+) on (\d+)")
_UPLOAD = re.compile(r"upload (\w+) map on (\d+)")
_READ = re.compile(r"read \{(.*)\} on (\d+)")
_PAIR = re.compile(r"(\d+)->slot(\d+)")
_STAGE = re.compile(r"stage (\w+)")
_SYNC = re.compile(r"host_sync (\w+)")


@dataclass(frozen=True)
class Race:
    """One unsynchronized pair of accesses, described by the trace lines that made them."""

    pointer: str
    current: str
    previous: str

    def __str__(self) -> str:
        return f"{self.pointer}: `{self.current}` is not ordered after `{self.previous}`"


class SanitizerOracle:
    def __init__(self) -> None:
        self.handler = EventHandler()
        self.races: list[Race] = []
        self.errors: list[SynchronizationError] = []
        self._streams: set[int] = set()
        self._events: dict[str, int] = {}

    def _stream(self, index: str) -> int:
        sid = STREAM_BASE + int(index)
        if sid not in self._streams:
            self._streams.add(sid)
            self.handler._handle_stream_creation(sid)
        return sid

    def _event(self, name: str) -> int:
        if name not in self._events:
            self._events[name] = len(self._events) + 1
            self.handler._handle_event_creation(self._events[name])
        return self._events[name]

    def _kernel(self, line: str, stream: int, reads: set[int], writes: set[int]) -> None:
        aliases: dict[int, list[str]] = {ptr: [] for ptr in reads | writes}
        found = self.handler._handle_kernel_launch(stream, reads, writes, set(), line, aliases)
        self.errors.extend(found)
        for error in found:
            assert isinstance(error, UnsynchronizedAccessError)
            self.races.append(
                Race(
                    _pointer_name(error.data_ptr),
                    error.current_access.operator,
                    error.previous_access.operator,
                )
            )

    def feed(self, line: str) -> None:
        if m := _RECORD_REUSE.fullmatch(line):
            self.handler._handle_event_record(self._event(f"{m[1]} staging"), self._stream(m[2]))
        elif m := _RECORD.fullmatch(line):
            self.handler._handle_event_record(self._event(m[1]), self._stream(m[2]))
        elif (m := _WAIT.fullmatch(line)) or (m := _WAIT_FLAG.fullmatch(line)):
            self.handler._handle_event_wait(self._event(m[1]), self._stream(m[2]))
        elif m := _COPY.fullmatch(line):
            self._kernel(line, self._stream(m[3]), set(), {SLOT_BASE + int(m[2])})
        elif m := _UPLOAD.fullmatch(line):
            self._kernel(line, self._stream(m[2]), set(), {MAP_PTRS[m[1]]})
        elif m := _READ.fullmatch(line):
            slots = {SLOT_BASE + int(slot) for _, slot in _PAIR.findall(m[1])}
            self._kernel(line, self._stream(m[2]), slots | {MAP_PTRS["forward"]}, set())
        elif _STAGE.fullmatch(line):
            pass
        elif m := _SYNC.fullmatch(line):
            if m[1] != "all":
                raise ValueError(
                    f"cannot replay {line!r}: the trace names the role, not the stream index"
                )
            self.handler._handle_device_synchronization()
        else:
            raise ValueError(f"unknown trace line {line!r}")

    def replay(self, lines: Iterable[str]) -> list[Race]:
        for line in lines:
            self.feed(line)
        return self.races


def _pointer_name(ptr: int) -> str:
    for ring, value in MAP_PTRS.items():
        if ptr == value:
            return f"{ring} map"
    return f"slot {ptr - SLOT_BASE}"


def races(lines: Iterable[str]) -> list[Race]:
    """Every unsynchronized access pair the sanitizer finds in a trace."""
    return SanitizerOracle().replay(lines)

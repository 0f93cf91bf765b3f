"""The CUDA backend: the table's steps as stream and event operations.

The only module of rowcache that touches ``torch.cuda``. It is thin on purpose: every ordering
decision is in the generated schedule (``rowcache/schedules/_generated.py``, from
``spec/table.toml``), which the model checks; this module maps one step kind to one CUDA
operation and nothing else:

* ``record_event`` / ``wait_event``: one ``torch.cuda.Event`` per event name of the table
  (``release``, ``ready``), created once and re-recorded by every call, exactly where the
  table records it. ``stream.wait_event`` captures the snapshot at the time of the call;
  PyTorch skips a wait on an event never recorded.
* ``copy_rows``: on the copy stream, every row of every present source tensor of every miss
  (every present tensor: scales and biases too), from the pinned sources into the slot rows. Two
  paths, chosen at construction (``CudaBackend(device, copy=...)``):

  - ``"batched"`` (default): ONE ``cudaMemcpyBatchAsync`` per call, whatever the number of
    misses and tensors, with addresses computed from base pointers and row strides fixed at
    ``bind`` (``rowcache.backends.batched_copy``). Its entries are one per tensor per miss, or
    one per miss when the provider's slots are packed (``layout="packed"``). Needs NVIDIA's
    ``cuda-bindings`` and a CUDA 12.8+ driver; without them the constructor raises
    ``BatchedCopyUnavailable`` (no silent fallback). The call is invalid on the legacy
    default stream, so a copy issued there (only a mutated schedule would) takes the
    per-tensor path. The stream sanitizer
    (``torch.cuda._sanitizer``) sees only aten operations; while it is enabled, each batched
    call is reported to it as a write of every destination row on the issuing stream, which
    is what the per-tensor ``copy_`` calls report (through the sanitizer's private handler:
    ``rowcache.torch_seams`` lists it with every other private torch name this module uses).
  - ``"per_tensor"``: one non-blocking ``copy_`` per tensor per miss (the earlier design; the
    benchmark's ``row_pt`` variant).

  No per-element device writes on either path. Sources held as bf16 planes
  (``ExpertSources(compress=True)``) are decoded into their slots in the same step, on the same
  stream (the decodes enqueued first, then the copies): one Triton launch a miss and source
  (``SlotDecoder.decode_one``), reading the planes in pinned host memory through unified
  addressing, the expert and slot passed as the launch's scalars (no miss list in memory, so no
  staging buffer the table would have to order).
* ``write_staging`` / ``upload_map`` / ``release_staging``: each map (``resident``,
  ``forward``) has a ring of pinned int32 staging buffers, each with a reuse event. The host
  writes the map (a ``Sequence[int]`` or an int32 CPU tensor) into a buffer whose reuse event
  has completed (``event.query()``, never blocking; a buffer never used counts as free) and
  appends a fresh pinned buffer when none is free; the upload is one non-blocking copy of the
  whole map; the reuse event is recorded on the upload's stream right after it. These are the
  hit path's only calls, so each is as cheap as it can be: the host write of a map tensor is a
  ``memmove`` into the pinned buffer, and with ``copy="batched"`` the upload is one
  ``cudaMemcpyAsync`` through the same bindings (reported to the stream sanitizer like the
  batched copies); with ``copy="per_tensor"`` it is a tensor ``copy_``, under a stream context
  only when the upload's stream is not already current (entering one costs host microseconds).
* ``host_sync``: ``stream.synchronize()`` (or the device's, for ``all``). The real table has
  none on the provider's path.

Call log (for conformance tests): ``CudaBackend(device, call_log=[])`` appends one ``CudaCall``
per stream, event, copy and staging call it makes, with the handle of the stream the call was
really issued on (read back from ``torch.cuda.current_stream`` for per-tensor copies and
uploads; for a batched copy, the handle passed to ``cudaMemcpyBatchAsync``). A batched call is
logged as one ``copy`` entry per tensor per miss, in the order the per-tensor path issues them,
so the log has the same form on both paths. ``tests/cuda`` renders the log in the model's
trace format and checks it against the table (``model_check.streams.queues``,
``model_check.streams.hb``).
Off by default: each step then costs one ``is None`` test more, nothing else.

Copy timing (benchmarks): ``backend.copy_timing = CopyTiming()`` records a pair of timing events
on the copy call's stream immediately around each ``copy_rows`` API call(s), with the bytes it
copies. Off by default (``None``): one ``is None`` test per ``copy_rows``.

Importing this module needs no GPU (nothing touches ``torch.cuda`` until a backend is built).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from rowcache.backends.base import RINGS
from rowcache.backends.batched_copy import (
    BatchedCopier,
    BatchedCopyUnavailable,
    RowLayout,
    load_runtime,
)
from rowcache.device_plan.kernels import GATHER_PROGRAMS_PER_SM
from rowcache.sources import SOURCE_NAMES, ExpertSources, SlotBuffers, planes_and_slots
from rowcache.torch_seams import (
    RAW_CURRENT_STREAM,
    SANITIZER,
    SANITIZER_ENABLED,
    SANITIZER_ERRORS,
    SANITIZER_KERNEL_LAUNCH,
    lookup,
)

__all__ = ["COPY_PATHS", "BatchedCopyUnavailable", "CopyTiming", "CudaBackend", "CudaCall"]

EVENTS = ("release", "ready")
HOST = -1
"""``CudaCall.stream`` of a call that enqueues nothing (a host write, a device-wide sync)."""

CopyPath = Literal["batched", "per_tensor"]
COPY_PATHS: tuple[CopyPath, ...] = ("batched", "per_tensor")


class CudaCall(NamedTuple):
    """One call the CUDA backend made, as its call log records it.

    ``kind`` is one of:
      ``record``  ``event.record(stream)`` of the event ``name`` (``release``, ``ready``)
      ``wait``    ``stream.wait_event(event)`` of the event ``name``
      ``copy``    one non-blocking host-to-device copy of source tensor ``name`` (one of
                  ``rowcache.sources.SOURCE_NAMES``), rows of ``expert`` into ``slot``
      ``stage``   host write of staging buffer ``buffer`` of ring ``name`` (``ring_size``
                  buffers after the choice: a fresh buffer is the last one)
      ``upload``  non-blocking copy of staging buffer ``buffer`` into ring ``name``'s map
      ``reuse``   the reuse event of staging buffer ``buffer`` of ring ``name`` recorded
      ``sync``    host synchronization (``name`` is the table's role, ``all`` for the device)
    ``stream`` is the ``cuda_stream`` handle of the stream the call was issued on, ``HOST``
    (-1) for host writes and device-wide synchronization.
    """

    kind: str
    stream: int
    name: str
    expert: int = -1
    slot: int = -1
    buffer: int = -1
    ring_size: int = 0


class _Ring:
    """Pinned staging buffers of one map, each paired with the event that orders its reuse."""

    __slots__ = ("buffers", "chosen", "events", "pointers", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: list[Tensor] = []
        self.pointers: list[int] = []  # data_ptr() of each buffer, read once
        self.events: list[torch.cuda.Event] = []
        self.chosen = -1

    def choose(self) -> Tensor:
        for index, event in enumerate(self.events):
            # True once the upload that last read the buffer ran (or when never recorded).
            if event.query():  # type: ignore[no-untyped-call]
                self.chosen = index
                return self.buffers[index]
        self.buffers.append(torch.empty(self.size, dtype=torch.int32, pin_memory=True))
        self.pointers.append(self.buffers[-1].data_ptr())
        self.events.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
        self.chosen = len(self.buffers) - 1
        return self.buffers[-1]


class CopyTiming:
    """Timing events around each ``copy_rows`` call of a backend (see the module docstring).

    ``records`` holds ``(start, end, bytes)`` per call, in call order; ``take()`` returns and
    forgets them as ``(seconds, bytes)``, synchronizing on each end event first.
    """

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def take(self) -> list[tuple[float, int]]:
        out = []
        for start, end, num_bytes in self.records:
            end.synchronize()
            out.append((start.elapsed_time(end) / 1e3, num_bytes))
        self.records.clear()
        return out


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _sanitizer_write(
    handle: int,
    addresses: Callable[[], Sequence[int]],
    what: str = "rowcache cudaMemcpyBatchAsync (slot rows)",
    kind: str = "slot row",
) -> None:
    """Tell PyTorch's stream sanitizer, when it is enabled, that the stream ``handle`` wrote
    the rows at ``addresses()`` (computed only then): it only sees aten operations, and a
    batched copy is none.

    Reported exactly as its dispatch mode reports a ``copy_`` into a slot row (a write of the
    destination's data pointer; CPU sources are not tracked), errors printed and raised as it
    does. The module is looked up, not imported: importing it switches on PyTorch's GPU trace.
    Its private names are rows of ``rowcache.torch_seams``, checked in CI against torch.
    """
    csan: Any = sys.modules.get(SANITIZER)
    if csan is None or not lookup(SANITIZER_ENABLED, csan):
        return
    written = set(addresses())
    errors = lookup(SANITIZER_KERNEL_LAUNCH, csan)(
        handle,
        set(),
        written,
        set(),
        what,
        {address: [kind] for address in written},
    )
    if errors:
        for error in errors:
            print(error, file=sys.stderr)
        raise lookup(SANITIZER_ERRORS, csan)(errors)


DECODE_PROGRAMS_PER_SM = GATHER_PROGRAMS_PER_SM
"""Programs an SM of a miss's decode, at most (cut to the expert's blocks): the device
planner's launch."""


class CudaBackend:
    """Stream/event implementation of the table's steps on one CUDA device.

    ``copy`` chooses the miss path (module docstring): ``"batched"`` (default, one
    ``cudaMemcpyBatchAsync`` per ``copy_rows``; raises ``BatchedCopyUnavailable`` here when
    ``cuda-bindings`` or the driver lacks it) or ``"per_tensor"`` (one ``copy_`` per tensor per
    miss).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        call_log: list[CudaCall] | None = None,
        copy: CopyPath = "batched",
    ) -> None:
        if copy not in COPY_PATHS:
            raise ValueError(f"CudaBackend: copy must be one of {COPY_PATHS}, got {copy!r}")
        target = torch.device(device)
        if target.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {target}")
        # Checked before any CUDA work, so that a missing dependency is the error one sees.
        self._runtime: Any = load_runtime() if copy == "batched" else None
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        self._device = target
        self._copy_path: CopyPath = copy
        self._copy_stream = torch.cuda.Stream(device=target)  # type: ignore[no-untyped-call]
        self._events = {
            name: torch.cuda.Event()  # type: ignore[no-untyped-call]
            for name in EVENTS
        }
        self._pairs: list[tuple[Tensor, Tensor, str]] = []
        self._decoders: list[tuple[Tensor, Any]] = []
        """(slot buffer, ``SlotDecoder``) of each source held as bf16 planes."""
        self._logged: list[tuple[str, bool]] = []
        """Each present source in ``SOURCE_NAMES`` order, and whether a miss decodes it: the
        call log's copies of a miss, one a source, each on the stream it really went to."""
        self._batched: BatchedCopier | None = None
        self._expert_bytes = 0
        self._maps: dict[str, Tensor] = {}
        self._map_pointers: dict[str, int] = {}  # data_ptr() of each device map, read once
        self._rings: dict[str, _Ring] = {}
        self._log = call_log
        # The current-stream lookup by raw handle (what inductor's generated code calls):
        # building a ``torch.cuda.Stream`` costs several microseconds on every prepare, so the
        # object is rebuilt only when the handle changes. Equal handles are the same CUDA
        # stream. Private (``rowcache.torch_seams.RAW_CURRENT_STREAM``); absent from builds
        # without CUDA, where no CudaBackend runs, and if torch drops it (then: the slow path).
        self._raw_current_stream: Any = lookup(RAW_CURRENT_STREAM)
        self._device_index: int = target.index if target.index is not None else 0
        self._last_stream: torch.cuda.Stream | None = None
        self._last_handle = -1
        self.copy_timing: CopyTiming | None = None
        """Set to a ``CopyTiming`` to time every ``copy_rows`` (benchmarks); None: off."""

    def bind(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        self._pairs = [
            (buf, src, name)
            for buf, src, name in zip(slots.tensors(), sources.copied(), SOURCE_NAMES, strict=True)
            if buf is not None and src is not None
        ]
        self._decoders = []
        codebooks: list[Tensor] = []
        if sources.planes:
            # Triton only where a source is held as planes.
            from rowcache.compress.triton_decode import SlotDecoder

            sms = torch.cuda.get_device_properties(self._device).multi_processor_count
            for planes, target in planes_and_slots(sources, slots):
                # The 16-byte codebook on the device (every value reads it); the planes stay in
                # pinned host memory, read through unified addressing.
                codebooks.append(planes.codebook.to(self._device))
                decoder = SlotDecoder(
                    planes, target, grid=sms * DECODE_PROGRAMS_PER_SM, codebook=codebooks[-1]
                )
                self._decoders.append((target, decoder))
        decoded = set(sources.planes)
        present = {name for _, _, name in self._pairs} | decoded
        self._logged = [(n, n in decoded) for n in SOURCE_NAMES if n in present]
        layout = RowLayout(self._pairs)
        self._expert_bytes = layout.expert_bytes + sum(
            buf[0].numel() * buf.element_size() for buf, _ in self._decoders
        )
        if self._runtime is not None:
            self._batched = BatchedCopier(self._runtime, layout, self._device)
        num_experts = sources.num_experts
        self._maps = {
            ring: torch.full((num_experts,), -1, dtype=torch.int32, device=self._device)
            for ring in RINGS
        }
        self._map_pointers = {ring: m.data_ptr() for ring, m in self._maps.items()}
        self._rings = {ring: _Ring(num_experts) for ring in RINGS}
        # Slot buffers and the resident map are written on the copy stream, the codebooks read
        # there: tell the caching allocator, so that their memory is not handed out again while
        # that stream may still use it (only matters once the provider is gone).
        for buf in (*slots.tensors(), self._maps["resident"], *codebooks):
            if buf is not None:
                buf.record_stream(self._copy_stream)
        # One-time setup, not a provider call: the allocations and the maps' -1 fill were
        # enqueued on the current stream; later work runs on the copy stream and on whatever
        # stream the first prepare is made on, so let that setup finish here.
        torch.cuda.current_stream(self._device).synchronize()

    @property
    def copy_path(self) -> CopyPath:
        """``"batched"`` or ``"per_tensor"``: how ``copy_rows`` copies (see the class)."""
        return self._copy_path

    @property
    def ranges_per_miss(self) -> int:
        """Copies (batch entries) one miss costs: 1 when the slots are packed and the copy is
        batched (``rowcache.packing``), else one per source tensor with non-empty rows."""
        if self._batched is not None:
            return 1 if self._batched.layout.merged else len(self._batched.layout.names)
        return len(self._pairs)

    @property
    def forward_map(self) -> Tensor:
        return self._maps["forward"]

    @property
    def resident_map(self) -> Tensor:
        return self._maps["resident"]

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._copy_stream

    @property
    def call_log(self) -> list[CudaCall] | None:
        """The list the backend appends a ``CudaCall`` to for every call (None: not logging)."""
        return self._log

    def current_stream(self) -> torch.cuda.Stream:
        raw = self._raw_current_stream
        if raw is None:
            return torch.cuda.current_stream(self._device)
        handle: int = raw(self._device_index)
        stream = self._last_stream
        if stream is None or handle != self._last_handle:
            stream = torch.cuda.current_stream(self._device)
            self._last_stream = stream
            self._last_handle = stream.cuda_stream
        return stream

    def record_event(self, stream: torch.cuda.Stream, event: str) -> None:
        self._events[event].record(stream)
        if self._log is not None:
            self._log.append(CudaCall("record", stream.cuda_stream, event))

    def wait_event(self, stream: torch.cuda.Stream, event: str) -> None:
        stream.wait_event(self._events[event])
        if self._log is not None:
            self._log.append(CudaCall("wait", stream.cuda_stream, event))

    def wait_flag(self, stream: torch.cuda.Stream, event: str) -> None:
        raise NotImplementedError(
            "wait_flag (a device-side wait on an event's latest snapshot) exists only in the "
            "model and the recording backend; the CUDA backend implements wait_event"
        )

    def copy_rows(self, stream: torch.cuda.Stream, copies: Sequence[tuple[int, int]]) -> None:
        timing = self.copy_timing
        if timing is None:
            issued, decoded = self._copy(stream, copies)
        else:
            start = _timing_event()
            start.record(stream)
            issued, decoded = self._copy(stream, copies)
            end = _timing_event()
            end.record(stream)
            timing.records.append((start, end, len(copies) * self._expert_bytes))
        log = self._log
        if log is not None:
            for expert, slot in copies:
                for name, by_decode in self._logged:
                    went = decoded if by_decode else issued
                    log.append(CudaCall("copy", went, name, expert, slot))

    def _copy(
        self, stream: torch.cuda.Stream, copies: Sequence[tuple[int, int]]
    ) -> tuple[int, int]:
        """Enqueue the decodes of the sources held as planes, then the rows of the others, of
        ``copies`` on ``stream``; returns the handles the copies and the decodes went to."""
        decoded = self._decode(stream, copies) if self._decoders else -1
        batched = self._batched
        handle: int = stream.cuda_stream
        # cudaMemcpyBatchAsync rejects the legacy default stream (handle 0).
        if batched is not None and handle != 0:
            batched.copy(handle, copies)
            # Every tensor's row, also when a packed layout copies each miss as one range.
            _sanitizer_write(handle, lambda: batched.layout.row_addresses(copies))
            return handle, decoded
        pairs = self._pairs
        if torch.cuda.current_stream(self._device).cuda_stream == handle:
            for expert, slot in copies:
                for buf, src, _ in pairs:
                    buf[slot].copy_(src[expert], non_blocking=True)
            return handle, decoded
        with torch.cuda.stream(stream):
            for expert, slot in copies:
                for buf, src, _ in pairs:
                    buf[slot].copy_(src[expert], non_blocking=True)
            issued: int = torch.cuda.current_stream(self._device).cuda_stream
        return issued, decoded

    def _decode(self, stream: torch.cuda.Stream, copies: Sequence[tuple[int, int]]) -> int:
        """One decode launch a miss and planes source, on ``stream`` (Triton launches on the
        current stream: entered here when it is another), the miss given as the launch's
        scalars: nothing of the host's is read later but the planes, which never change, so no
        staging buffer is needed. Returns the handle the launches went to."""
        # The current device's stream: Triton launches on the current device, whichever it is.
        if torch.cuda.current_stream().cuda_stream != stream.cuda_stream:
            with torch.cuda.stream(stream):
                return self._decode(stream, copies)
        decoders = self._decoders
        for expert, slot in copies:
            for _, decoder in decoders:
                decoder.decode_one(expert, slot)
        issued: int = torch.cuda.current_stream().cuda_stream
        _sanitizer_write(
            issued,
            lambda: [buf[slot].data_ptr() for buf, _ in decoders for _, slot in copies],
            "rowcache decode of bf16 planes (slot rows)",
        )
        return issued

    def write_staging(self, ring: str, content: Sequence[int] | Tensor) -> None:
        """``content``: the map as a sequence of ints or an int32 CPU tensor ``[E]`` (copied
        here: the caller may rewrite it once this returns)."""
        staging = self._rings[ring]
        buffer = staging.choose()
        if (
            isinstance(content, Tensor)
            and content.dtype == torch.int32
            and content.is_cpu
            and content.is_contiguous()
            and content.numel() == staging.size
        ):
            # A plain host memcpy: a few hundred bytes, where a tensor copy_ costs microseconds
            # of dispatch on the hit path. The buffer is free (its last upload has run).
            ctypes.memmove(staging.pointers[staging.chosen], content.data_ptr(), 4 * staging.size)
        elif isinstance(content, Tensor):
            buffer.copy_(content)
        else:
            buffer.copy_(torch.tensor(content, dtype=torch.int32))
        if self._log is not None:
            self._log.append(
                CudaCall("stage", HOST, ring, buffer=staging.chosen, ring_size=len(staging.buffers))
            )

    def upload_map(self, stream: torch.cuda.Stream, ring: str) -> None:
        staging = self._rings[ring]
        device_map = self._maps[ring]
        batched = self._batched
        if batched is not None:
            # One cudaMemcpyAsync through the bindings the batched miss path already holds:
            # the hit path's only device work, without a tensor copy_'s dispatch. Unlike the
            # batched call it is valid on every stream, the legacy default stream included.
            handle: int = stream.cuda_stream
            destination = self._map_pointers[ring]
            batched.upload(handle, destination, staging.pointers[staging.chosen], 4 * staging.size)
            _sanitizer_write(handle, lambda: [destination], f"rowcache {ring} map upload", "map")
            if self._log is not None:
                self._log.append(CudaCall("upload", handle, ring, buffer=staging.chosen))
            return
        source = staging.buffers[staging.chosen]
        if torch.cuda.current_stream(self._device).cuda_stream == stream.cuda_stream:
            device_map.copy_(source, non_blocking=True)
            if self._log is not None:
                issued = torch.cuda.current_stream(self._device).cuda_stream
                self._log.append(CudaCall("upload", issued, ring, buffer=staging.chosen))
            return
        with torch.cuda.stream(stream):
            device_map.copy_(source, non_blocking=True)
            if self._log is not None:
                issued = torch.cuda.current_stream(self._device).cuda_stream
                self._log.append(CudaCall("upload", issued, ring, buffer=staging.chosen))

    def release_staging(self, stream: torch.cuda.Stream, ring: str) -> None:
        staging = self._rings[ring]
        staging.events[staging.chosen].record(stream)
        if self._log is not None:
            self._log.append(CudaCall("reuse", stream.cuda_stream, ring, buffer=staging.chosen))

    def host_sync(self, stream: torch.cuda.Stream | None, role: str) -> None:
        if stream is None:
            torch.cuda.synchronize(self._device)
        else:
            stream.synchronize()
        if self._log is not None:
            self._log.append(CudaCall("sync", HOST if stream is None else stream.cuda_stream, role))

    def staging_buffers(self) -> dict[str, int]:
        """How many pinned staging buffers each ring holds (for stats and tests)."""
        return {ring: len(r.buffers) for ring, r in self._rings.items()}

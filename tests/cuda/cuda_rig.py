"""The hypothesis machine's device on a GPU: the real CUDA provider on three consumer streams.

``CudaRig`` is the ``host_call_machine.Rig`` of ``tests/cuda/test_cuda_machine.py`` and the
machine's mutant kills in ``tests/cuda/test_gpu_mutants.py``:

* every example gets a fresh provider on the shared expert data (``ExpertData``, small shapes)
  with a ``CudaBackend`` call log, rendered in the model's trace format after every call
  (``trace_check.render``: stream handles become model numbers, the copy stream ``STREAMS``);
* a provider call is issued on its consumer stream behind ``busy`` ms of unrelated GPU work
  there (``torch.cuda._sleep``, calibrated once);
* a read spins ``delay`` ms on the consumer stream and then snapshots the six slot buffers and
  both maps slot by slot (``eager_read``), with what it must see (``expectation``);
* at a synchronization, ``torch.cuda.synchronize()``, then every read's snapshot is checked
  byte for byte against its experts and the maps of its time, and the idle device's resident
  map and mapped slots against the host mirror (``idle_mismatches``).

Nothing touches CUDA before the first ``provider`` call, so CPU CI can import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cuda_support import (
    DATA_SOURCES,
    SMALL,
    ExpertData,
    Launched,
    check_distinct,
    consumer_streams,
    cycles_for_ms,
    eager_read,
    expectation,
    gpu_sleep,
    idle_mismatches,
)
from host_call_machine import DELAYS_MS, STREAMS, E
from trace_check import pairs_text, render

from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import CudaBackend, CudaCall

_SHARED: dict[str, object] = {}


def shared() -> tuple[ExpertData, list[torch.cuda.Stream], dict[float, int]]:
    """The expert data, consumer streams and sleep calibration, made once per process."""
    if not _SHARED:
        _SHARED["data"] = ExpertData(E, SMALL, seed=2)
        _SHARED["streams"] = consumer_streams(STREAMS)
        _SHARED["cycles"] = {ms: cycles_for_ms(ms) for ms in DELAYS_MS}
    data, streams, cycles = _SHARED["data"], _SHARED["streams"], _SHARED["cycles"]
    assert isinstance(data, ExpertData) and isinstance(streams, list)
    assert isinstance(cycles, dict)
    return data, streams, cycles


class CudaRig:
    """The real CUDA provider, traced through its backend's call log. ``compress``: w13 and
    w2 held as bf16 planes (the copy step decodes them, each decode logged on the stream its
    launch really went to)."""

    def __init__(self, compress: bool = False) -> None:
        self.compress = compress
        self.log: list[CudaCall] = []
        self.index: dict[int, int] = {}
        self.mark = 0
        self.reads: list[Launched] = []

    def provider(self, capacity: int) -> RowCacheWeightProvider:
        self.data, self.streams, self.cycles = shared()
        self.log = []
        backend = CudaBackend("cuda", call_log=self.log)
        p = self.data.provider(capacity, backend, compress=self.compress)
        copy = p.backend.copy_stream
        assert isinstance(copy, torch.cuda.Stream)
        check_distinct(self.streams, copy)
        self.index = {s.cuda_stream: i for i, s in enumerate(self.streams)}
        self.index[copy.cuda_stream] = STREAMS
        self.mark = 0
        self.reads = []
        return p

    def take(self) -> list[str]:
        """The calls logged since the last take, in the model's trace format."""
        lines = render(self.log[self.mark :], self.index, DATA_SOURCES)
        self.mark = len(self.log)
        return lines

    def call(self, stream: int, busy_ms: float, call: Callable[[], object]) -> list[str]:
        with torch.cuda.stream(self.streams[stream]):
            if busy_ms:
                gpu_sleep(self.cycles[busy_ms])  # unrelated work ahead of the call
            call()
        return self.take()

    def stream_number(self, stream: Any) -> int:
        return self.index[stream.cuda_stream]

    def read(self, p: RowCacheWeightProvider, stream: int, delay_ms: float) -> list[str]:
        """A consumer read on ``stream``: spin ``delay_ms``, then snapshot."""
        launched = expectation(p, f"read {len(self.reads)} (after {delay_ms} ms)", [])
        with torch.cuda.stream(self.streams[stream]):
            launched.snapshot = eager_read(p, self.cycles[delay_ms])
        self.reads.append(launched)
        return [*self.take(), f"read {pairs_text(launched.pairs)} on {stream}"]

    def synchronize(self) -> list[str]:
        torch.cuda.synchronize()
        return [*self.take(), "host_sync all"]

    def mismatches(self, p: RowCacheWeightProvider) -> list[str]:
        wrong = [line for r in self.reads for line in r.mismatches(self.data)]
        wrong += idle_mismatches("idle", p, self.data)
        self.reads = []
        return wrong

    def settle(self) -> None:
        torch.cuda.synchronize()
        self.reads = []

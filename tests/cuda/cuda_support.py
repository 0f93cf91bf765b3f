"""Shared pieces of the GPU conformance suite: expert data, streams, readers, byte checks.

Nothing here touches CUDA at import time, so CPU CI can collect the suite and skip it.

* ``ExpertData``: six per-expert source tensors (bf16 weights, fp8 block scales, distinct fp32
  global scales), pinned once, with a device copy of every expert for byte comparisons.
* ``consumer_streams``: consumer streams from the high-priority pool, so that they never
  coincide with a provider's copy stream (``torch.cuda.Stream()`` hands out pooled streams
  round-robin; the copy stream comes from the default-priority pool).
* ``cycles_for_ms``: ``torch.cuda._sleep`` cycles for a wanted GPU time, calibrated once.
* ``GraphReader``: the consumer, captured once as a CUDA graph: spin a fixed GPU time, then
  copy every slot buffer and both maps into its own output buffers. Replayed on the current
  stream (the owner), it reads the real slot tensors at their fixed addresses, like a captured
  MoE kernel does.
* ``eager_read``: the same snapshot with eager ops, one per slot (the stream sanitizer tracks
  a view by its start address, so per-slot reads are what it can check).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import CudaBackend, CudaCall
from rowcache.packing import Layout
from rowcache.sources import SOURCE_NAMES
from rowcache.torch_seams import SANITIZER_ENABLED, lookup

FP8 = torch.float8_e4m3fn
NO_CUDA_REASON = (
    "tests/cuda needs a CUDA device (torch.cuda.is_available() is False); "
    "run tools/run_cuda_conformance.sh on a GPU machine"
)


# ---------------------------------------------------------------- expert data


@dataclass(frozen=True)
class Shapes:
    w13: tuple[int, ...]
    w2: tuple[int, ...]
    w13_scale: tuple[int, ...]
    w2_scale: tuple[int, ...]


BIG = Shapes(w13=(2048, 2048), w2=(1024, 512), w13_scale=(16, 16), w2_scale=(8, 4))
"""Race fixtures: 8 MiB of bf16 w13 per expert, so that a slot fill takes ~150 us on PCIe."""
SMALL = Shapes(w13=(8, 64), w2=(64, 4), w13_scale=(4, 2), w2_scale=(2, 2))
"""The hypothesis machine: many short examples."""


DATA_SOURCES = ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
"""The sources ``ExpertData`` holds and its providers copy, in ``SOURCE_NAMES`` order: every
source but the per-expert biases (MXFP4's), which the lockstep's geometries cover. A miss copies
exactly these, so a call log's copy groups and a reader's snapshot follow this list."""
assert tuple(n for n in SOURCE_NAMES if n in DATA_SOURCES) == DATA_SOURCES


class ExpertData:
    """Per-expert sources (``DATA_SOURCES``), every expert's bytes distinct from every other's."""

    def __init__(self, num_experts: int, shapes: Shapes, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        e = num_experts
        ids = torch.arange(e, dtype=torch.float32)

        def block_scales(shape: tuple[int, ...]) -> Tensor:
            t = torch.rand((e, *shape), generator=g) * 4 + 0.0625
            t.view(e, -1)[:, 0] = (ids + 1) / 4  # a marker: distinct per expert
            return t.to(FP8)

        host = {
            "w13": torch.randn((e, *shapes.w13), generator=g).to(torch.bfloat16),
            "w2": torch.randn((e, *shapes.w2), generator=g).to(torch.bfloat16),
            "w13_scale": block_scales(shapes.w13_scale),
            "w2_scale": block_scales(shapes.w2_scale),
            "w13_scale_2": ids * 3 + 0.125,
            "w2_scale_2": ids * 7 + 0.25,
        }
        assert tuple(host) == DATA_SOURCES
        for name, t in host.items():
            rows = t.reshape(e, -1).view(torch.uint8)
            assert len({bytes(r.numpy().tobytes()) for r in rows}) == e, f"{name}: experts collide"
        self.num_experts = e
        self.host = {name: t.pin_memory() for name, t in host.items()}
        self.device = {name: t.to("cuda") for name, t in self.host.items()}
        torch.cuda.synchronize()

    def provider(
        self,
        capacity: int,
        backend: CudaBackend | None = None,
        layout: Layout = "separate",
        compress: bool = False,
    ) -> RowCacheWeightProvider:
        """``compress``: w13 and w2 held as bf16 planes, decoded in the copy step."""
        h = self.host
        return RowCacheWeightProvider(
            h["w13"],
            h["w2"],
            h["w13_scale"],
            h["w2_scale"],
            capacity=capacity,
            device="cuda",
            w13_scale_2=h["w13_scale_2"],
            w2_scale_2=h["w2_scale_2"],
            backend=backend,
            layout=layout,
            compress=compress,
        )

    def holder(self, name: str, row: Tensor) -> str:
        """Which expert's bytes ``row`` holds (for messages)."""
        got = raw(row)
        for expert in range(self.num_experts):
            if torch.equal(got, raw(self.device[name][expert])):
                return f"expert {expert}'s bytes"
        return "no expert's bytes (a torn or missing write)"

    def mismatches(
        self, label: str, snapshot: Sequence[Tensor], pairs: Sequence[tuple[int, int]]
    ) -> list[str]:
        """Every (tensor, slot) of ``pairs`` whose bytes in ``snapshot`` are not its expert's.

        Reads on the current stream, then synchronizes the device: these are host-side checks,
        and the stream sanitizer must see them ordered before any later provider call."""
        out = []
        if pairs:
            experts = torch.tensor([e for e, _ in pairs], device="cuda")
            slots = torch.tensor([s for _, s in pairs], device="cuda")
        # The snapshot's slot tensors come first (a reader's holds its maps after them).
        for name, tensor in zip(DATA_SOURCES, snapshot[: len(DATA_SOURCES)], strict=True):
            if not pairs:
                break
            got, want = tensor.index_select(0, slots), self.device[name].index_select(0, experts)
            if torch.equal(raw(got), raw(want)):
                continue
            for expert, slot in pairs:
                if not torch.equal(raw(tensor[slot]), raw(self.device[name][expert])):
                    out.append(
                        f"{label}: {name}[slot {slot}] should hold expert {expert}, "
                        f"holds {self.holder(name, tensor[slot])}"
                    )
        torch.cuda.synchronize()
        return out


def raw(t: Tensor) -> Tensor:
    """The bytes of ``t`` (any dtype, 0-dim included) as a flat uint8 tensor."""
    return t.reshape(-1).view(torch.uint8)


def slot_tensors(p: RowCacheWeightProvider) -> list[Tensor]:
    bufs = [p.buf_w13, p.buf_w2, p.buf_w13_scale, p.buf_w2_scale, p.buf_w13_scale_2,
            p.buf_w2_scale_2]  # fmt: skip
    out = []
    for buf in bufs:
        assert buf is not None, "the conformance data has all six tensors"
        out.append(buf)
    return out


def watched(p: RowCacheWeightProvider) -> list[Tensor]:
    """What a reader snapshots: the six slot buffers, the forward map, the resident map."""
    return [*slot_tensors(p), p.backend.forward_map, p.backend.resident_map]


def forward_list(p: RowCacheWeightProvider) -> list[int]:
    forward = [-1] * p.num_experts
    for expert, slot in p.forward_pairs or ():
        forward[expert] = slot
    return forward


def idle_mismatches(label: str, p: RowCacheWeightProvider, data: ExpertData) -> list[str]:
    """Once the device is idle: the device resident map equals the host mirror, and every
    mapped slot holds its expert's bytes in all six tensors."""
    torch.cuda.synchronize()
    out = []
    device_map = p.backend.resident_map.tolist()
    if device_map != list(p.slot_of()):
        out.append(f"{label}: device resident map {device_map} != host mirror {list(p.slot_of())}")
    pairs = sorted(p.resident_experts().items())
    out += data.mismatches(f"{label} (idle slots)", slot_tensors(p), pairs)  # ends synchronized
    return out


# ---------------------------------------------------------------- streams and time


def consumer_streams(count: int) -> list[torch.cuda.Stream]:
    streams = [torch.cuda.Stream(priority=-1) for _ in range(count)]  # type: ignore[no-untyped-call]
    handles = {s.cuda_stream for s in streams}
    assert len(handles) == count, "the high-priority stream pool handed out a stream twice"
    return streams


def check_distinct(streams: Sequence[torch.cuda.Stream], copy: torch.cuda.Stream) -> None:
    handles = [s.cuda_stream for s in streams]
    assert copy.cuda_stream not in handles, "a consumer stream is the provider's copy stream"


_CYCLES_PER_MS: list[float] = []


def cycles_for_ms(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that spin about ``ms`` milliseconds (calibrated once)."""
    if not _CYCLES_PER_MS:
        gpu_sleep(20_000_000)  # let the clocks ramp up first
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        gpu_sleep(100_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(100_000_000 / start.elapsed_time(end))
    return int(ms * _CYCLES_PER_MS[0])


def gpu_sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def sanitizer_enabled() -> bool:
    """PyTorch's stream sanitizer is on (``TORCH_CUDA_SANITIZER`` set at import)."""
    return bool(os.environ.get("TORCH_CUDA_SANITIZER"))


@contextmanager
def sanitizer_paused() -> Iterator[None]:
    """Pause PyTorch's stream sanitizer (when enabled) around a graph capture: the ops seen
    while capturing do not run then, they run at each replay, which it cannot see."""
    if not lookup(SANITIZER_ENABLED):  # never imports the sanitizer (that has a cost)
        yield
        return
    from torch.cuda import _sanitizer as csan

    csan.cuda_sanitizer.disable()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        csan.cuda_sanitizer.enable()  # type: ignore[no-untyped-call]


# ---------------------------------------------------------------- readers


class GraphReader:
    """A consumer captured once: spin ``cycles``, then snapshot every watched tensor."""

    def __init__(self, p: RowCacheWeightProvider, cycles: int) -> None:
        sources = watched(p)
        self.cycles = cycles
        self.outs = [torch.empty_like(t) for t in sources]
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with sanitizer_paused(), torch.cuda.stream(side):
            self.graph.capture_begin()
            try:
                if cycles:
                    gpu_sleep(cycles)
                for out, t in zip(self.outs, sources, strict=True):
                    out.copy_(t)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


def eager_read(p: RowCacheWeightProvider, cycles: int) -> list[Tensor]:
    """Spin, then snapshot the watched tensors slot by slot, on the current stream."""
    if cycles:
        gpu_sleep(cycles)
    snap = [torch.stack([buf[s] for s in range(p.capacity)]) for buf in slot_tensors(p)]
    return [*snap, p.backend.forward_map.clone(), p.backend.resident_map.clone()]


@dataclass
class Launched:
    """A reader enqueued on the owner stream, with what it must see."""

    label: str
    snapshot: list[Tensor]
    pairs: tuple[tuple[int, int], ...]
    forward: list[int]
    resident: list[int]
    start: torch.cuda.Event = field(default_factory=timed_event)
    done: torch.cuda.Event = field(default_factory=timed_event)

    def gpu_ms(self) -> float:
        self.done.synchronize()
        return float(self.start.elapsed_time(self.done))

    def mismatches(self, data: ExpertData) -> list[str]:
        forward, resident = self.snapshot[6].tolist(), self.snapshot[7].tolist()
        out = data.mismatches(self.label, self.snapshot, self.pairs)  # ends synchronized
        if forward != self.forward:
            out.append(f"{self.label}: read forward map {forward}, expected {self.forward}")
        if resident != self.resident:
            out.append(f"{self.label}: read resident map {resident}, expected {self.resident}")
        return out


def expectation(p: RowCacheWeightProvider, label: str, snapshot: list[Tensor]) -> Launched:
    pairs = p.forward_pairs
    assert pairs is not None, "a reader needs an accepted prepare"
    return Launched(label, snapshot, pairs, forward_list(p), list(p.slot_of()))


def perf_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def log_lines(calls: Sequence[CudaCall]) -> list[str]:
    """The raw call log, one call a line (for the logs under the run's output folder)."""
    return [repr(c) for c in calls]

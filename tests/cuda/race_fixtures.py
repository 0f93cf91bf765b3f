"""Race fixtures: provider calls issued while a consumer read of the slots is still running.

Each fixture builds a fresh provider (the real one, or a mutant from ``mutant_provider``), runs
a short scripted scenario and returns a ``Report``: what went wrong (``findings``), and the
host and GPU times seen. A fixture never asserts; the tests decide (the real provider must
produce no finding, every GPU mutant at least one).

The shape of every scenario: a ``GraphReader`` that spins ``SLEEP_MS`` of GPU time and then
snapshots all six slot tensors and both maps is replayed on the owner stream; the provider call
under test is issued right after. When the call returns, the reader must still be running
(else the host blocked on it: a ``host_block`` finding when the call took longer than
``BLOCK_MS``; otherwise the fixture proves nothing and raises ``Inconclusive`` with the times).
Once the device is idle, every reader must have seen exactly the bytes of the experts its
forward map names, in all six tensors, and the forward and resident maps as they were when it
was enqueued (``wrong_read`` / ``wrong_map``); the device resident map must equal the host
mirror and every mapped slot must hold its expert (``wrong_map``).

Streams are named as in vLLM's life cycle: ``profile``, ``capture`` and ``replay``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cuda_support import (
    BIG,
    ExpertData,
    GraphReader,
    Launched,
    check_distinct,
    consumer_streams,
    cycles_for_ms,
    expectation,
    gpu_sleep,
    idle_mismatches,
    perf_ms,
    sanitizer_enabled,
)

from rowcache import RowCacheWeightProvider

E = 8
CAPACITY = 3
# Under the stream sanitizer every op costs a stack walk on the host: give readers more time.
SLOWDOWN = 4.0 if sanitizer_enabled() else 1.0
SLEEP_MS = 100.0 * SLOWDOWN  # a pending reader's GPU time
LONG_SLEEP_MS = 400.0 * SLOWDOWN  # the reader behind every kind of provider call
BLOCK_MS = 20.0 * SLOWDOWN  # a provider call this long while its reader finished: host blocked


class Inconclusive(AssertionError):
    """The reader finished before the provider call returned, and the call was fast: the GPU
    outran the fixture, which then proves nothing."""


@dataclass(frozen=True)
class Finding:
    kind: str  # "wrong_read", "wrong_map", "host_block"
    detail: str


@dataclass
class Report:
    fixture: str
    findings: list[Finding] = field(default_factory=list)
    inconclusive: str = ""  # set (by the mutant tests) when the fixture proved nothing
    calls: list[tuple[str, float]] = field(default_factory=list)  # (call, host ms)
    readers: list[tuple[str, float]] = field(default_factory=list)  # (reader, GPU ms)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def as_json(self) -> dict[str, object]:
        return {
            "fixture": self.fixture,
            "findings": [[f.kind, f.detail] for f in self.findings],
            "inconclusive": self.inconclusive,
            "calls_host_ms": self.calls,
            "readers_gpu_ms": self.readers,
        }


Factory = Callable[[ExpertData, int], RowCacheWeightProvider]

_DATA: list[ExpertData] = []


def race_data() -> ExpertData:
    if not _DATA:
        _DATA.append(ExpertData(E, BIG, seed=1))
    return _DATA[0]


def ids(*experts: int) -> torch.Tensor:
    """topk_ids on the host: a device tensor would cost a device-to-host read in validation."""
    return torch.tensor([list(experts)], dtype=torch.int64)


class Bench:
    """One provider, three consumer streams, readers, and the bookkeeping of one scenario."""

    def __init__(self, name: str, make: Factory, sleeps: dict[str, float]) -> None:
        self.data = race_data()
        self.p = make(self.data, CAPACITY)
        self.report = Report(name)
        self.profile, self.capture, self.replay = consumer_streams(3)
        copy = self.p.backend.copy_stream
        assert isinstance(copy, torch.cuda.Stream)
        self.copy_stream = copy
        check_distinct([self.profile, self.capture, self.replay], copy)
        self.readers = {
            label: GraphReader(self.p, cycles_for_ms(ms)) for label, ms in sleeps.items()
        }
        self.launched: list[Launched] = []
        self.last_prepare: torch.cuda.Stream | None = None
        self.blocked = False
        torch.cuda.synchronize()

    def name(self, stream: torch.cuda.Stream) -> str:
        for label in ("profile", "capture", "replay"):
            if getattr(self, label).cuda_stream == stream.cuda_stream:
                return label
        return f"stream {stream.cuda_stream:#x}"

    def read(self, label: str, stream: torch.cuda.Stream) -> Launched:
        """Replay reader ``label`` on ``stream``, the stream of the last prepare (the consumer
        contract; tracked here, not read from the provider, which a mutant may get wrong)."""
        last = self.last_prepare
        assert last is not None and last.cuda_stream == stream.cuda_stream, (
            "fixture bug: a reader must run on the stream of the last prepare"
        )
        reader = self.readers[label]
        launched = expectation(self.p, label, reader.outs)
        with torch.cuda.stream(stream):
            launched.start.record()
            reader.replay()
            launched.done.record()
        self.launched.append(launched)
        return launched

    def busy(self, stream: torch.cuda.Stream, ms: float) -> Launched:
        """Consumer work on ``stream`` that reads no slot (an unrelated kernel)."""
        launched = Launched(f"busy({self.name(stream)})", [], (), [], [])
        with torch.cuda.stream(stream):
            launched.start.record()
            gpu_sleep(cycles_for_ms(ms))
            launched.done.record()
        return launched

    def prepare(
        self, stream: torch.cuda.Stream, *experts: int, watch: tuple[Launched, ...] = ()
    ) -> None:
        label = f"prepare{experts} on {self.name(stream)}"
        self.call(label, stream, watch, self.p.prepare, ids(*experts))
        self.last_prepare = stream

    def invalidate(
        self, stream: torch.cuda.Stream, expert: int, watch: tuple[Launched, ...] = ()
    ) -> None:
        label = f"invalidate({expert}) on {self.name(stream)}"
        self.call(label, stream, watch, self.p.invalidate, expert)

    def call(
        self,
        label: str,
        stream: torch.cuda.Stream,
        watch: tuple[Launched, ...],
        fn: Callable[..., object],
        *args: object,
    ) -> None:
        for pending in watch:
            if pending.done.query():  # type: ignore[no-untyped-call]
                raise Inconclusive(
                    f"{self.report.fixture}: {pending.label} finished before {label} was made "
                    f"(it took {pending.gpu_ms():.1f} ms of GPU time): the fixture proves nothing"
                )
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            fn(*args)
            host_ms = perf_ms(start)
        self.report.calls.append((label, round(host_ms, 3)))
        for pending in watch:
            if not pending.done.query():  # type: ignore[no-untyped-call]
                continue
            if host_ms > BLOCK_MS or self.blocked:
                self.blocked = True
                self.report.findings.append(
                    Finding(
                        "host_block",
                        f"{label} returned after {host_ms:.1f} ms of host time, once "
                        f"{pending.label} had finished: the host waited for the reader",
                    )
                )
            else:
                raise Inconclusive(
                    f"{self.report.fixture}: {pending.label} finished before {label} returned "
                    f"({host_ms:.2f} ms of host time; the reader took {pending.gpu_ms():.1f} ms "
                    "of GPU time): the fixture proves nothing, make the reader spin longer"
                )

    def finish(self) -> Report:
        torch.cuda.synchronize()
        for launched in self.launched:
            self.report.readers.append((launched.label, round(launched.gpu_ms(), 3)))
            for line in launched.mismatches(self.data):
                kind = "wrong_map" if " map " in line else "wrong_read"
                self.report.findings.append(Finding(kind, f"{self.report.fixture}: {line}"))
        for line in idle_mismatches(f"{self.report.fixture}: once idle", self.p, self.data):
            # P4: the idle device map differs from the mirror, or names a slot that does not
            # hold its expert.
            self.report.findings.append(Finding("wrong_map", line))
        return self.report


# ---------------------------------------------------------------- the fixtures


def eviction_same_stream(make: Factory) -> Report:
    """A prepare on the owner stream evicts two slots an earlier read is still reading."""
    b = Bench("eviction_same_stream", make, {"r1": SLEEP_MS, "r2": 0})
    s = b.profile
    b.prepare(s, 0, 1, 2)
    r1 = b.read("r1", s)
    b.prepare(s, 3, 4, watch=(r1,))  # evicts 0 and 1: slots 0 and 1 are refilled
    b.read("r2", s)
    return b.finish()


def eviction_owner_change(make: Factory) -> Report:
    """The same, with the evicting prepare made on another stream (owner change)."""
    b = Bench("eviction_owner_change", make, {"r1": SLEEP_MS, "r2": 0})
    b.prepare(b.profile, 0, 1, 2)
    r1 = b.read("r1", b.profile)
    b.prepare(b.capture, 3, 4, watch=(r1,))
    b.read("r2", b.capture)
    return b.finish()


def owner_three_streams(make: Factory) -> Report:
    """profile -> capture -> replay -> profile, each prepare evicting slots that the previous
    owner's (and the one before's) still-running reader reads."""
    b = Bench(
        "owner_three_streams", make, {"r1": SLEEP_MS, "r2": SLEEP_MS, "r3": SLEEP_MS, "r4": 0}
    )
    b.prepare(b.profile, 0, 1, 2)
    r1 = b.read("r1", b.profile)
    b.prepare(b.capture, 2, 3, watch=(r1,))  # evicts 0 (slot 0)
    r2 = b.read("r2", b.capture)
    b.prepare(b.replay, 4, 5, watch=(r1, r2))  # evicts 1 and 2 (slots 1, 2)
    r3 = b.read("r3", b.replay)
    b.prepare(b.profile, 0, 4, watch=(r2, r3))  # back on the first stream; evicts 3 (slot 0)
    b.read("r4", b.profile)
    return b.finish()


def invalidate_reuse_from_owner(make: Factory) -> Report:
    """invalidate, then a prepare that refills the freed slot, both on the owner stream,
    while a read of that slot is pending."""
    b = Bench("invalidate_reuse_from_owner", make, {"r1": SLEEP_MS, "r2": 0})
    s = b.profile
    b.prepare(s, 0, 1, 2)
    r1 = b.read("r1", s)
    b.invalidate(s, 1, watch=(r1,))
    b.prepare(s, 5, watch=(r1,))  # 5 takes the freed slot 1
    b.read("r2", s)
    return b.finish()


def invalidate_reuse_from_other_stream(make: Factory) -> Report:
    """The same, with invalidate and prepare made on another stream than the owner."""
    b = Bench("invalidate_reuse_from_other_stream", make, {"r1": SLEEP_MS, "r2": 0})
    b.prepare(b.profile, 0, 1, 2)
    r1 = b.read("r1", b.profile)
    b.invalidate(b.capture, 1, watch=(r1,))
    b.prepare(b.capture, 5, watch=(r1,))
    b.read("r2", b.capture)
    return b.finish()


def invalidate_behind_pending_upload(make: Factory) -> Report:
    """invalidate from another stream while the last prepare's copies and resident-map upload
    still wait for a pending reader."""
    b = Bench("invalidate_behind_pending_upload", make, {"r1": SLEEP_MS, "r2": 0})
    s = b.profile
    b.prepare(s, 0, 1, 2)
    r1 = b.read("r1", s)
    b.prepare(s, 3, watch=(r1,))  # evicts 0; its copy and map upload wait for r1
    r2 = b.read("r2", s)
    b.invalidate(b.capture, 3, watch=(r1, r2))
    return b.finish()


def forward_staging_under_busy_stream(make: Factory) -> Report:
    """Prepares on a stream busy with unrelated work: the forward-map upload waits behind it,
    so its pinned staging buffer must not be rewritten by the next prepare."""
    b = Bench("forward_staging_under_busy_stream", make, {"r2": 0, "r3": 0})
    b.prepare(b.profile, 0, 1)
    torch.cuda.synchronize()  # one forward staging buffer, free
    busy = b.busy(b.capture, SLEEP_MS)
    b.prepare(b.capture, 2, watch=(busy,))  # its forward-map upload waits behind the busy work
    b.read("r2", b.capture)
    # Let the copy stream drain: it does not wait on the busy stream (when a mutant makes it
    # wait, the busy work finishes first and the next call reports the fixture inconclusive).
    drained = torch.cuda.Event()  # type: ignore[no-untyped-call]
    drained.record(b.copy_stream)
    while not drained.query() and not busy.done.query():  # type: ignore[no-untyped-call]
        time.sleep(50e-6)
    b.prepare(b.capture, 3, watch=(busy,))
    b.read("r3", b.capture)
    return b.finish()


def all_hit_handoff_then_eviction(make: Factory) -> Report:
    """An all-hit prepare from another stream (the hit path with a handoff), then a prepare
    there that evicts slots an earlier reader on the old owner still reads: the handoff must
    have put the old owner's reads behind the new owner's release."""
    b = Bench("all_hit_handoff_then_eviction", make, {"r1": SLEEP_MS, "r2": 0, "r3": 0})
    b.prepare(b.profile, 0, 1, 2)
    r1 = b.read("r1", b.profile)
    b.prepare(b.capture, 0, 1, 2, watch=(r1,))  # all hits, owner change
    b.read("r2", b.capture)
    b.prepare(b.capture, 3, 4, watch=(r1,))  # evicts 0 and 1 while r1 reads them
    b.read("r3", b.capture)
    return b.finish()


def all_hit_handoff_sees_copies(make: Factory) -> Report:
    """Copies held back behind busy work on the owner stream, then an all-hit prepare from
    another stream and a read there: the read must wait for those copies."""
    b = Bench("all_hit_handoff_sees_copies", make, {"r1": 0})
    busy = b.busy(b.profile, SLEEP_MS)
    b.prepare(b.profile, 0, 1, 2, watch=(busy,))  # its copies wait behind the busy kernel
    b.prepare(b.capture, 0, 1, 2, watch=(busy,))  # all hits, owner change
    b.read("r1", b.capture)
    return b.finish()


def every_call_behind_a_reader(make: Factory) -> Report:
    """Every kind of provider call, from the owner and from other streams, issued while one
    long reader is pending: none may block the host."""
    b = Bench("every_call_behind_a_reader", make, {"r1": LONG_SLEEP_MS, "r2": 0})
    p, c, r = b.profile, b.capture, b.replay
    b.prepare(p, 0, 1, 2)
    r1 = b.read("r1", p)
    w = (r1,)
    b.prepare(p, 0, 1, watch=w)  # all hits
    b.prepare(p, 2, 3, watch=w)  # a miss evicting 0
    b.invalidate(p, 1, watch=w)  # resident, from the owner
    b.invalidate(p, 7, watch=w)  # not resident
    b.invalidate(c, 2, watch=w)  # resident, from another stream
    b.prepare(c, 4, 5, watch=w)  # owner change, refilling both freed slots
    b.prepare(r, 4, watch=w)  # owner change, all hits
    b.invalidate(p, 5, watch=w)  # from a non-owner stream
    b.prepare(p, 0, 6, watch=w)  # owner change, a freed slot and an eviction
    b.read("r2", p)
    return b.finish()


FIXTURES: dict[str, Callable[[Factory], Report]] = {
    f.__name__: f
    for f in (
        eviction_same_stream,
        eviction_owner_change,
        owner_three_streams,
        invalidate_reuse_from_owner,
        invalidate_reuse_from_other_stream,
        invalidate_behind_pending_upload,
        forward_staging_under_busy_stream,
        all_hit_handoff_then_eviction,
        all_hit_handoff_sees_copies,
        every_call_behind_a_reader,
    )
}


def real_provider(data: ExpertData, capacity: int) -> RowCacheWeightProvider:
    return data.provider(capacity)


def save(name: str, reports: list[Report]) -> None:
    """Write the reports as JSON under $ROWCACHE_CONFORMANCE_LOGS, when set."""
    folder = os.environ.get("ROWCACHE_CONFORMANCE_LOGS")
    if not folder:
        return
    if sanitizer_enabled():
        name += " (sanitizer pass)"
    path = Path(folder) / "fixtures.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for report in reports:
            f.write(json.dumps({"provider": name, **report.as_json()}) + "\n")

"""The hypothesis conformance machine against the real CUDA provider.

Random host calls (prepare, invalidate, consumer reads, device synchronizations) on three
consumer streams, with random GPU delays: a read spins 0 to 3 ms before it snapshots the slots
and maps, and a provider call may be issued behind unrelated work of the same length on its
stream. After every call the machine compares the CUDA backend's call log with the trace the
table prescribes (``trace_check.render`` against the happens-before model, which also checks
every ordering property for all interleavings), and the provider's host state with the model's
(LRU order, slots, forward map, owner, counters). At every synchronization and at the end of
each example: every read saw exactly its forward map's experts in all six tensors and the maps
as they were when it was enqueued, the idle device map equals the host mirror, every mapped
slot holds its expert, and the whole trace replays clean through the stream sanitizer oracle.

``ROWCACHE_CUDA_EXAMPLES`` sets the number of examples (default 200).
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_support import (
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
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sanitizer_oracle import races
from trace_check import ModelReplay, pairs_text, render

from model_check.reference import NO_STREAM, Bounds, Counters
from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import CudaBackend, CudaCall

pytestmark = pytest.mark.cuda

E = 6
STREAMS = 3
EXAMPLES = int(os.environ.get("ROWCACHE_CUDA_EXAMPLES", "200"))
DELAYS_MS = (0.0, 0.005, 0.05, 0.5, 3.0)
ACTIONS = ("prepare",) * 8 + ("read",) * 6 + ("invalidate",) * 3 + ("synchronize",) * 1

SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure prints its steps
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)

_SHARED: dict[str, object] = {}
RUNS = {"examples": 0, "reads": 0, "prepares": 0, "invalidates": 0, "syncs": 0}


def shared() -> tuple[ExpertData, list[torch.cuda.Stream], dict[float, int]]:
    if not _SHARED:
        _SHARED["data"] = ExpertData(E, SMALL, seed=2)
        _SHARED["streams"] = consumer_streams(STREAMS)
        _SHARED["cycles"] = {ms: cycles_for_ms(ms) for ms in DELAYS_MS}
    data, streams, cycles = _SHARED["data"], _SHARED["streams"], _SHARED["cycles"]
    assert isinstance(data, ExpertData) and isinstance(streams, list)
    assert isinstance(cycles, dict)
    return data, streams, cycles


class CudaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p: RowCacheWeightProvider | None = None

    @initialize(capacity=st.integers(1, E))
    def setup(self, capacity: int) -> None:
        self.data, self.streams, self.cycles = shared()
        self.log: list[CudaCall] = []
        self.p = self.data.provider(capacity, CudaBackend("cuda", call_log=self.log))
        copy = self.p.backend.copy_stream
        assert isinstance(copy, torch.cuda.Stream)
        check_distinct(self.streams, copy)
        self.index = {s.cuda_stream: i for i, s in enumerate(self.streams)}
        self.index[copy.cuda_stream] = STREAMS
        self.capacity = capacity
        self.model = ModelReplay(Bounds(E, capacity, STREAMS), explicit=False)
        self.mark = 0
        self.reads: list[Launched] = []
        self.lines: list[str] = []
        RUNS["examples"] += 1

    @property
    def provider(self) -> RowCacheWeightProvider:
        assert self.p is not None
        return self.p

    # -- comparisons ----------------------------------------------------------------

    def compare(self, op: str, args: tuple[object, ...], stream: int) -> None:
        got = render(self.log[self.mark :], self.index)
        self.mark = len(self.log)
        expected = list(self.model.call(op, args, stream))
        assert got == expected, f"{op}{args} on {stream}: GPU log {got}, table {expected}"
        self.lines += got
        self.same_host_state()

    def same_host_state(self) -> None:
        p, host = self.provider, self.model.host
        assert p.lru_order() == host.lru, f"LRU order {p.lru_order()}, model {host.lru}"
        assert p.slot_of() == host.slot_of, f"slots {p.slot_of()}, model {host.slot_of}"
        assert p.forward_pairs == host.forward, f"forward {p.forward_pairs}, model {host.forward}"
        owner = NO_STREAM if p.owner is None else self.index[p.owner.cuda_stream]
        assert owner == host.owner, f"owner {owner}, model {host.owner}"
        stats = p.stats()
        counters = {k: stats[k] for k in Counters._fields}
        assert counters == self.model.counters._asdict(), f"counters {counters}"

    def verify(self) -> None:
        wrong = [line for r in self.reads for line in r.mismatches(self.data)]
        wrong += idle_mismatches("idle", self.provider, self.data)
        assert not wrong, "\n".join(wrong)
        self.reads = []

    # -- one rule, drawing a weighted action (prepare and read most often) ----------------

    @precondition(lambda self: self.p is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        if action == "read" and self.provider.forward_pairs is None:
            action = "prepare"
        if action == "prepare":
            experts = data.draw(
                st.lists(st.integers(0, E - 1), unique=True, min_size=1, max_size=self.capacity),
                label="experts",
            )
            stream = data.draw(st.integers(0, STREAMS - 1), label="stream")
            self.prepare(experts, stream, data.draw(st.sampled_from(DELAYS_MS), label="busy"))
        elif action == "invalidate":
            expert = data.draw(st.integers(0, E - 1), label="expert")
            stream = data.draw(st.integers(0, STREAMS - 1), label="stream")
            self.invalidate(expert, stream, data.draw(st.sampled_from(DELAYS_MS), label="busy"))
        elif action == "read":
            self.read(data.draw(st.sampled_from(DELAYS_MS), label="delay"))
        else:
            self.synchronize()

    def prepare(self, experts: list[int], stream: int, busy: float) -> None:
        with torch.cuda.stream(self.streams[stream]):
            if busy:
                gpu_sleep(self.cycles[busy])  # unrelated work ahead of the call
            self.provider.prepare(torch.tensor([experts]))
        RUNS["prepares"] += 1
        self.compare("prepare", (tuple(sorted(experts)),), stream)

    def invalidate(self, expert: int, stream: int, busy: float) -> None:
        with torch.cuda.stream(self.streams[stream]):
            if busy:
                gpu_sleep(self.cycles[busy])
            self.provider.invalidate(expert)
        RUNS["invalidates"] += 1
        self.compare("invalidate", (expert,), stream)

    def read(self, delay: float) -> None:
        """A consumer read on the owner stream: spin ``delay``, then snapshot."""
        p = self.provider
        owner = p.owner
        assert owner is not None
        stream = self.index[owner.cuda_stream]
        launched = expectation(p, f"read {len(self.reads)} (after {delay} ms)", [])
        with torch.cuda.stream(owner):
            launched.snapshot = eager_read(p, self.cycles[delay])
        self.reads.append(launched)
        RUNS["reads"] += 1
        expected = list(self.model.call("read", (), stream))
        line = f"read {pairs_text(launched.pairs)} on {stream}"
        assert [line] == expected, f"read: {line}, table {expected}"
        self.lines.append(line)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
        RUNS["syncs"] += 1
        assert list(self.model.call("synchronize", (), 0)) == ["host_sync all"]
        self.lines.append("host_sync all")
        self.verify()

    def teardown(self) -> None:
        if self.p is None:
            return
        self.synchronize()
        found = races(self.lines)
        assert not found, "sanitizer oracle: " + "; ".join(map(str, found))


def test_conformance_machine_on_the_real_cuda_provider() -> None:
    before = RUNS["examples"]
    run_state_machine_as_test(CudaMachine, settings=SETTINGS)
    examples = RUNS["examples"] - before
    print(f"{examples} examples; totals {RUNS}")
    assert examples >= EXAMPLES, f"only {examples} examples ran"

"""Trace validation: the CUDA backend's own call log, from a real GPU workload, is the trace the
transition table prescribes for the same host calls, and every interleaving of it satisfies the
properties.

The workload runs on three consumer streams with slow consumer reads pending across provider
calls. For each host call, the call log (``CudaBackend(call_log=...)``, recording the stream
each call was really issued on) is rendered in the model's trace format and compared line by
line with ``model_check.streams.queues.host_call(...).trace``; the same calls are replayed through
the explicit semantics over every interleaving of device steps, and through the
happens-before summary (``model_check.streams.hb.hb_host_call``), with no violation allowed; the
whole trace is also replayed through PyTorch's stream sanitizer (``tests/sanitizer_oracle.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
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
    idle_mismatches,
    log_lines,
)
from mutant_provider import REQUIRED, install, schedule_mutants
from sanitizer_oracle import races
from trace_check import LogError, ModelReplay, pairs_text, render

from model_check.table import load_table
from model_check.table.mutants import mutant
from model_check.table.reference import Bounds
from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import HOST, CudaBackend, CudaCall
from rowcache.sources import SOURCE_NAMES

pytestmark = pytest.mark.cuda

E, CAPACITY, STREAMS = 8, 3, 3
READ_MS = 2.0

# (operation, arguments, stream): reads are made on the owner stream (the consumer contract).
WORKLOAD: list[tuple[str, tuple[object, ...], int]] = [
    ("prepare", ((0, 1, 2),), 0),
    ("read", (), 0),
    ("prepare", ((0, 1, 2),), 1),  # all hits from another stream: the hit path's handoff
    ("read", (), 1),
    ("prepare", ((2, 3),), 1),  # evicts 0 under stream 0's pending read
    ("read", (), 1),
    ("prepare", ((4, 5),), 2),  # a third stream; evicts 1 and 2
    ("read", (), 2),
    ("synchronize", (), 0),
    ("read", (), 2),
    ("invalidate", (4,), 2),  # from the owner, under a pending read of its slot
    ("invalidate", (5,), 0),  # from another stream
    ("prepare", ((6,),), 0),  # refills a freed slot while the read is pending
    ("read", (), 0),
    ("prepare", ((6, 7),), 1),
    ("read", (), 1),
    ("synchronize", (), 0),
    ("invalidate", (0,), 1),  # not resident: no device work
    ("prepare", ((3, 6, 7),), 1),  # all hits
    ("read", (), 1),
    ("prepare", ((0, 1),), 2),
    ("read", (), 2),
    ("invalidate", (0,), 0),
    ("prepare", ((0,),), 0),
    ("read", (), 0),
    ("synchronize", (), 0),
]

REACHED = {
    "eviction",
    "owner_change",
    "invalidate_resident",
    "prepare_all_hits",
    "copy_waits_on_reader",
    "copy_while_slot_read_pending",
    "freed_slot_reused_while_read_pending",
}


class Run:
    def __init__(
        self, data: ExpertData, provider: RowCacheWeightProvider, log: list[CudaCall]
    ) -> None:
        self.data = data
        self.p = provider
        self.log = log
        self.streams = consumer_streams(STREAMS)
        copy = provider.backend.copy_stream
        assert isinstance(copy, torch.cuda.Stream)
        check_distinct(self.streams, copy)
        self.index = {s.cuda_stream: i for i, s in enumerate(self.streams)}
        self.index[copy.cuda_stream] = STREAMS
        self.reads: list[Launched] = []
        self.last_prepare = -1

    def do(self, op: str, args: tuple[object, ...], stream: int) -> list[str]:
        """Make one host call on the GPU; its device calls in the model's trace format."""
        mark = len(self.log)
        s = self.streams[stream]
        consumer: list[str] = []
        with torch.cuda.stream(s):
            if op == "prepare":
                experts = args[0]
                assert isinstance(experts, tuple)
                self.p.prepare(torch.tensor([list(experts)]))
                self.last_prepare = stream
            elif op == "invalidate":
                expert = args[0]
                assert isinstance(expert, int)
                self.p.invalidate(expert)
            elif op == "read":
                assert stream == self.last_prepare, "workload bug: read off the owner stream"
                launched = expectation(self.p, f"read {len(self.reads)}", [])
                launched.snapshot = eager_read(self.p, cycles_for_ms(READ_MS))
                self.reads.append(launched)
                consumer.append(f"read {pairs_text(launched.pairs)} on {stream}")
            elif op == "synchronize":
                torch.cuda.synchronize()
                consumer.append("host_sync all")
            else:
                raise ValueError(op)
        return render(self.log[mark:], self.index, DATA_SOURCES) + consumer


def new_run(mutant: str | None = None) -> Run:
    data = ExpertData(E, SMALL, seed=3)
    log: list[CudaCall] = []
    provider = data.provider(CAPACITY, CudaBackend("cuda", call_log=log))
    if mutant is not None:
        install(provider, mutant)
    return Run(data, provider, log)


def test_gpu_call_log_is_the_tables_trace_and_every_interleaving_is_safe() -> None:
    run = new_run()
    replay = ModelReplay(Bounds(E, CAPACITY, STREAMS))
    lines: list[str] = []
    for op, args, stream in WORKLOAD:
        got = run.do(op, args, stream)
        expected = list(replay.call(op, args, stream))
        assert got == expected, f"{op}{args} on stream {stream}: GPU log {got}, table {expected}"
        lines += got
    data = run.data
    wrong = [line for r in run.reads for line in r.mismatches(data)]
    wrong += idle_mismatches("trace workload", run.p, data)
    assert not wrong, "\n".join(wrong)
    assert not races(lines), races(lines)
    missing = REACHED - replay.tags
    assert not missing, f"the workload never reached {sorted(missing)}: the check is vacuous"
    folder = os.environ.get("ROWCACHE_CONFORMANCE_LOGS")
    if folder:
        path = Path(folder) / "trace_validation.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "# model-format trace of the GPU workload\n"
            + "\n".join(lines)
            + "\n\n# raw CudaBackend call log\n"
            + "\n".join(log_lines(run.log))
            + f"\n\n# largest explicit frontier {replay.max_states}, "
            f"largest happens-before frontier {replay.max_hb}\n",
            encoding="utf-8",
        )
    print(
        f"{len(WORKLOAD)} host calls, {len(run.log)} logged CUDA calls, {len(lines)} trace "
        f"lines; explicit frontier up to {replay.max_states} states, happens-before up to "
        f"{replay.max_hb}; reached {sorted(replay.tags & REACHED)}"
    )


@pytest.mark.parametrize("name", REQUIRED)
def test_trace_validation_rejects_a_mutant_log(name: str) -> None:
    """The same comparison fails on a mutant's log: the check can fail."""
    run = new_run(name)
    replay = ModelReplay(Bounds(E, CAPACITY, STREAMS), explicit=False)
    for op, args, stream in WORKLOAD:
        got = run.do(op, args, stream)
        if got != list(replay.call(op, args, stream)):
            torch.cuda.synchronize()
            return
    pytest.fail(f"mutant {name}'s call log matched the table's trace")


# -- the checking machinery itself (no GPU needed; runs in CPU CI) -----------------------


@pytest.mark.nogpu
def test_model_replay_of_the_workload_is_clean_and_not_vacuous() -> None:
    replay = ModelReplay(Bounds(E, CAPACITY, STREAMS))
    for op, args, stream in WORKLOAD:
        replay.call(op, args, stream)
    assert replay.tags >= REACHED, sorted(REACHED - replay.tags)


@pytest.mark.nogpu
@pytest.mark.parametrize("name", schedule_mutants())
def test_model_replay_of_the_workload_rejects_each_schedule_mutant(name: str) -> None:
    replay = ModelReplay(Bounds(E, CAPACITY, STREAMS), mutant(name).apply(load_table()))
    with pytest.raises(AssertionError, match="violates"):
        for op, args, stream in WORKLOAD:
            replay.call(op, args, stream)


@pytest.mark.nogpu
def test_render_is_the_models_trace_for_a_logged_prepare() -> None:
    current, copy = 0x111, 0x999
    log = [
        CudaCall("record", current, "release"),
        CudaCall("wait", copy, "release"),
        *[CudaCall("copy", copy, name, 1, 0) for name in SOURCE_NAMES],
        CudaCall("stage", HOST, "resident", buffer=0, ring_size=1),
        CudaCall("upload", copy, "resident", buffer=0),
        CudaCall("reuse", copy, "resident", buffer=0),
        CudaCall("record", copy, "ready"),
        CudaCall("wait", current, "ready"),
        CudaCall("stage", HOST, "forward", buffer=0, ring_size=1),
        CudaCall("upload", current, "forward", buffer=0),
        CudaCall("reuse", current, "forward", buffer=0),
    ]
    lines = render(log, {current: 0, copy: 1})
    assert lines == list(ModelReplay(Bounds(2, 1, 1)).call("prepare", ((1,),), 0))
    torn = [c for c in log if c.name != "w2_scale"]
    with pytest.raises(LogError, match="expected one copy of each"):
        render(torn, {current: 0, copy: 1})
    with pytest.raises(LogError, match="does not know"):
        render(log, {current: 0})

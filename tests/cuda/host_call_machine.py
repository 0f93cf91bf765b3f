"""The hypothesis machine of the GPU conformance suite, written once for any device.

One rule per host call, on ``E`` experts and ``STREAMS`` consumer streams:

* ``prepare(experts, stream, busy)``: a prepare of up to ``capacity`` distinct experts on a
  consumer stream, issued behind ``busy`` ms of unrelated work on that stream; the requested
  experts go into the ``prepared`` bundle;
* ``read(delay)``: a consumer read on the stream of the last prepare (the owner: the consumer
  runs its forward where it prepared) that spins ``delay`` ms and then snapshots the slots
  and maps; only once a prepare was accepted (a forward map exists);
* ``invalidate(expert, stream, busy)``: an invalidate of an expert some prepare requested (from
  the ``prepared`` bundle; it may have been evicted since), behind unrelated work;
* ``synchronize()``: the consumer's device-wide host sync; only when a call was made since the
  last one.

After every call the machine compares the device's calls, rendered in the model's trace
format, with the trace the table prescribes (``trace_check.ModelReplay``: the happens-before
summary, which also decides every ordering property for all interleavings) and the provider's
host state with the model's (LRU order, slots, forward map, owner, counters). At every
synchronization and at the end of an example the device's own checks run (every read saw
its experts and the maps of its time; the idle resident map equals the mirror and every
mapped slot holds its expert), and at the end the whole trace replays clean through the stream
sanitizer oracle (``tests/sanitizer_oracle.py``).

What the device is comes from a ``Rig``: ``cuda_rig.CudaRig`` drives the real CUDA provider
(``tests/cuda/test_cuda_machine.py``, ``tests/cuda/test_gpu_mutants.py``); ``RecordingRig``
(below) drives the same rules on ``RecordingBackend`` on the CPU, so that CPU CI runs the
rules, their preconditions and the mutant-kill logic (``tests/test_machine_rules.py``). The
rules draw the same choices whatever the rig (the machine's name, not the rig, seeds the
derandomized search; preconditions and bundles depend only on host state, which both rigs
check against the model), so with the same hypothesis version a run on the CPU generates and
shrinks the examples the same run generates on the GPU, unless a check only the GPU makes
(the bytes of the slots) fails first.

Mutant kills: ``kill(rig, name, examples)`` runs the machine with the provider running mutant
``name``'s generated schedules (``mutant_provider.install``) and the model replaying the same
mutated table, so the device log must still be the (mutated) table's trace and the kill must
come from a property check: the model's verdict over all interleavings, the device's own data
checks, or the sanitizer oracle. With shrinking on, the counterexample is the shrunk example's
host calls; ``judge`` holds it to the counterexample ``python -m model_check explain`` prints
for the model mutant of the same name (``explain_to_compare``, ``mutant_provider``).

Nothing here touches CUDA, so CPU CI imports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from mutant_provider import EXPLAIN_DEPTH, HostCall, explain_calls, install, mutant_table
from sanitizer_oracle import races
from trace_check import TABLE, LogError, ModelReplay

from model_check.table import Table
from model_check.table.reference import NO_STREAM, Bounds, Counters
from rowcache import RowCacheWeightProvider
from rowcache.backends import RecordingBackend

E = 6
STREAMS = 3
DELAYS_MS = (0.0, 0.005, 0.05, 0.5, 3.0)
"""GPU time of a read's spin before its snapshot, and of the unrelated work a provider call is
issued behind (the recording rig draws them too, and ignores them)."""

STREAM_IDS = st.integers(0, STREAMS - 1)
DELAYS = st.sampled_from(DELAYS_MS)


def machine_settings(examples: int, *, shrink: bool, calls: int = 19) -> settings:
    """The machine's settings: derandomized (the same examples on every run), examples of at
    most ``calls`` host calls (hypothesis counts ``setup`` as a step too); shrinking only
    where asked (mutant kills): a failure of the real provider on the GPU prints its steps as
    they ran."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        stateful_step_count=calls + 1,
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


# ---------------------------------------------------------------- what a check found


class Finding(AssertionError):
    """A check of the machine failed; ``kind`` says which."""

    kind = "finding"


class TraceMismatch(Finding):
    kind = "trace"  # the device's calls are not the table's trace


class HostStateMismatch(Finding):
    kind = "host state"  # the provider's host state is not the model's


class ModelViolation(Finding):
    kind = "model"  # the model finds a property violated by the calls made so far


class WrongData(Finding):
    kind = "device data"  # a read or the idle device saw the wrong bytes or maps


class OracleRace(Finding):
    kind = "sanitizer oracle"  # the sanitizer oracle finds an unordered access in the trace


PROPERTY_KINDS = frozenset({ModelViolation.kind, WrongData.kind, OracleRace.kind})
"""The checks whose failure is a property violated, as opposed to the device not doing what
the table says (``trace``, ``host state``) or the machinery failing."""


def kind_of(error: BaseException) -> str:
    if isinstance(error, Flaky):
        return "flaky"
    if isinstance(error, LogError):
        return TraceMismatch.kind
    if isinstance(error, Finding):
        return error.kind
    return f"other ({type(error).__name__})"


# ---------------------------------------------------------------- the device side


class Rig(Protocol):
    """The device the machine drives. One rig serves every example of a run, in turn."""

    def provider(self, capacity: int) -> RowCacheWeightProvider:
        """A fresh provider with ``capacity`` slots; its device calls are traced from here."""
        ...

    def call(self, stream: int, busy_ms: float, call: Callable[[], object]) -> list[str]:
        """Make the provider call ``call`` on consumer stream ``stream``, behind ``busy_ms`` of
        unrelated work there; the device calls it made, in the model's trace format."""
        ...

    def stream_number(self, stream: Any) -> int:
        """The model's number of a stream of the provider's (its owner)."""
        ...

    def read(self, p: RowCacheWeightProvider, stream: int, delay_ms: float) -> list[str]:
        """A consumer read of ``p``'s slots and maps on consumer stream ``stream`` (that of
        the last prepare, the owner), after ``delay_ms``, remembered for ``mismatches``; its
        trace lines."""
        ...

    def synchronize(self) -> list[str]:
        """The consumer's device-wide host sync; its trace lines."""
        ...

    def mismatches(self, p: RowCacheWeightProvider) -> list[str]:
        """Once synchronized: what went wrong on the device since the last call (a read that
        saw wrong bytes or maps, an idle resident map or slot that differs); forgets the
        reads."""
        ...

    def settle(self) -> None:
        """After a failed step: let the device drain, checking nothing."""
        ...


# ---------------------------------------------------------------- the machine


@dataclass
class Record:
    """What the runs of one machine class did: examples, host calls by operation, and the host
    calls of the latest example (after a failed run, the shrunk counterexample, which
    hypothesis runs last)."""

    examples: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    last: list[HostCall] = field(default_factory=list)
    last_failed_in_teardown: bool = False


class HostCallMachine(RuleBasedStateMachine):
    """The rules; ``machine(rig, ...)`` makes a runnable subclass bound to a rig."""

    rig: ClassVar[Rig]
    table: ClassVar[Table] = TABLE
    mutant: ClassVar[str | None] = None
    record: ClassVar[Record]

    prepared = Bundle("prepared")

    def __init__(self) -> None:
        super().__init__()
        self.p: RowCacheWeightProvider | None = None
        self.capacity = 0
        self.calls: list[HostCall] = []
        self.lines: list[str] = []
        self.since_sync = 0
        self.forward_stream = 0  # the stream of the last prepare, where the consumer reads
        self.done = True  # the last host call finished with every check passed
        self.record.last = self.calls
        self.record.last_failed_in_teardown = False

    @property
    def provider(self) -> RowCacheWeightProvider:
        assert self.p is not None
        return self.p

    # -- preconditions ------------------------------------------------------------------

    def can_read(self) -> bool:
        """A consumer reads only what an accepted prepare exposed."""
        return self.p is not None and self.p.forward_pairs is not None

    def can_synchronize(self) -> bool:
        """A host sync with nothing enqueued since the last one changes and checks nothing."""
        return self.p is not None and self.since_sync > 0

    # -- rules --------------------------------------------------------------------------

    @initialize(capacity=st.integers(1, E))
    def setup(self, capacity: int) -> None:
        p = self.rig.provider(capacity)
        if self.mutant is not None:
            install(p, self.mutant)
        self.p = p
        self.capacity = capacity
        self.model = ModelReplay(Bounds(E, capacity, STREAMS), self.table, explicit=False)
        self.record.examples += 1

    @rule(target=prepared, data=st.data(), stream=STREAM_IDS, busy=DELAYS)
    def prepare(self, data: Any, stream: int, busy: float) -> MultipleResults[int]:
        experts: list[int] = data.draw(
            st.lists(st.integers(0, E - 1), unique=True, min_size=1, max_size=self.capacity),
            label="experts",
        )
        args = (tuple(sorted(experts)),)
        with self.host_call("prepare", args, stream):
            ids = torch.tensor([experts])
            lines = self.rig.call(stream, busy, lambda: self.provider.prepare(ids))
            self.forward_stream = stream  # the consumer runs its forward where it prepared
            self.compare("prepare", args, stream, lines)
        return multiple(*experts)

    @precondition(lambda self: self.can_read())
    @rule(delay=DELAYS)
    def read(self, delay: float) -> None:
        stream = self.forward_stream
        with self.host_call("read", (), stream):
            lines = self.rig.read(self.provider, stream, delay)
            self.compare("read", (), stream, lines)

    @rule(expert=prepared, stream=STREAM_IDS, busy=DELAYS)
    def invalidate(self, expert: int, stream: int, busy: float) -> None:
        with self.host_call("invalidate", (expert,), stream):
            lines = self.rig.call(stream, busy, lambda: self.provider.invalidate(expert))
            self.compare("invalidate", (expert,), stream, lines)

    @precondition(lambda self: self.can_synchronize())
    @rule()
    def synchronize(self) -> None:
        with self.host_call("synchronize", (), 0):
            self.sync_and_verify()

    def teardown(self) -> None:
        if self.p is None:
            return
        if not self.done:  # a check failed: that is the example's finding
            self.rig.settle()
            return
        self.record.last_failed_in_teardown = True
        if self.since_sync:  # the final sync: not one of the example's steps
            self.sync_and_verify()
        found = races(oracle_lines(self.lines))
        if found:
            raise OracleRace("sanitizer oracle: " + "; ".join(map(str, found)))
        self.record.last_failed_in_teardown = False

    # -- checks -------------------------------------------------------------------------

    @contextmanager
    def host_call(self, op: str, args: tuple[object, ...], stream: int) -> Iterator[None]:
        """One host call of the example: recorded first (a call that fails counts), marked
        done only when every check after it passed."""
        self.calls.append((op, args, stream))
        self.record.calls[op] += 1
        self.done = False
        yield
        self.done = True
        self.since_sync = 0 if op == "synchronize" else self.since_sync + 1

    def sync_and_verify(self) -> None:
        self.compare("synchronize", (), 0, self.rig.synchronize())
        wrong = self.rig.mismatches(self.provider)
        if wrong:
            raise WrongData("\n".join(wrong))
        self.since_sync = 0

    def compare(self, op: str, args: tuple[object, ...], stream: int, lines: list[str]) -> None:
        try:
            expected = list(self.model.call(op, args, stream))
        except AssertionError as error:
            if "violates" in str(error):
                raise ModelViolation(f"{op}{args} on {stream}: {error}") from error
            raise
        if lines != expected:
            raise TraceMismatch(f"{op}{args} on {stream}: device log {lines}, table {expected}")
        self.lines += lines
        self.same_host_state()

    def same_host_state(self) -> None:
        p, host = self.provider, self.model.host
        owner = NO_STREAM if p.owner is None else self.rig.stream_number(p.owner)
        stats = p.stats()
        counters = {k: stats[k] for k in Counters._fields}
        for what, got, model in (
            ("LRU order", p.lru_order(), host.lru),
            ("slots", p.slot_of(), host.slot_of),
            ("forward", p.forward_pairs, host.forward),
            ("owner", owner, host.owner),
            ("counters", counters, self.model.counters._asdict()),
        ):
            if got != model:
                raise HostStateMismatch(f"{what} {got}, model {model}")


def oracle_lines(lines: Sequence[str]) -> list[str]:
    """The trace as the sanitizer oracle replays it: without a provider's own host sync of one
    stream role (``host_sync owner``), which the oracle cannot replay (the line names the role,
    not the stream). The real table has none; only the mutant ``host_sync_on_owner`` does,
    and the rest of its trace is the real schedule's, so leaving its syncs out (which only
    removes ordering) adds no race there."""
    return [line for line in lines if not line.startswith("host_sync ") or line == "host_sync all"]


def machine(
    rig: Rig, *, mutant: str | None = None, record: Record | None = None
) -> type[HostCallMachine]:
    """The machine class driving ``rig``; with ``mutant``, the provider runs that mutant's
    schedules and the model replays that mutant's table."""
    table = TABLE if mutant is None else mutant_table(mutant)
    # The name, not the rig, seeds the derandomized search: every rig draws the same examples.
    name = "HostCallMachine" + (f"_{mutant}" if mutant else "")
    attributes = {"rig": rig, "table": table, "mutant": mutant, "record": record or Record()}
    return type(name, (HostCallMachine,), attributes)


# ---------------------------------------------------------------- mutant kills


def call_text(call: HostCall) -> str:
    op, args, stream = call
    return f"{op}({', '.join(map(str, args))}) on {stream}"


@dataclass(frozen=True)
class Kill:
    """How the machine failed on a mutant: which check, its message, and the host calls of the
    shrunk counterexample (the final synchronize of a failing teardown not among them)."""

    mutant: str
    kind: str
    message: str
    calls: tuple[HostCall, ...]
    in_teardown: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "mutant": self.mutant,
            "kind": self.kind,
            "message": self.message,
            "calls": [call_text(c) for c in self.calls],
            "in_teardown": self.in_teardown,
        }

    def describe(self) -> str:
        where = " (then the teardown's checks)" if self.in_teardown else ""
        steps = "; ".join(map(call_text, self.calls)) or "no host call"
        return f"{len(self.calls)} host calls{where}: {steps}\n  [{self.kind}] {self.message}"


def kill(rig: Rig, name: str, examples: int, max_calls: int = 8) -> Kill | None:
    """Run the machine on mutant ``name``; how it failed, or None when it did not.

    Like explain's breadth-first search, by increasing length: runs of examples of at most 1,
    2, ... ``max_calls`` host calls, each with shrinking on, until one fails. (Hypothesis
    shrinks stateful examples to a local minimum: a step it cannot delete without breaking
    the steps after it stays; bounding the length first keeps such steps out.)"""
    for calls in range(1, max_calls + 1):
        record = Record()
        config = machine_settings(examples, shrink=True, calls=calls)
        try:
            run_state_machine_as_test(machine(rig, mutant=name, record=record), settings=config)
        except Exception as error:
            message = str(error).strip().splitlines()
            return Kill(
                name,
                kind_of(error),
                message[0] if message else type(error).__name__,
                tuple(record.last),
                record.last_failed_in_teardown,
            )
    return None


def explain_to_compare(name: str, found: Kill | None) -> tuple[HostCall, ...] | None:
    """Explain's counterexample for mutant ``name``, as far as comparing ``found`` with it
    needs: only one with fewer host calls than the kill matters, and explain finds such a one
    while expanding states reached by at most ``len(found.calls) - 1`` calls, so ``explain
    --depth`` that (at most the default) finds it, the very one of the default depth, or finds
    none (``mutant_provider.explain_calls``). hit_path_ignores_handoff: minutes at depth 4,
    a fraction of a second at depth 1. Without a kill, the default depth."""
    if found is None:
        return explain_calls(name)
    return explain_calls(name, max(0, min(len(found.calls) - 1, EXPLAIN_DEPTH)))


def judge(name: str, found: Kill | None, shortest: Sequence[HostCall] | None) -> list[str]:
    """What is wrong with the machine's kill of mutant ``name`` (nothing: an empty list).

    ``shortest``: the host calls of the counterexample ``python -m model_check explain``
    prints for the model mutant of that name (``explain_to_compare``), None where it has none
    (or none shorter than the kill). The machine must fail, by a property check, with a shrunk
    counterexample no longer than that."""
    if found is None:
        return [f"{name}: the machine did not kill the mutant"]
    problems = []
    if found.kind not in PROPERTY_KINDS:
        problems.append(
            f"{name}: killed by the {found.kind} check, not by a property check "
            f"({', '.join(sorted(PROPERTY_KINDS))}): {found.message}"
        )
    if shortest is not None and len(found.calls) > len(shortest):
        problems.append(
            f"{name}: the shrunk counterexample has {len(found.calls)} host calls "
            f"({'; '.join(map(call_text, found.calls))}), explain's has {len(shortest)} "
            f"({'; '.join(map(call_text, shortest))})"
        )
    return problems


# ---------------------------------------------------------------- the CPU rig


class RecordingRig:
    """The machine's device on a CPU: ``RecordingBackend``, whose device runs every step at
    once and writes the model's trace line for it. Delays are ignored. Reads are checked
    when made (the slot a read names holds its expert, per ``slot_experts``; the map tensors
    are the provider's maps) and reported at the next synchronization, as on the GPU."""

    def __init__(self) -> None:
        e = torch.arange(E, dtype=torch.float32)
        self.w13 = e.view(-1, 1, 1).expand(E, 2, 2).clone()
        self.w2 = (e + 100).view(-1, 1).expand(E, 2).clone()
        self.backend = RecordingBackend(STREAMS)
        self.wrong: list[str] = []
        self.reads = 0

    def provider(self, capacity: int) -> RowCacheWeightProvider:
        self.backend = RecordingBackend(STREAMS, {s: s for s in range(STREAMS)})
        self.wrong, self.reads = [], 0
        return RowCacheWeightProvider(
            self.w13, self.w2, capacity=capacity, device="cpu", backend=self.backend
        )

    def call(self, stream: int, busy_ms: float, call: Callable[[], object]) -> list[str]:
        self.backend.current = stream
        call()
        return self.backend.take()

    def stream_number(self, stream: Any) -> int:
        return self.backend.stream_index(stream)

    def read(self, p: RowCacheWeightProvider, stream: int, delay_ms: float) -> list[str]:
        pairs = p.forward_pairs
        assert pairs is not None, "a reader needs an accepted prepare"
        label = f"read {self.reads}"
        self.reads += 1
        held = self.backend.slot_experts
        self.wrong += [
            f"{label}: slot {s} should hold expert {e}, holds expert {held[s]}"
            for e, s in pairs
            if held[s] != e
        ]
        forward = [-1] * E
        for e, s in pairs:
            forward[e] = s
        if self.backend.forward_map.tolist() != forward:
            self.wrong.append(f"{label}: forward map {self.backend.forward_map.tolist()}")
        if self.backend.resident_map.tolist() != list(p.slot_of()):
            self.wrong.append(f"{label}: resident map {self.backend.resident_map.tolist()}")
        self.backend.consumer_read(stream, pairs)
        return self.backend.take()

    def synchronize(self) -> list[str]:
        self.backend.host_sync(None, "all")
        return self.backend.take()

    def mismatches(self, p: RowCacheWeightProvider) -> list[str]:
        wrong, self.wrong = self.wrong, []
        if self.backend.resident_map.tolist() != list(p.slot_of()):
            wrong.append(f"idle: resident map {self.backend.resident_map.tolist()}")
        held = self.backend.slot_experts
        wrong += [
            f"idle: slot {s} should hold expert {e}, holds expert {held[s]}"
            for e, s in sorted(p.resident_experts().items())
            if held[s] != e
        ]
        return wrong

    def settle(self) -> None:
        self.wrong = []

"""The host-call interpreter shared by every device model.

A host call runs in three phases: the operation's pre-guard effects (empty in the real table),
its guard, then its effect and its steps in table order. This module owns that order, the
resolution of stream roles, the `when` conditions, the recorded call trace and the host-level
property checks (P3, P5, P9). What a step does to the device is delegated to a `DeviceCall`:
the explicit FIFO model (semantics.py), the happens-before summary (hb.py) and the z3 encoding
each implement it, so all of them interpret the one table the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from model_check.reference import (
    EFFECTS,
    GUARDS,
    NO_STREAM,
    PRE_GUARD_EFFECTS,
    Bounds,
    Counters,
    Effect,
    HostState,
)
from model_check.table import Operation, Step, Table

PROPERTIES: dict[str, str] = {
    "P1_no_overwrite_under_reader": "a copy into a slot never runs before an earlier-enqueued "
    "read of that slot finished",
    "P2_no_stale_read": "a read runs after every earlier-enqueued copy into its slots and finds "
    "exactly the experts its forward map names",
    "P3_forward_map_exact": "the forward map exposes exactly the requested experts, each in "
    "its own slot, and agrees with the resident map",
    "P4_map_convergence": "when the device is idle the device resident map equals the host "
    "mirror and every mapped slot holds its expert",
    "P5_victim_protection": "no expert requested by a call is evicted by it",
    "P6_staging_lifetime": "the host never rewrites a staging buffer an enqueued upload still "
    "reads",
    "P7_no_deadlock": "the device can always run some pending operation",
    "P8_no_host_block_on_reader": "no provider call blocks the host on consumer work",
    "P9_validation_first": "a rejected call leaves the whole state unchanged",
}

S = TypeVar("S")
Pairs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str


class Action(NamedTuple):
    """A transition label: a host call (op, args, stream), a device step, or a resume."""

    kind: str  # "host", "device", "resume"
    op: str = ""
    args: tuple[object, ...] = ()
    stream: int = -1

    def __str__(self) -> str:
        if self.kind == "device":
            return f"device runs head of stream {self.stream}"
        if self.kind == "resume":
            return "host resumes after host_sync"
        shown = ", ".join(map(str, self.args))
        return f"{self.op}({shown}) on stream {self.stream}"


class Outcome(NamedTuple, Generic[S]):
    state: S
    violation: Violation | None
    tags: frozenset[str]  # reachability observations ("sometimes" properties)
    trace: tuple[str, ...]  # device calls made by a host call, in the recording format
    counters: Counters


def pairs_text(pairs: Pairs) -> str:
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


class DeviceCall(ABC):
    """What one host call does to a device model; subclasses hold the device state."""

    def __init__(self, bounds: Bounds, stream: int, effect: Effect, before: HostState) -> None:
        self.bounds = bounds
        self.stream = stream
        self.copy_stream = bounds.consumer_streams
        self.effect = effect
        self.before = before  # host state at the start of the call (after pre-guard effects)
        self.owner = before.owner
        self.violation: Violation | None = None
        self.tags: set[str] = set()
        self.trace: list[str] = []

    def role(self, role: str) -> int:
        if role == "copy":
            return self.copy_stream
        if role == "owner" and self.owner != NO_STREAM:
            return self.owner
        return self.stream

    def flag(self, violation: Violation) -> None:
        if self.violation is None:
            self.violation = violation

    # Device primitives, one per step kind.
    @abstractmethod
    def record(self, stream: int, event: str) -> None: ...

    @abstractmethod
    def wait(self, stream: int, event: str) -> None: ...

    @abstractmethod
    def wait_flag(self, stream: int, event: str) -> None: ...

    @abstractmethod
    def copy(self, stream: int, slot: int, expert: int) -> None: ...

    @abstractmethod
    def read(self, stream: int, pairs: Pairs) -> None: ...

    @abstractmethod
    def stage(self, ring: str) -> None: ...

    @abstractmethod
    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None: ...

    @abstractmethod
    def release_staging(self, stream: int, ring: str) -> None: ...

    @abstractmethod
    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        """Block the host until `streams` drain; False when the model must stop here."""

    @property
    def handoff(self) -> bool:
        """The call is made on another stream than the owner (there is one)."""
        return self.owner != NO_STREAM and self.owner != self.stream

    def when_holds(self, when: str) -> bool:
        """Whether a step with condition `when` runs in this call."""
        effect = self.effect
        if when == "misses":
            return bool(effect.copies)
        if when == "changed":
            return effect.changed
        if when == "misses_or_handoff":
            return bool(effect.copies) or self.handoff
        return True

    def run_step(self, step: Step, op: Operation) -> bool:
        """Run one table step; False when the host blocks in host_sync."""
        effect = self.effect
        if not self.when_holds(step.when):
            return True
        kind = step.kind
        if kind == "write_staging":
            self.trace.append(f"stage {step.ring}")
            self.stage(step.ring)
            return True
        if kind == "host_sync":
            streams = (
                list(range(self.copy_stream + 1))
                if step.stream == "all"
                else [self.role(step.stream)]
            )
            self.trace.append(f"host_sync {step.stream}")
            return self.host_sync(streams, op.provider, op.name)
        sid = self.role(step.stream)
        if kind == "record_event":
            self.trace.append(f"record {step.event} on {sid}")
            self.record(sid, step.event)
        elif kind == "wait_event":
            self.trace.append(f"wait {step.event} on {sid}")
            self.wait(sid, step.event)
        elif kind == "wait_flag":
            self.trace.append(f"waitflag {step.event} on {sid}")
            self.wait_flag(sid, step.event)
        elif kind == "copy_rows":
            for expert, slot in effect.copies:
                self.trace.append(f"copy expert {expert} to slot {slot} on {sid}")
                self.copy(sid, slot, expert)
        elif kind == "upload_map":
            content: tuple[object, ...]
            if step.ring == "resident":
                content = effect.host.slot_of
            else:
                assert effect.host.forward is not None
                content = effect.host.forward
            self.trace.append(f"upload {step.ring} map on {sid}")
            self.upload(sid, step.ring, content)
        elif kind == "release_staging":
            self.trace.append(f"record {step.ring} staging reuse on {sid}")
            self.release_staging(sid, step.ring)
        elif kind == "consumer_read":
            pairs = effect.host.forward
            assert pairs is not None
            self.trace.append(f"read {pairs_text(pairs)} on {sid}")
            self.read(sid, pairs)
        return True

    def run_steps(self, op: Operation, start: int = 0) -> int:
        """Run op's steps from `start`; returns the index of a blocking host_sync, or -1."""
        for index in range(start, len(op.steps)):
            if not self.run_step(op.steps[index], op):
                return index
        return -1


class Accepted(NamedTuple):
    host: HostState  # host state after pre-guard effects, before the call's effect
    effect: Effect
    tags: frozenset[str]
    violation: Violation | None


class Rejected(NamedTuple):
    host: HostState  # host state after pre-guard effects (equal to before unless a mutant)
    error: str
    violation: Violation | None


def begin_call(
    table: Table,
    bounds: Bounds,
    host: HostState,
    counters: Counters,
    op_name: str,
    args: tuple[object, ...],
    stream: int,
) -> Accepted | Rejected:
    """Pre-guard effects, guard, effect and the host-level checks of one host call."""
    op = table.op(op_name)
    start = host
    for name in op.before_guard:
        host = PRE_GUARD_EFFECTS[name](host, bounds, args)
    error = GUARDS[op.guard](host, bounds, args)
    if error is not None:
        violation = None
        if host != start and op.provider:
            violation = Violation(
                "P9_validation_first", f"rejected {op.name}{args} ({error}) changed the state"
            )
        return Rejected(host, error, violation)
    effect = EFFECTS[op.effect](host, counters, bounds, args, stream)
    tags: set[str] = set()
    if op.name == "prepare":
        tags.add("prepare_all_hits" if not effect.copies else "prepare_with_misses")
        if effect.victims:
            tags.add("eviction")
        if host.owner not in (NO_STREAM, stream):
            tags.add("owner_change")
    if op.name == "invalidate" and effect.changed:
        tags.add("invalidate_resident")
    return Accepted(host, effect, frozenset(tags), check_plan(op, effect, args))


def finish_host(op: Operation, effect: Effect, stream: int) -> HostState:
    """The host state after all of op's steps ran."""
    host = effect.host
    if op.set_owner == "current":
        host = host._replace(owner=stream)
    return host


def check_plan(op: Operation, effect: Effect, args: tuple[object, ...]) -> Violation | None:
    if op.name != "prepare":
        return None
    ids = args[0]
    assert isinstance(ids, tuple)
    evicted = set(effect.victims) & set(ids)
    if evicted:
        return Violation(
            "P5_victim_protection", f"prepare{ids} evicted requested expert(s) {sorted(evicted)}"
        )
    forward = effect.host.forward
    assert forward is not None
    experts = [e for e, _ in forward]
    slots = [s for _, s in forward]
    if sorted(experts) != sorted(ids) or len(set(slots)) != len(slots):
        return Violation(
            "P3_forward_map_exact", f"prepare{ids} returned forward map {pairs_text(forward)}"
        )
    for e, s in forward:
        if effect.host.slot_of[e] != s:
            return Violation(
                "P3_forward_map_exact",
                f"forward map puts expert {e} in slot {s}, resident map in "
                f"slot {effect.host.slot_of[e]}",
            )
    return None


def host_actions(bounds: Bounds) -> list[Action]:
    """Every host call explored in every state, bad inputs included."""
    from itertools import combinations

    n, cap = bounds.num_experts, bounds.capacity
    actions: list[Action] = []
    for stream in range(bounds.consumer_streams):
        for size in range(1, cap + 1):
            for ids in combinations(range(n), size):
                actions.append(Action("host", "prepare", (ids,), stream))
        for e in range(n):
            actions.append(Action("host", "invalidate", (e,), stream))
        # One representative of each way validation can reject a call.
        actions.append(Action("host", "prepare", (tuple(range(cap + 1)),), stream))
        actions.append(Action("host", "invalidate", (n,), stream))
    actions.append(Action("host", "prepare", ((0, 0),), 0))
    actions.append(Action("host", "prepare", ((n,),), 0))
    actions.append(Action("host", "read", (), 0))
    actions.append(Action("host", "synchronize", (), 0))
    return actions

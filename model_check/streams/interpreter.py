"""The device half of a host call: the table's steps, interpreted once for every device model.

After the host half (`model_check.table.host.begin_call`: pre-guard effects, guard, effect),
an accepted call runs its steps in table order. `DeviceCall.run_steps` owns that order, the
resolution of stream roles, the `when` conditions and the recorded call trace (the lines the
provider's recording backend writes too); what a step does to the device is delegated to one
primitive per step kind (`record`, `wait`, `copy`, ...). Each device model implements the
primitives on its own state:

- `model_check.streams.queues.QueueCall`: the explicit FIFO model;
- `model_check.streams.program.Recorder`: the happens-before summary, which records the
  primitives as a program and evaluates it on pending operations (`streams.hb`);
- `model_check.z3.streams.Z3Call`: the same summary over symbolic state.

A new step kind (for instance a CUDA-graph launch) is one entry of `schema.STEP_KINDS`, one
branch of `DeviceCall.run_step` and one primitive here, implemented by each model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, NamedTuple, TypeVar

from model_check.table.host import Pairs, pairs_text
from model_check.table.properties import Violation
from model_check.table.reference import NO_STREAM, Bounds, Counters, Effect, HostState
from model_check.table.schema import Operation, Step

S = TypeVar("S")


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

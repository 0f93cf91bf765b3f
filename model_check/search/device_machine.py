"""A hypothesis rule-based machine over the device-planned path.

Random host calls (raw `topk_ids` entries with padding and ids outside [-1, E), bad pass
indices, bad experts), random device steps on the explicit model, and the happens-before
summary in lockstep on the same calls. The summary decides every ordering when its second
access is enqueued and every data verdict in host-call order, so it must have reported a
violation by the time the explicit model runs into one; a run where it has not is a failure
of the summary, not of the table.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from model_check.search.property_violated import PropertyViolated
from model_check.streams.device_hb import Pend, Summary, device_program
from model_check.streams.device_program import HostPart, call, initial_host, interpret
from model_check.streams.device_queues import (
    XState,
    deadlocked,
    device,
    host_call,
    initial_state,
    resume_host,
    runnable,
)
from model_check.streams.device_queues import (
    can_resume as part_can_resume,
)
from model_check.streams.interpreter import Outcome
from model_check.table.properties import Violation
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable


def machine_for(table: DeviceTable, bounds: Bounds) -> type[RuleBasedStateMachine]:
    n = bounds.num_experts
    streams = st.integers(0, len(table.consumer_streams) - 1)
    entries = st.lists(st.integers(-2, n), min_size=1, max_size=n + 2).map(tuple)
    valid = st.sets(st.integers(0, n - 1), min_size=1).map(lambda s: tuple(sorted(s)))
    ids_st = st.one_of(valid, valid, entries)
    summary = Summary(table, bounds)
    names = {op.name for op in table.operations}

    class DeviceMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.state: XState = initial_state(table, bounds)
            self.hb_host: HostPart = initial_host(bounds)
            self.hb_pending: frozenset[Pend] = frozenset()

        def _check(self, outcome: Outcome[XState]) -> None:
            if outcome.violation is not None:
                found = outcome.violation
                raise AssertionError(
                    f"the happens-before summary missed {found.prop}: {found.detail}"
                )

        def _host(self, op: str, args: tuple[object, ...], stream: int) -> None:
            if op not in names:
                return
            action = call(op, args, stream)
            # The summary first: it must stop the run before the explicit model goes wrong.
            program = interpret(table, bounds, self.hb_host, op, args, stream)
            if not program.rejected:
                half = summary.run(self.hb_pending, device_program(program.prims))
                found = program.static or half.violation or program.data
                if found is not None:
                    raise PropertyViolated(found, "happens-before")
                self.hb_host, self.hb_pending = program.host, half.pending
            outcome = host_call(table, bounds, self.state, action)
            assert isinstance(outcome.state, XState)
            assert outcome.state.host == self.hb_host
            self._check(outcome)
            self.state = outcome.state

        @precondition(lambda self: self.state.part.blocked is None)
        @rule(ids=ids_st, p=st.integers(0, 2), stream=streams)
        def prepare(self, ids: tuple[int, ...], p: int, stream: int) -> None:
            self._host("device_prepare", (ids, p), stream)

        @precondition(lambda self: self.state.part.blocked is None)
        @rule(ids=ids_st, stream=streams)
        def replay(self, ids: tuple[int, ...], stream: int) -> None:
            self._host("replay", (ids,), stream)

        @precondition(lambda self: self.state.part.blocked is None)
        @rule(stream=streams)
        def handoff(self, stream: int) -> None:
            self._host("handoff", (), stream)

        @precondition(lambda self: self.state.part.blocked is None)
        @rule(expert=st.integers(-1, n), stream=streams)
        def invalidate(self, expert: int, stream: int) -> None:
            self._host("device_invalidate", (expert,), stream)

        @precondition(lambda self: self.state.part.blocked is None and self.state.host.unread)
        @rule(stream=streams)
        def read(self, stream: int) -> None:
            self._host("device_read", (), stream)

        @precondition(lambda self: self.state.part.blocked is None)
        @rule(stream=streams)
        def check_errors(self, stream: int) -> None:
            self._host("check_errors", (), stream)
            self.finish_blocked()

        @precondition(lambda self: self.state.part.blocked is None)
        @rule()
        def synchronize(self) -> None:
            self._host("device_synchronize", (), 0)
            self.finish_blocked()

        @rule(data=st.data())
        def device_step(self, data: st.DataObject) -> None:
            part = self.state.part
            ready = [s for s in range(len(part.queues)) if runnable(part, s)]
            if not ready:
                return
            outcome = device(self.state, data.draw(st.sampled_from(ready)), bounds)
            self._check(outcome)
            assert isinstance(outcome.state, XState)
            self.state = outcome.state

        def finish_blocked(self) -> None:
            """A call waiting in host_sync: the device runs until the host can go on."""
            while self.state.part.blocked is not None:
                part = self.state.part
                if part_can_resume(part):
                    outcome = resume_host(self.state)
                else:
                    ready = [s for s in range(len(part.queues)) if runnable(part, s)]
                    if not ready:
                        raise PropertyViolated(
                            Violation(
                                "P7_no_deadlock", "pending operations remain and none can run"
                            ),
                            "interleavings",
                        )
                    outcome = device(self.state, ready[0], bounds)
                self._check(outcome)
                assert isinstance(outcome.state, XState)
                self.state = outcome.state

        @invariant()
        def device_can_progress(self) -> None:
            if deadlocked(self.state.part):
                raise PropertyViolated(
                    Violation("P7_no_deadlock", "pending operations remain and none can run"),
                    "interleavings",
                )

    DeviceMachine.__name__ = "DeviceMachine"
    return DeviceMachine

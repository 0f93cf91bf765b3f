"""Hypothesis stateful testing of the table's semantics.

A rule-based machine drives random host calls (bad inputs included) and random device steps
through the explicit FIFO model, and runs the happens-before summary in lockstep on the same
host calls. After every step it checks the properties (the invariants are the model's own
violation reports), and that the two device models agree: same host state, same recorded
call trace, and the summary, which decides ordering for all interleavings at once, has
reported a violation whenever the explicit model ran into one.

The machine is a third, randomized checker: it reaches far deeper call sequences than the
exhaustive bounds, at the price of not covering everything.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from model_check.search.property_violated import PropertyViolated
from model_check.streams.hb import (
    HbState,
    NotExpressible,
    hb_host_call,
    initial_hb_state,
    keeps_reads,
    live_places,
    packing,
)
from model_check.streams.interpreter import Outcome
from model_check.streams.queues import (
    State,
    can_resume,
    device_step,
    host_call,
    initial_state,
    resume,
    runnable,
)
from model_check.table.properties import Violation
from model_check.table.reference import Bounds
from model_check.table.schema import Table


def machine_for(
    table: Table, bounds: Bounds, *, lockstep: bool = True
) -> type[RuleBasedStateMachine]:
    """A state machine class over `table` (a mutant's table makes it fail)."""
    n = bounds.num_experts
    streams = st.integers(0, bounds.consumer_streams - 1)
    valid = st.sets(st.integers(0, n - 1), max_size=bounds.capacity).map(
        lambda ids: tuple(sorted(ids))
    )
    anything = st.lists(st.integers(-1, n), max_size=bounds.capacity + 1).map(tuple)
    id_sets = st.one_of(valid, valid, valid, anything)  # mostly accepted calls, some bad ones
    live = live_places(table, packing(bounds).places)
    keep_reads = keeps_reads(table)

    class ModelMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.state: State = initial_state(bounds)
            self.hb: HbState | None = initial_hb_state(bounds) if lockstep else None

        def _check(self, outcome: Outcome[Any]) -> None:
            found = outcome.violation
            if found is None:
                return
            if self.hb is not None:
                # The summary decides every ordering when the second operation is enqueued,
                # so it must have stopped the run before the explicit model got here.
                raise AssertionError(
                    f"the happens-before summary missed {found.prop}: {found.detail}"
                )
            raise PropertyViolated(found, "interleavings")

        def _host(self, op: str, args: tuple[object, ...], stream: int) -> None:
            outcome = host_call(table, bounds, self.state, op, args, stream)
            if self.hb is not None:
                self._lockstep(outcome, op, args, stream)
            self._check(outcome)
            self.state = outcome.state

        def _lockstep(
            self, outcome: Outcome[State], op: str, args: tuple[object, ...], stream: int
        ) -> None:
            assert self.hb is not None
            try:
                options = hb_host_call(
                    table, bounds, self.hb, op, args, stream, keep_reads=keep_reads, live=live
                )
            except NotExpressible:
                self.hb = None
                return
            # The summary branches on what the host observes of device progress (staging
            # reuse); follow the branch the explicit model took.
            staging = {t for t in outcome.tags if t.startswith("staging_")}
            same = [
                o for o in options if {t for t in o.tags if t.startswith("staging_")} == staging
            ]
            chosen = same[0] if same else options[0]
            assert chosen.state.host == outcome.state.host or outcome.state.blocked is not None, (
                f"host states differ: {chosen.state.host} vs {outcome.state.host}"
            )
            assert chosen.trace[: len(outcome.trace)] == outcome.trace, (
                f"traces differ: {chosen.trace} vs {outcome.trace}"
            )
            if chosen.violation is not None:
                raise PropertyViolated(chosen.violation, "happens-before")
            self.hb = chosen.state

        @precondition(lambda self: self.state.blocked is None)
        @rule(ids=id_sets, stream=streams)
        def prepare(self, ids: tuple[int, ...], stream: int) -> None:
            self._host("prepare", (ids,), stream)

        @precondition(lambda self: self.state.blocked is None)
        @rule(expert=st.integers(-1, n), stream=streams)
        def invalidate(self, expert: int, stream: int) -> None:
            self._host("invalidate", (expert,), stream)

        @precondition(
            lambda self: self.state.blocked is None and self.state.host.forward is not None
        )
        @rule()
        def read(self) -> None:
            self._host("read", (), 0)

        @precondition(lambda self: self.state.blocked is None)
        @rule()
        def synchronize(self) -> None:
            # The consumer's own host sync blocks until idle: drain the device first.
            self.drain()
            self._host("synchronize", (), 0)

        @rule(data=st.data())
        def device(self, data: st.DataObject) -> None:
            ready = [s for s in range(len(self.state.queues)) if runnable(self.state, s)]
            if not ready:
                return
            outcome = device_step(self.state, data.draw(st.sampled_from(ready)))
            self._check(outcome)
            self.state = outcome.state

        @precondition(lambda self: self.state.blocked is not None)
        @rule()
        def resume_host(self) -> None:
            if can_resume(self.state, bounds, table):
                outcome = resume(table, bounds, self.state)
                self._check(outcome)
                self.state = outcome.state
            else:
                self.drain_one()

        def drain_one(self) -> None:
            ready = [s for s in range(len(self.state.queues)) if runnable(self.state, s)]
            if not ready:
                raise PropertyViolated(
                    Violation("P7_no_deadlock", "pending operations remain and none can run"),
                    "interleavings",
                )
            outcome = device_step(self.state, ready[0])
            self._check(outcome)
            self.state = outcome.state

        def drain(self) -> None:
            while any(self.state.queues):
                self.drain_one()

        @invariant()
        def device_can_progress(self) -> None:
            if any(self.state.queues) and not any(
                runnable(self.state, s) for s in range(len(self.state.queues))
            ):
                raise PropertyViolated(
                    Violation("P7_no_deadlock", "pending operations remain and none can run"),
                    "interleavings",
                )

    ModelMachine.__name__ = "ModelMachine"
    return ModelMachine

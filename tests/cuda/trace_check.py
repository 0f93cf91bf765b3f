"""Trace validation: the CUDA backend's call log against the transition table.

``render`` turns a ``CudaBackend`` call log (``rowcache.backends.cuda.CudaCall``) into the
model's trace format (the lines ``model_check.streams.queues`` puts in ``Outcome.trace``): stream
handles become model stream numbers (consumer streams ``0..n-1``, the copy stream ``n``), the
per-tensor copies of one miss become one ``copy expert e to slot s`` line (all present tensors,
in ``SOURCE_NAMES`` order, on one stream, or the log is rejected), and staging buffer indices
are dropped (the model chooses its own).

``ModelReplay`` replays the same host calls in two device models and checks every outcome:

* the explicit FIFO semantics (``model_check.streams.queues``): after every host call, the closure
  under device steps (every interleaving of device progress with the host calls); each host
  call is applied in every state of that closure; a ``synchronize`` keeps the idle states;
* the happens-before summary (``model_check.streams.hb.hb_host_call``), which decides the ordering
  properties for all interleavings at once, with every staging-reuse branch.

Both must report no violation, and each host call's trace must be the same in every branch:
that trace is what the test compares with the rendered log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from model_check.streams.hb import HbState, hb_host_call, initial_hb_state
from model_check.streams.queues import (
    State,
    deadlocked,
    device_step,
    host_call,
    initial_state,
    is_idle,
    runnable,
)
from model_check.table import Table, load_table
from model_check.table.reference import Bounds, Counters, HostState
from rowcache.backends.cuda import HOST, CudaCall
from rowcache.sources import SOURCE_NAMES

TABLE = load_table()
MAX_STATES = 200_000


class LogError(AssertionError):
    """The call log is not in a form the table can produce."""


def render(
    calls: Sequence[CudaCall],
    streams: Mapping[int, int],
    tensors: Sequence[str] = SOURCE_NAMES,
) -> list[str]:
    """The model-format trace of ``calls``; ``streams`` maps stream handles to model numbers."""

    def sid(call: CudaCall) -> int:
        try:
            return streams[call.stream]
        except KeyError:
            raise LogError(f"{call} was issued on a stream the test does not know") from None

    lines: list[str] = []
    i = 0
    while i < len(calls):
        call = calls[i]
        kind = call.kind
        if kind == "copy":
            group = calls[i : i + len(tensors)]
            names = [c.name for c in group]
            same = all(
                (c.kind, c.stream, c.expert, c.slot)
                == ("copy", call.stream, call.expert, call.slot)
                for c in group
            )
            if names != list(tensors) or not same:
                raise LogError(
                    f"copies of expert {call.expert} into slot {call.slot}: expected one copy "
                    f"of each of {list(tensors)} on one stream, got {group}"
                )
            lines.append(f"copy expert {call.expert} to slot {call.slot} on {sid(call)}")
            i += len(tensors)
            continue
        if kind == "record":
            lines.append(f"record {call.name} on {sid(call)}")
        elif kind == "wait":
            lines.append(f"wait {call.name} on {sid(call)}")
        elif kind == "stage":
            if call.stream != HOST:
                raise LogError(f"{call}: a staging write is a host write")
            lines.append(f"stage {call.name}")
        elif kind == "upload":
            lines.append(f"upload {call.name} map on {sid(call)}")
        elif kind == "reuse":
            lines.append(f"record {call.name} staging reuse on {sid(call)}")
        elif kind == "sync":
            lines.append(f"host_sync {call.name}")
        else:
            raise LogError(f"unknown call kind in {call}")
        i += 1
    return lines


def pairs_text(pairs: Iterable[tuple[int, int]]) -> str:
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


class ModelReplay:
    """Replays host calls in the explicit semantics (all interleavings) and the HB summary."""

    def __init__(self, bounds: Bounds, table: Table = TABLE, *, explicit: bool = True) -> None:
        self.bounds = bounds
        self.table = table
        self.explicit = explicit
        self.states: set[State] = {initial_state(bounds)}
        self.hb: set[HbState] = {initial_hb_state(bounds)}
        self.tags: set[str] = set()
        self.counters = Counters()
        self.calls: list[tuple[str, tuple[object, ...], int]] = []
        self.max_states = 1
        self.max_hb = 1

    # -- explicit model --------------------------------------------------------------

    def _closure(self, states: set[State]) -> set[State]:
        """Every state reachable by device steps, each checked."""
        seen = set(states)
        frontier = list(states)
        while frontier:
            state = frontier.pop()
            if deadlocked(state):
                raise AssertionError(f"explicit model: deadlock after {self._where()}")
            for stream in range(len(state.queues)):
                if not runnable(state, stream):
                    continue
                out = device_step(state, stream)
                if out.violation is not None:
                    raise AssertionError(
                        f"explicit model: a device step after {self._where()} violates "
                        f"{out.violation.prop}: {out.violation.detail}"
                    )
                self.tags |= out.tags
                if out.state not in seen:
                    seen.add(out.state)
                    frontier.append(out.state)
                    if len(seen) > MAX_STATES:
                        raise AssertionError(f"explicit closure over {MAX_STATES} states")
        return seen

    def _explicit_call(
        self, op: str, args: tuple[object, ...], stream: int, counters: Counters
    ) -> set[tuple[str, ...]]:
        states = self._closure(self.states)
        if op == "synchronize":
            states = {s for s in states if is_idle(s)}
            assert states, "explicit model: no idle state to synchronize in"
        self.max_states = max(self.max_states, len(states))
        traces: set[tuple[str, ...]] = set()
        after: set[State] = set()
        for state in states:
            out = host_call(self.table, self.bounds, state, op, args, stream, counters)
            if out.violation is not None:
                raise AssertionError(
                    f"explicit model: {self._where()} violates {out.violation.prop}: "
                    f"{out.violation.detail}"
                )
            assert out.state.blocked is None, f"{self._where()} blocks the host in the model"
            self.tags |= out.tags
            traces.add(out.trace)
            after.add(out.state)
        self.states = after
        return traces

    # -- happens-before summary --------------------------------------------------------

    def _hb_call(self, op: str, args: tuple[object, ...], stream: int) -> set[tuple[str, ...]]:
        traces: set[tuple[str, ...]] = set()
        after: set[HbState] = set()
        counters: set[Counters] = set()
        for state in self.hb:
            outs = hb_host_call(self.table, self.bounds, state, op, args, stream, self.counters)
            for out in outs:
                if out.violation is not None:
                    raise AssertionError(
                        f"happens-before model: {self._where()} violates "
                        f"{out.violation.prop}: {out.violation.detail}"
                    )
                self.tags |= out.tags
                traces.add(out.trace)
                after.add(out.state)
                counters.add(out.counters)
        assert len(counters) == 1, f"{self._where()}: counters differ between branches"
        self.counters = next(iter(counters))
        self.hb = after
        self.max_hb = max(self.max_hb, len(after))
        return traces

    # -- both ----------------------------------------------------------------------

    def _where(self) -> str:
        shown = [f"{op}{args} on {s}" for op, args, s in self.calls[-6:]]
        return " ; ".join(shown) or "the start"

    def call(self, op: str, args: tuple[object, ...], stream: int) -> tuple[str, ...]:
        """Apply one host call everywhere; the trace the table prescribes for it."""
        self.calls.append((op, args, stream))
        before = self.counters
        traces = self._hb_call(op, args, stream)
        if self.explicit:
            traces |= self._explicit_call(op, args, stream, before)
        assert len(traces) == 1, f"{self._where()}: the models disagree on the trace: {traces}"
        return next(iter(traces))

    @property
    def host(self) -> HostState:
        """The host state after the calls so far (the same in every branch)."""
        hosts = {state.host for state in self.hb}
        assert len(hosts) == 1, f"host states differ between branches: {hosts}"
        return next(iter(hosts))

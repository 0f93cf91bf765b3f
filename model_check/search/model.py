"""What a search needs of a model, made explicit (as stateright's `Model` trait does).

A `Model` has initial states, actions, the outcomes of an action in a state (each with the
verdict of the transition, its reachability tags and the device calls it made), a canonical
form for symmetric states and a property of states (deadlock). `bfs.bfs` explores any
`Model`. A `FactoredModel` also splits every transition into a host half, a function of the
host part of the state and the action, and a device half, a function of the device part and
a *program* the host half hands over; `memo.memo_search` explores any `FactoredModel` with
both halves memoized, and reports exactly what `bfs.bfs` reports on the same model.

Transitions cost host-call depth: 1 for a host call, 0 for a device step or a resume (the
bound of a search is a number of host calls).
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast

from model_check.streams.interpreter import Action, Outcome
from model_check.table.properties import Violation

S = TypeVar("S", bound=Hashable)
H = TypeVar("H", bound=Hashable)
D = TypeVar("D", bound=Hashable)
P = TypeVar("P", bound=Hashable)


class Transition(NamedTuple, Generic[S]):
    action: Action
    outcome: Outcome[S]
    cost: int  # host-call depth: 1 for a host call, 0 for a device step or a resume


class Model(Protocol[S]):
    """A transition system with verdicts on its transitions."""

    @property
    def name(self) -> str: ...

    @property
    def decides(self) -> tuple[str, ...]:
        """The properties whose violations this model reports."""
        ...

    @property
    def expected_tags(self) -> frozenset[str]:
        """The reachability tags a complete search at the full bounds must see."""
        ...

    def initial(self) -> S: ...

    def actions(self, state: S) -> Sequence[Action]: ...

    def outcomes(self, state: S, action: Action) -> list[Outcome[S]]:
        """Every outcome of `action` in `state` (none when it is not enabled)."""
        ...

    def canonical(self, state: S) -> S:
        """The representative of the states symmetric to `state` (itself: no symmetry)."""
        ...

    def stuck(self, state: S) -> Violation | None:
        """A violation of the state itself (a deadlock), found when it is expanded."""
        ...


S_in = TypeVar("S_in", bound=Hashable, contravariant=True)


class BoundVerdicts(Protocol[S_in]):
    """What a `Model` may add for `bfs.bfs`: the verdicts of a host call out of a state at the
    depth bound (whose successors are not stored) without the states it reaches."""

    def bound_verdicts(
        self, state: S_in, action: Action
    ) -> tuple[int, bool, frozenset[str]] | None:
        """(number of outcomes, whether some verdict may fail, their tags), or None when the
        model cannot tell without computing the outcomes."""
        ...


def successors(model: Model[S], state: S) -> Iterator[Transition[S]]:
    """Every transition out of `state`, in the model's order."""
    for action in model.actions(state):
        cost = 1 if action.kind == "host" else 0
        for outcome in model.outcomes(state, action):
            yield Transition(action, outcome, cost)


class HostHalf(NamedTuple, Generic[H, P]):
    """The host half of one host call: a function of the host part and the action alone."""

    program: P | None  # the device work to run on the device part; None: rejected, no device work
    host: H  # the host part after the call
    violated: bool  # some host-side verdict failed
    tags: frozenset[str]
    then: Action | None  # an action the model runs right after this one, in the same transition


class DeviceHalf(NamedTuple, Generic[D]):
    """One outcome of a program on a device part."""

    device: D
    violated: bool  # some device-side verdict failed
    tags: frozenset[str]


class FactoredModel(Model[S], Protocol[S, H, D, P]):
    """A model whose states are (host part, device part) and whose transitions are host calls
    only, each the composition of a host half and a device half (see the module docstring).

    The factored view must agree with `Model.outcomes`: the outcomes of a host call are the
    device halves of the host half's program on the device part (then, when `then` is given
    and no verdict failed, those of the follow-up action), with the host half's host part,
    and a verdict fails in one exactly when it does in the other. The canonical form must be
    `canonical_parts` applied to `split`. A search uses the halves for "no violation" and
    falls back on `Model.outcomes` wherever a verdict may fail, so messages and traces are
    always those of `outcomes`."""

    def split(self, state: S) -> tuple[H, D]: ...

    def join(self, host: H, device: D) -> S: ...

    def host_actions(self) -> Sequence[Action]:
        """The host calls tried in every state (the same in every state)."""
        ...

    def host_half(self, host: H, action: Action) -> HostHalf[H, P]: ...

    def device_half(self, device: D, program: P) -> list[DeviceHalf[D]]:
        """Every outcome of `program` on `device`, in `outcomes` order."""
        ...

    def device_verdicts(self, device: D, program: P) -> list[tuple[bool, frozenset[str]]]:
        """`device_half` without the device parts it reaches (for states at the depth bound,
        whose successors are not stored): whether a verdict failed, and the tags."""
        ...

    def forget(self, host: H) -> H:
        """The host part with what no later step reads erased (the canonical form's first step)."""
        ...

    @property
    def symmetric(self) -> bool:
        """Two interchangeable streams: `swap_host`/`swap_device` rename them."""
        ...

    def swap_host(self, host: H) -> H: ...

    def swap_device(self, device: D) -> D: ...

    def host_order(self, host: H) -> Any:
        """Canonical form: of a state and its renaming, the one with the smaller
        (host_order, device_order) is the representative (the state itself on a tie)."""
        ...

    def device_order(self, device: D) -> Any: ...


def canonical_parts(model: FactoredModel[Any, H, D, Any], host: H, device: D) -> tuple[H, D]:
    """The canonical form of a `FactoredModel`'s state, on its parts."""
    host = model.forget(host)
    if not model.symmetric:
        return host, device
    swapped_host = model.swap_host(host)
    mine, theirs = model.host_order(host), model.host_order(swapped_host)
    if theirs < mine:
        return swapped_host, model.swap_device(device)
    if theirs == mine:
        swapped_device = model.swap_device(device)
        if model.device_order(swapped_device) < model.device_order(device):
            return swapped_host, swapped_device
    return host, device


class SummaryModel:
    """What both paths' happens-before models share, as a `Model` and a `FactoredModel`: host
    calls only (`calls`), no deadlock of their own (P7 is the explicit models'), and the
    canonical form of a state through its parts."""

    calls: list[Action]

    def split(self, state: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def join(self, host: Any, device: Any) -> Any:
        raise NotImplementedError

    def actions(self, state: Any) -> list[Action]:
        return self.calls

    def host_actions(self) -> list[Action]:
        return self.calls

    def stuck(self, state: Any) -> Violation | None:
        return None

    def canonical(self, state: Any) -> Any:
        return self.join(*canonical_parts(cast(Any, self), *self.split(state)))


# The symmetry of the two consumer streams, 0 and 1 (every other stream, and NO_STREAM, stays).


def swap_stream(x: int) -> int:
    return 1 - x if x in (0, 1) else x


def swap_ref(r: tuple[int, int] | None) -> tuple[int, int] | None:
    """A reference to a queue prefix, (stream, k), with the consumer streams renamed."""
    return None if r is None else (swap_stream(r[0]), r[1])


def swap_mask(m: int) -> int:
    """A mask of places (or a packed pending operation, whose low bits are its mask) with the
    two consumer streams' bits exchanged."""
    return (m & ~3) | ((m & 1) << 1) | ((m & 2) >> 1)


Owned = TypeVar("Owned", bound=Any)


def swap_owner(host: Owned) -> Owned:
    """A host state (anything with an `owner` stream) with the consumer streams renamed."""
    renamed: Owned = host._replace(owner=swap_stream(host.owner))
    return renamed


@dataclass
class Result:
    """What a search found: counts, reached tags, the first violation and its trace."""

    depth: int
    model: str
    expected_tags: frozenset[str] = frozenset()
    states: int = 0
    transitions: int = 0
    max_depth_reached: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[tuple[Action, Outcome[Any]]] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def missing_reachability(self) -> list[str]:
        return sorted(self.expected_tags - self.tags)


@contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Run a search with the cyclic garbage collector off: a search allocates millions of
    small tuples, sets and ints and no reference cycles, so the collector's passes over the
    growing tables of seen states only cost time (about a quarter of a memoized search).
    Memory is still freed by reference counting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

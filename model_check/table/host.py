"""The host half of one host call, shared by every device model.

A host call runs in three phases: the operation's pre-guard effects (empty in the real table),
its guard, then its effect and its steps in table order. This module owns the first two and
the effect: it runs the reference functions the table names (`reference.py`), tags what the
call observes, and decides the host-level properties (P3 and P5 on the plan, P9 on a
rejection). The steps are the device half (`model_check.streams.interpreter.DeviceCall`).
"""

from __future__ import annotations

from typing import NamedTuple

from model_check.table.properties import Violation
from model_check.table.reference import (
    EFFECTS,
    GUARDS,
    NO_STREAM,
    PRE_GUARD_EFFECTS,
    Bounds,
    Counters,
    Effect,
    HostState,
)
from model_check.table.schema import Operation, Table

Pairs = tuple[tuple[int, int], ...]


def pairs_text(pairs: Pairs) -> str:
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


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
        if effect.by_count:
            tags.add("victim_by_count")
        if effect.halved:
            tags.add("counts_halved")
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

"""Reference semantics of the host side: guards and effects named by the table.

These functions are the specification of what the provider's host bookkeeping does (LRU order,
slot assignment, the resident-map mirror, the forward map, counters). The explorer, the z3
encoding and the hypothesis machines call them; the provider in rowcache/ is a separate fast
implementation that the conformance tests compare against them step by step.

Alternative versions used only by mutants live here too, registered under their own names, so
that a mutant is a change of a name in the table and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

NO_SLOT = -1
NO_STREAM = -1


POLICIES = ("lru", "lfu")
"""Victim policies: ``lru`` takes the least recently used; ``lfu`` the fewest requests (counts
that saturate at ``Bounds.count_max`` and are all halved when one would pass it), ties to the
least recently used."""


@dataclass(frozen=True)
class Bounds:
    """The parameters of one model configuration."""

    num_experts: int
    capacity: int
    consumer_streams: int = 2
    staging_buffers: int = 1
    policy: str = "lru"
    count_max: int = 15

    def __post_init__(self) -> None:
        if not 0 < self.capacity <= self.num_experts:
            raise ValueError(
                f"capacity {self.capacity} must be in 1..num_experts ({self.num_experts})"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.count_max < 1:
            raise ValueError(f"count_max {self.count_max} must be >= 1")


class HostState(NamedTuple):
    """Host-visible provider state (the part both the model and the provider keep)."""

    lru: tuple[int, ...]  # resident experts, least recently used first
    slot_of: tuple[int, ...]  # resident-map mirror: slot of each expert, NO_SLOT if absent
    owner: int  # stream of the previous accepted prepare, NO_STREAM before the first
    forward: tuple[tuple[int, int], ...] | None  # (expert, slot) exposed by the last prepare
    # The order in which the passes of the current step expose its experts (`step_order`),
    # fixed by the step's first pass; () on the host path, whose calls are one pass each.
    step: tuple[int, ...] = ()
    # Policy "lfu": every expert's request count (resident or not); () under "lru".
    counts: tuple[int, ...] = ()


class Counters(NamedTuple):
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prepare_calls: int = 0
    owner_changes: int = 0
    invalidations: int = 0


class Effect(NamedTuple):
    """What an accepted call does to the host state, and what the device steps need."""

    host: HostState
    copies: tuple[tuple[int, int], ...]  # (expert, slot) to copy, in order
    victims: tuple[int, ...]
    hits: tuple[int, ...]
    changed: bool  # the resident map changed
    counters: Counters
    # Policy "lfu": a victim other than the one least recent use would have chosen.
    by_count: bool = False
    # Policy "lfu": every count was halved (one of the pass's experts was at count_max).
    halved: bool = False


def initial_counts(bounds: Bounds) -> tuple[int, ...]:
    """The request counts a cache starts with: one 0 an expert under "lfu", none under "lru"."""
    return (0,) * bounds.num_experts if bounds.policy == "lfu" else ()


def initial_host(bounds: Bounds) -> HostState:
    return HostState(
        lru=(),
        slot_of=(NO_SLOT,) * bounds.num_experts,
        owner=NO_STREAM,
        forward=None,
        counts=initial_counts(bounds),
    )


def counted(
    counts: Sequence[int], ids: Collection[int], count_max: int
) -> tuple[tuple[int, ...], bool]:
    """Policy "lfu": the counts after a pass that exposes ``ids``: each of them one more; when
    one of them is already at ``count_max``, every count is halved (rounded down) first, so a
    count never passes ``count_max`` and old requests weigh less than new ones. With whether
    they were halved."""
    if not counts:
        return (), False
    new = list(counts)
    halved = any(new[e] >= count_max for e in ids)
    if halved:
        new = [c // 2 for c in new]
    for e in ids:
        new[e] += 1
    return tuple(new), halved


Args = tuple[object, ...]
Guard = Callable[[HostState, Bounds, Args], "str | None"]
EffectFn = Callable[[HostState, Counters, Bounds, Args, int], Effect]
PreGuard = Callable[[HostState, Bounds, Args], HostState]


# ---------------------------------------------------------------- guards


def expert_outside(e: object, bounds: Bounds) -> str | None:
    """Why ``e`` is not an expert id (the words the runtime's checks use), or None."""
    if not isinstance(e, int) or not 0 <= e < bounds.num_experts:
        return f"expert id {e} outside [0, {bounds.num_experts})"
    return None


def valid_prepare(host: HostState, bounds: Bounds, args: Args) -> str | None:
    ids = args[0]
    assert isinstance(ids, tuple)
    for e in ids:
        why = expert_outside(e, bounds)
        if why:
            return why
    if len(set(ids)) != len(ids):
        dup = next(e for e in ids if ids.count(e) > 1)
        return f"expert id {dup} given twice"
    if len(ids) > bounds.capacity:
        return f"{len(ids)} unique experts requested but capacity is {bounds.capacity}"
    return None


def valid_invalidate(host: HostState, bounds: Bounds, args: Args) -> str | None:
    return expert_outside(args[0], bounds)


def has_forward(host: HostState, bounds: Bounds, args: Args) -> str | None:
    return None if host.forward is not None else "no accepted prepare to read from"


def always(host: HostState, bounds: Bounds, args: Args) -> str | None:
    return None


GUARDS: dict[str, Guard] = {
    "valid_prepare": valid_prepare,
    "valid_invalidate": valid_invalidate,
    "has_forward": has_forward,
    "always": always,
}


# ---------------------------------------------------------------- effects


def _plan_prepare(
    host: HostState,
    counters: Counters,
    bounds: Bounds,
    ids: Sequence[int],
    stream: int,
    *,
    step: Collection[int] = (),
    protect_requested: bool = True,
    forward_from_resident: bool = False,
    clear_victim_entry: bool = True,
    victims_by_count: bool = True,
) -> Effect:
    """One pass: expose `ids` (the pass's group). `step` is every expert the step that this pass
    belongs to requests (its other passes' groups too; the group alone when empty): victims are
    taken from the residents outside the step first, and from the step's experts that other
    passes expose only when none is left (P5 for the whole step); within each, the policy's
    order: least recently used first ("lru"), or fewest requests first, ties to the least
    recently used ("lfu", counted after this pass: `counted`)."""
    ids = sorted(ids)
    requested = set(ids)
    slot_of = list(host.slot_of)
    used = {s for s in slot_of if s != NO_SLOT}
    free = [s for s in range(bounds.capacity) if s not in used]
    lru = list(host.lru)
    counts, halved = counted(host.counts, ids, bounds.count_max)
    hits = tuple(e for e in ids if slot_of[e] != NO_SLOT)
    # Slots are looked up for hits before misses are placed, as an implementation would.
    placed = {e: slot_of[e] for e in hits}
    misses = [e for e in ids if slot_of[e] == NO_SLOT]
    # Victims: never one this call asks for; outside the step first; then the policy's order
    # (stable sorts of the LRU order: ties stay least recently used first).
    in_step = set(step)
    candidates = [e for e in lru if e not in requested] if protect_requested else list(lru)
    candidates.sort(key=lambda e: e in in_step)
    by_recency = tuple(candidates)
    if counts and victims_by_count:
        candidates.sort(key=lambda e: (e in in_step, counts[e]))
    copies: list[tuple[int, int]] = []
    victims: list[int] = []
    for e in misses:
        if free:
            slot = free.pop(0)
        else:
            victim = candidates.pop(0)
            victims.append(victim)
            slot = slot_of[victim]
            if clear_victim_entry:
                slot_of[victim] = NO_SLOT
            lru.remove(victim)
        slot_of[e] = slot
        placed[e] = slot
        copies.append((e, slot))
    # Requested experts become most recently used, in id order.
    lru = [e for e in lru if e not in requested] + [e for e in ids if e in lru or e in misses]
    if forward_from_resident:
        forward = tuple(sorted((e, s) for e, s in enumerate(slot_of) if s != NO_SLOT))
    else:
        forward = tuple((e, placed[e]) for e in ids)
    changed = tuple(slot_of) != host.slot_of
    owner_change = host.owner not in (NO_STREAM, stream)
    return Effect(
        host=HostState(
            lru=tuple(lru),
            slot_of=tuple(slot_of),
            owner=host.owner,
            forward=forward,
            step=host.step,
            counts=counts,
        ),
        copies=tuple(copies),
        victims=tuple(victims),
        hits=hits,
        changed=changed,
        counters=counters._replace(
            hits=counters.hits + len(hits),
            misses=counters.misses + len(misses),
            evictions=counters.evictions + len(victims),
            prepare_calls=counters.prepare_calls + 1,
            owner_changes=counters.owner_changes + int(owner_change),
        ),
        by_count=tuple(victims) != by_recency[: len(victims)],
        halved=halved,
    )


def step_order(slot_of: Sequence[int], ids: Collection[int]) -> tuple[int, ...]:
    """The order in which a step's passes expose its experts (pass p: positions [p*C, (p+1)*C)):
    the requested experts resident when the step starts (its hits) first, then the others,
    each in ascending id order. Every hit is then served by the first pass, before any copy can
    evict it, and later passes only copy."""
    requested = sorted(set(ids))
    hits = [e for e in requested if slot_of[e] != NO_SLOT]
    return tuple(hits + [e for e in requested if slot_of[e] == NO_SLOT])


def plan_prepare(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    """`args`: (ids,) or (ids, step). `step`, every expert of the step whose group `ids` is
    (a provider's `prepare(topk_ids, unique_ids=group)`: topk_ids' experts), is protected
    after `ids` (`_plan_prepare`). The searches explore (ids,), a call that is its own step:
    which slot a miss takes does not change the ordering they check; the step-wide choice is
    checked by the device path's model, whose passes are steps, and by the conformance tests."""
    ids = args[0]
    assert isinstance(ids, tuple)
    step = args[1] if len(args) > 1 else ()
    assert isinstance(step, tuple)
    return _plan_prepare(host, counters, bounds, ids, stream, step=step)


def plan_step_pass(
    host: HostState,
    counters: Counters,
    bounds: Bounds,
    group: Sequence[int],
    step: Collection[int],
    stream: int,
) -> Effect:
    """One pass of a step: expose `group`, protecting every expert of `step` (the step's
    groups are `step_order` cut into `capacity`)."""
    return _plan_prepare(host, counters, bounds, group, stream, step=step)


def plan_invalidate(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    e = args[0]
    assert isinstance(e, int)
    if host.slot_of[e] == NO_SLOT:
        return Effect(host, (), (), (), False, counters)
    slot_of = list(host.slot_of)
    slot_of[e] = NO_SLOT
    lru = tuple(x for x in host.lru if x != e)
    new = host._replace(lru=lru, slot_of=tuple(slot_of))
    return Effect(
        new, (), (), (), True, counters._replace(invalidations=counters.invalidations + 1)
    )


def no_change(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    return Effect(host, (), (), (), False, counters)


# Mutant effects: each is the reference effect with one seeded bug.


def plan_prepare_unprotected_victim(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    ids = args[0]
    assert isinstance(ids, tuple)
    return _plan_prepare(host, counters, bounds, ids, stream, protect_requested=False)


def plan_prepare_forward_from_resident(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    ids = args[0]
    assert isinstance(ids, tuple)
    return _plan_prepare(host, counters, bounds, ids, stream, forward_from_resident=True)


def plan_prepare_keep_victim_mapped(
    host: HostState, counters: Counters, bounds: Bounds, args: Args, stream: int
) -> Effect:
    ids = args[0]
    assert isinstance(ids, tuple)
    return _plan_prepare(host, counters, bounds, ids, stream, clear_victim_entry=False)


EFFECTS: dict[str, EffectFn] = {
    "plan_prepare": plan_prepare,
    "plan_invalidate": plan_invalidate,
    "no_change": no_change,
    "plan_prepare_unprotected_victim": plan_prepare_unprotected_victim,
    "plan_prepare_forward_from_resident": plan_prepare_forward_from_resident,
    "plan_prepare_keep_victim_mapped": plan_prepare_keep_victim_mapped,
}


# ---------------------------------------------------------------- pre-guard effects (mutants)


def touch_requested(host: HostState, bounds: Bounds, args: Args) -> HostState:
    """Move every requested resident expert to most recently used (before validation)."""
    ids = args[0]
    assert isinstance(ids, tuple)
    touched = [e for e in ids if isinstance(e, int) and e in host.lru]
    lru = tuple(e for e in host.lru if e not in touched) + tuple(dict.fromkeys(touched))
    return host._replace(lru=lru)


PRE_GUARD_EFFECTS: dict[str, PreGuard] = {"touch_requested": touch_requested}

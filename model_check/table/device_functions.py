"""What the device-planned path's kernels compute, and the reference they are held to.

The device cache state is a `HostState` of the host path's reference (LRU order and resident
map; owner and forward unused): the planner's slot owners are the inverse of the resident map,
and its last-use stamps and clock exist to give the LRU order, which is what is kept. `Dev` is
everything a forward reads or writes on the device.

Functions named by the table (`fn` of a step) are registered here under their names, with the
buggy twins the mutants swap in. The reference a checker compares with is not named by the
table: it is the host path's `plan_prepare` on the pass's group and `plan_invalidate`, applied
in host-call order (`reference_pass`), so a mutant cannot change it.

Every function here is pure, and the searches call them on few distinct arguments many times
over: they are memoized.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import NamedTuple

from model_check.table.reference import (
    NO_SLOT,
    NO_STREAM,
    Bounds,
    Counters,
    HostState,
    _plan_prepare,
    expert_outside,
    initial_host,
    plan_invalidate,
)

Pairs = tuple[tuple[int, int], ...]
NO_ENTRY = (NO_SLOT, NO_SLOT)


class Dev(NamedTuple):
    """The device buffers of one layer's cache."""

    cache: HostState  # LRU order and resident map (owner NO_STREAM, forward None)
    fwd: Pairs  # the forward map: (expert, slot) of every exposed expert
    misses: Pairs  # the miss list, `capacity` entries; those past the count are left over
    n_miss: int  # the miss count
    err: bool  # the error counters are non-zero (bad ids or overflow counted since the reset)
    slots: tuple[int, ...]  # the expert whose rows each slot holds


def empty_cache(bounds: Bounds) -> HostState:
    return initial_host(bounds)


def initial_dev(bounds: Bounds) -> Dev:
    return Dev(
        cache=empty_cache(bounds),
        fwd=(),
        misses=(NO_ENTRY,) * bounds.capacity,
        n_miss=0,
        err=False,
        slots=(NO_SLOT,) * bounds.capacity,
    )


def num_passes(ids: tuple[int, ...], bounds: Bounds) -> int:
    """rowcache.device_plan.passes.num_passes: fixed by the number of entries (the shape)."""
    reachable = min(len(ids), bounds.num_experts)
    return max(1, -(-reachable // bounds.capacity))


class Selection(NamedTuple):
    group: tuple[int, ...]  # the experts this pass exposes, ascending
    error: bool  # the pass counts an error (a bad id on the first pass, overflow on the last)
    order: tuple[int, ...]  # the step's order in force after this pass (HostState.step)
    step: tuple[int, ...]  # the step's experts this call requests: protected from eviction


def _requested(ids: tuple[int, ...], bounds: Bounds, checked: bool) -> list[int]:
    n = bounds.num_experts
    return sorted({e for e in ids if (0 <= e < n if checked else e != -1)})


@cache
def select(
    ids: tuple[int, ...],
    p: int,
    passes: int,
    bounds: Bounds,
    cache: HostState,
    *,
    checked: bool = True,
    hits_first: bool = True,
) -> Selection:
    """Pass `p` of `passes`, planned on the device state `cache`, exposes the positions
    [p*C, (p+1)*C) of the step's order that `ids` requests. The first pass fixes the order
    (`step_order`: the step's hits first, then its misses, each in ascending id order) from
    the state it finds; later passes read it from `cache.step`. -1 is padding; other ids
    outside [0, E) are ignored and counted (first pass only); more distinct experts than the
    passes expose are counted on the last pass. The passes of one step are called in order
    with the same ids (`run_with_expert_cache` does): a later pass exposes only what the
    first one ordered.

    The order is stored only when it reaches past the first pass: a shorter one gives a later
    pass nothing to expose and nothing to protect, so every short order behaves as () does."""
    cap = bounds.capacity
    requested = _requested(ids, bounds, checked)
    valid = _requested(ids, bounds, True)
    bad = any(e != -1 and not 0 <= e < bounds.num_experts for e in ids)
    if p == 0:
        if hits_first:
            slot_of = cache.slot_of
            hit = [e for e in requested if 0 <= e < len(slot_of) and slot_of[e] != NO_SLOT]
            order = tuple(hit + [e for e in requested if e not in hit])
        else:
            order = tuple(requested)
    else:
        order = cache.step
    wanted = set(requested)
    group = tuple(sorted(e for e in order[p * cap : (p + 1) * cap] if e in wanted))
    overflow = p == passes - 1 and len(valid) > passes * cap
    stored = order if len(order) > cap else ()
    step = tuple(e for e in stored if e in wanted) if stored else group
    return Selection(group, (bad and p == 0) or overflow, stored, step)


class PlanOut(NamedTuple):
    dev: Dev
    group: tuple[int, ...]  # what the pass had to expose (the reference's group)
    victims: tuple[int, ...]
    out_of_bounds: tuple[int, ...]  # ids the planner used as an index outside [0, E)
    step: tuple[int, ...]  # the step's experts the reference protects (P5)
    spared: tuple[int, ...]  # residents outside the step that the pass left resident
    by_count: bool = False  # policy "lfu": a victim least recent use would not have chosen
    halved: bool = False  # policy "lfu": every count was halved


@cache
def _plan(
    dev: Dev,
    ids: tuple[int, ...],
    p: int,
    passes: int,
    bounds: Bounds,
    *,
    protect: bool = True,
    protect_step: bool = True,
    hits_first: bool = True,
    keep_forward: bool = False,
    accumulate_errors: bool = True,
    checked: bool = True,
    by_count: bool = True,
) -> PlanOut:
    sel = select(ids, p, passes, bounds, dev.cache, checked=checked, hits_first=hits_first)
    oob = tuple(e for e in sel.group if not 0 <= e < bounds.num_experts)
    group = tuple(e for e in sel.group if 0 <= e < bounds.num_experts)
    step = sel.step if protect_step else ()
    eff = _plan_prepare(
        dev.cache,
        Counters(),
        bounds,
        group,
        NO_STREAM,
        step=step,
        protect_requested=protect,
        victims_by_count=by_count,
    )
    cache = eff.host._replace(owner=NO_STREAM, forward=None, step=sel.order)
    assert eff.host.forward is not None
    fwd = eff.host.forward
    if keep_forward:
        fwd = tuple(sorted({*fwd, *((e, s) for e, s in dev.fwd if e not in group)}))
    copies = eff.copies
    misses = copies + dev.misses[len(copies) :]
    err = (dev.err or sel.error) if accumulate_errors else sel.error
    reference = select(ids, p, passes, bounds, dev.cache)
    spared = tuple(e for e in cache.lru if e not in reference.step)
    return PlanOut(
        dev._replace(cache=cache, fwd=fwd, misses=misses, n_miss=len(copies), err=err),
        reference.group,
        eff.victims,
        oob,
        reference.step,
        spared,
        eff.by_count,
        eff.halved,
    )


PlanFn = Callable[[Dev, tuple[int, ...], int, int, Bounds], PlanOut]


def plan_pass(dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds) -> PlanOut:
    """The planner: the host path's plan_prepare on the pass's group (LRU, free slots first,
    victims outside the step first, never one the pass exposes); the forward map exposes
    exactly the group; the miss list's first `count` entries are the copies; errors accumulate
    until reset."""
    return _plan(dev, ids, p, passes, bounds)


def plan_pass_protects_pass_only(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    """Protection limited to the pass, the passes in id order. With the hits first, limiting
    the protection to the pass changes nothing: the first pass exposes every requested
    resident and fills the slots it does not keep, so no later pass finds a resident outside
    the step (`plan_pass_protects_pass_only_hits_first`, equivalent to `plan_pass`)."""
    return _plan(dev, ids, p, passes, bounds, protect_step=False, hits_first=False)


def plan_pass_protects_pass_only_hits_first(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    return _plan(dev, ids, p, passes, bounds, protect_step=False)


def plan_pass_hits_not_first(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    return _plan(dev, ids, p, passes, bounds, hits_first=False)


def plan_pass_unprotected_victim(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    # Any resident, oldest first: with the step's tiers kept, the hits-first order would never
    # reach a selected expert, and the bug would not show.
    return _plan(dev, ids, p, passes, bounds, protect=False, protect_step=False)


def plan_pass_by_recency(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    """Policy lfu's counts kept but never read: victims by recency alone (the same as
    `plan_pass` under lru)."""
    return _plan(dev, ids, p, passes, bounds, by_count=False)


def plan_pass_stale_forward(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    return _plan(dev, ids, p, passes, bounds, keep_forward=True)


def plan_pass_resets_errors(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    return _plan(dev, ids, p, passes, bounds, accumulate_errors=False)


def plan_pass_unchecked_ids(
    dev: Dev, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> PlanOut:
    return _plan(dev, ids, p, passes, bounds, checked=False)


GatherFn = Callable[[Dev], Pairs]


def gather_listed(dev: Dev) -> Pairs:
    """The copies the gather makes: the first `count` entries of the miss list."""
    return dev.misses[: dev.n_miss]


def gather_whole_list(dev: Dev) -> Pairs:
    return tuple(entry for entry in dev.misses if entry[0] >= 0)


@cache
def run_gather(fn: GatherFn, dev: Dev) -> Dev:
    slots = list(dev.slots)
    for expert, slot in fn(dev):
        slots[slot] = expert
    return dev._replace(slots=tuple(slots))


FreeFn = Callable[[Dev, int, Bounds], Dev]


def free_expert(dev: Dev, expert: int, bounds: Bounds) -> Dev:
    """invalidate's kernel: the host path's plan_invalidate on the device state."""
    eff = plan_invalidate(dev.cache, Counters(), bounds, (expert,), NO_STREAM)
    return dev._replace(cache=eff.host)


FUNCTIONS: dict[str, dict[str, object]] = {
    "plan": {
        "plan_pass": plan_pass,
        "plan_pass_unprotected_victim": plan_pass_unprotected_victim,
        "plan_pass_protects_pass_only": plan_pass_protects_pass_only,
        "plan_pass_protects_pass_only_hits_first": plan_pass_protects_pass_only_hits_first,
        "plan_pass_hits_not_first": plan_pass_hits_not_first,
        "plan_pass_stale_forward": plan_pass_stale_forward,
        "plan_pass_by_recency": plan_pass_by_recency,
        "plan_pass_resets_errors": plan_pass_resets_errors,
        "plan_pass_unchecked_ids": plan_pass_unchecked_ids,
    },
    "gather": {"gather_listed": gather_listed, "gather_whole_list": gather_whole_list},
    "free_slot": {"free_expert": free_expert},
}


# What each function reads beyond the reference's inputs (device_program.forget_dead uses it): the
# previous forward map, the miss list's entries past the count.
READS_FORWARD = {"plan_pass_stale_forward"}
# Functions that leave the cache state and the forward map exactly as the reference does
# (tests/test_device_path_model.py checks it on every reachable state).
SAME_STATE_AS_REFERENCE = {
    "plan_pass",
    "plan_pass_resets_errors",
    "plan_pass_unchecked_ids",
    "free_expert",
}
READS_PAST_COUNT = {"gather_whole_list"}


def plan_fn(name: str) -> PlanFn:
    fn = FUNCTIONS["plan"][name]
    return fn  # type: ignore[return-value]


def gather_fn(name: str) -> GatherFn:
    fn = FUNCTIONS["gather"][name]
    return fn  # type: ignore[return-value]


def free_fn(name: str) -> FreeFn:
    fn = FUNCTIONS["free_slot"][name]
    return fn  # type: ignore[return-value]


# ---------------------------------------------------------------- the reference, in host order


@cache
def reference_pass(
    ghost: HostState, ids: tuple[int, ...], p: int, passes: int, bounds: Bounds
) -> tuple[HostState, Pairs, bool]:
    """The reference of one pass: (state, forward map, error counted)."""
    sel = select(ids, p, passes, bounds, ghost)
    eff = _plan_prepare(ghost, Counters(), bounds, sel.group, NO_STREAM, step=sel.step)
    assert eff.host.forward is not None
    state = eff.host._replace(owner=NO_STREAM, forward=None, step=sel.order)
    return state, eff.host.forward, sel.error


@cache
def reference_free(ghost: HostState, expert: int, bounds: Bounds) -> HostState:
    return plan_invalidate(ghost, Counters(), bounds, (expert,), NO_STREAM).host


# ---------------------------------------------------------------- guards (host-side checks)

Args = tuple[object, ...]
Guard = Callable[[Args, bool, Bounds], "str | None"]  # (args, forward unread, bounds)


def valid_pass(args: Args, unread: bool, bounds: Bounds) -> str | None:
    ids, p = args[0], args[1]
    assert isinstance(ids, tuple) and isinstance(p, int)
    total = num_passes(ids, bounds)
    if not 0 <= p < total:
        return f"pass_index {p} outside [0, {total}) for this step"
    return None


def valid_invalidate(args: Args, unread: bool, bounds: Bounds) -> str | None:
    return expert_outside(args[0], bounds)


def forward_unread(args: Args, unread: bool, bounds: Bounds) -> str | None:
    return None if unread else "no pass whose forward map is still to be read"


def always(args: Args, unread: bool, bounds: Bounds) -> str | None:
    return None


GUARDS: dict[str, Guard] = {
    "valid_pass": valid_pass,
    "valid_invalidate": valid_invalidate,
    "forward_unread": forward_unread,
    "always": always,
}


# ---------------------------------------------------------------- checks of a plan's result


@cache
def plan_verdict(out: PlanOut, ids: tuple[int, ...]) -> tuple[str, str] | None:
    """P9 (nothing written out of bounds), P5 and P3 on one pass's result."""
    if out.out_of_bounds:
        return (
            "P9_device_errors_reported",
            f"the plan of {ids} used id(s) {list(out.out_of_bounds)} as an index outside the maps",
        )
    evicted = set(out.victims) & set(out.group)
    if evicted:
        return (
            "P5_victim_protection",
            f"the plan of {ids} evicted expert(s) {sorted(evicted)} its pass exposes",
        )
    from_step = set(out.victims) & set(out.step)
    if from_step and out.spared:
        return (
            "P5_victim_protection",
            f"the plan of {ids} evicted expert(s) {sorted(from_step)} its step requests while "
            f"expert(s) {list(out.spared)} outside the step stayed resident",
        )
    fwd = out.dev.fwd
    experts = sorted(e for e, _ in fwd)
    slots = [s for _, s in fwd]
    if experts != sorted(out.group) or len(set(slots)) != len(slots):
        return (
            "P3_forward_map_exact",
            f"the plan of {ids} exposes {pairs_text(fwd)}, its pass selects {list(out.group)}",
        )
    for e, s in fwd:
        if out.dev.cache.slot_of[e] != s:
            return (
                "P3_forward_map_exact",
                f"the forward map puts expert {e} in slot {s}, the resident map in "
                f"slot {out.dev.cache.slot_of[e]}",
            )
    return None


def pairs_text(pairs: Pairs) -> str:
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


def _counts_text(state: HostState) -> str:
    return f", counts {list(state.counts)}" if state.counts else ""


@cache
def converged(dev: Dev, ghost: HostState) -> str | None:
    """P4: the device state equals the reference applied in host-call order, and every mapped
    slot holds its expert. None when it does."""
    if (
        dev.cache.slot_of != ghost.slot_of
        or dev.cache.lru != ghost.lru
        or dev.cache.counts != ghost.counts
    ):
        return (
            f"the device state (resident {list(dev.cache.slot_of)}, LRU {list(dev.cache.lru)}"
            f"{_counts_text(dev.cache)}) is not the reference's (resident "
            f"{list(ghost.slot_of)}, LRU {list(ghost.lru)}{_counts_text(ghost)})"
        )
    for expert, slot in enumerate(ghost.slot_of):
        if slot != NO_SLOT and dev.slots[slot] != expert:
            held = dev.slots[slot]
            return f"the map names expert {expert} in slot {slot}, which holds expert {held}"
    return None

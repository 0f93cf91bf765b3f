"""The reference host functions (`table.reference`) written once over values that may be symbolic.

Every function here takes and returns plain Python values *or* z3 terms: the primitives
(`ite`, `conj`, `disj`, `neg`, `count`) fold when their arguments are concrete and build z3
terms otherwise, and the code never branches in Python on a value that may be symbolic. Run on
concrete values it is an executable twin of `table.reference`, which is how the tests prove it equal
to the reference on every host state reachable within the bounds; run on z3 constants it is
the encoding the bounded model checker unrolls. The two runs are the same code path.

The functions are registered under the names the table uses, so the encoding is selected by
the table's `guard`, `effect` and `before_guard` names; a mutant that swaps a name swaps the
symbolic function too.

Host state, symbolically (`SymHost`):
    slot[e]      resident-map mirror, NO_SLOT (-1) when absent
    inlru[e]     e is in the LRU list
    rank[e]      LRU position as a number: larger is more recent (only compared among inlru)
    owner        the owner stream, NO_STREAM (-1) before the first accepted prepare
    has_fwd      a forward map exists (an accepted prepare happened)
    fwd[e]       e is exposed by the forward map, fwd_slot[e] its slot there
A call's arguments (`SymArgs`): `req[e]` the in-range experts named by `ids`, `bad` when `ids`
also has an out-of-range or repeated entry, `expert` the argument of invalidate (num_experts
stands for out of range). Requested experts are refreshed in id order, as the reference does
for the explorer's calls (ids in increasing order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import z3
from z3.z3 import Z3_mk_ite, _to_expr_ref

from model_check.table.reference import NO_SLOT, NO_STREAM, Bounds, Effect, HostState

# A value that is either concrete (bool / int) or a z3 term.
Bool = Any
Int = Any


def _const(x: Bool) -> bool | None:
    """The truth value of x when it is known without solving, else None.

    One call into z3's C API (the literal ``true`` or ``false``, else undefined) rather than
    ``z3.is_true`` and ``z3.is_false``, which build the term's declaration to compare its kind:
    the encoders ask this of most terms they build, and that made up a third of their time."""
    if isinstance(x, bool):
        return x
    if isinstance(x, z3.BoolRef):
        value = z3.Z3_get_bool_value(x.ctx_ref(), x.as_ast())
        if value == z3.Z3_L_TRUE:
            return True
        if value == z3.Z3_L_FALSE:
            return False
    return None


def ite(c: Bool, a: Any, b: Any) -> Any:
    known = _const(c)
    if known is not None:
        return a if known else b
    if type(a) is type(b) and isinstance(a, (z3.BoolRef, z3.ArithRef)):
        # Three terms already: one Z3_mk_ite, where z3.If casts and coerces each argument
        # first (several calls into the C API a term; half of the encoders' time). Terms of
        # two sorts (an int and a real) are z3.If's to coerce: z3 refuses them here.
        try:
            return _to_expr_ref(Z3_mk_ite(c.ctx.ref(), c.as_ast(), a.as_ast(), b.as_ast()), c.ctx)
        except z3.Z3Exception:
            pass
    return z3.If(c, a, b)


def conj(*xs: Bool) -> Bool:
    rest = []
    for x in xs:
        known = _const(x)
        if known is False:
            return False
        if known is None:
            rest.append(x)
    if not rest:
        return True
    return rest[0] if len(rest) == 1 else z3.And(*rest)


def disj(*xs: Bool) -> Bool:
    rest = []
    for x in xs:
        known = _const(x)
        if known is True:
            return True
        if known is None:
            rest.append(x)
    if not rest:
        return False
    return rest[0] if len(rest) == 1 else z3.Or(*rest)


def neg(x: Bool) -> Bool:
    known = _const(x)
    return (not known) if known is not None else z3.Not(x)


def implies(a: Bool, b: Bool) -> Bool:
    return disj(neg(a), b)


def count(xs: Sequence[Bool]) -> Int:
    total: Int = 0
    for x in xs:
        total = total + ite(x, 1, 0)
    return total


def select(index: Int, values: Sequence[Any], default: Any) -> Any:
    """values[index], or default when index is out of range (index may be symbolic)."""
    out = default
    for i in reversed(range(len(values))):
        out = ite(index == i, values[i], out)
    return out


class SymHost(NamedTuple):
    slot: tuple[Int, ...]
    inlru: tuple[Bool, ...]
    rank: tuple[Int, ...]
    owner: Int
    has_fwd: Bool
    fwd: tuple[Bool, ...]
    fwd_slot: tuple[Int, ...]


class SymArgs(NamedTuple):
    req: tuple[Bool, ...]
    bad: Bool
    expert: Int


class SymEffect(NamedTuple):
    host: SymHost
    miss: tuple[Bool, ...]  # expert is copied by this call (in id order)
    dest: tuple[Int, ...]  # the slot it is copied into
    victim: tuple[Bool, ...]  # expert is evicted by this call
    changed: Bool  # the resident map changed
    crash: Bool  # the concrete function would raise (no victim left): not a real call


def initial_sym_host(bounds: Bounds) -> SymHost:
    n = bounds.num_experts
    return SymHost(
        slot=(NO_SLOT,) * n,
        inlru=(False,) * n,
        rank=(0,) * n,
        owner=NO_STREAM,
        has_fwd=False,
        fwd=(False,) * n,
        fwd_slot=(NO_SLOT,) * n,
    )


def lru_order_equal(a: SymHost, b: SymHost) -> Bool:
    """The two LRU lists are equal (same members in the same order)."""
    n = len(a.slot)
    parts: list[Bool] = []
    for x in range(n):
        parts.append(a.inlru[x] == b.inlru[x])
        for y in range(x + 1, n):
            both = conj(a.inlru[x], a.inlru[y])
            parts.append(implies(both, (a.rank[x] < a.rank[y]) == (b.rank[x] < b.rank[y])))
    return conj(*parts)


def host_equal(a: SymHost, b: SymHost) -> Bool:
    """Equality of the host states as reference.HostState values."""
    n = len(a.slot)
    fwd_same = conj(
        *(
            conj(a.fwd[x] == b.fwd[x], implies(a.fwd[x], a.fwd_slot[x] == b.fwd_slot[x]))
            for x in range(n)
        )
    )
    return conj(
        lru_order_equal(a, b),
        *(a.slot[x] == b.slot[x] for x in range(n)),
        a.owner == b.owner,
        a.has_fwd == b.has_fwd,
        implies(a.has_fwd, fwd_same),
    )


# ---------------------------------------------------------------- guards


def sym_valid_prepare(host: SymHost, args: SymArgs, bounds: Bounds) -> Bool:
    return conj(neg(args.bad), count(args.req) <= bounds.capacity)


def sym_valid_invalidate(host: SymHost, args: SymArgs, bounds: Bounds) -> Bool:
    return conj(args.expert >= 0, args.expert < bounds.num_experts)


def sym_has_forward(host: SymHost, args: SymArgs, bounds: Bounds) -> Bool:
    return host.has_fwd


def sym_always(host: SymHost, args: SymArgs, bounds: Bounds) -> Bool:
    return True


SymGuard = Callable[[SymHost, SymArgs, Bounds], Bool]
SYM_GUARDS: dict[str, SymGuard] = {
    "valid_prepare": sym_valid_prepare,
    "valid_invalidate": sym_valid_invalidate,
    "has_forward": sym_has_forward,
    "always": sym_always,
}


# ---------------------------------------------------------------- effects


def _sym_plan_prepare(
    host: SymHost,
    args: SymArgs,
    bounds: Bounds,
    top: Int,
    *,
    protect_requested: bool = True,
    forward_from_resident: bool = False,
    clear_victim_entry: bool = True,
    step: tuple[Bool, ...] | None = None,
) -> SymEffect:
    """reference._plan_prepare: misses take free slots lowest first (in id order), then the
    slots of victims, least recently used first among the candidates; with `step` (the experts
    the pass's step requests), candidates outside the step first."""
    if bounds.policy != "lru":
        # The victim order is the LRU rank alone here; the explicit searches check "lfu".
        raise ValueError(f"the z3 encoding models policy 'lru' only, got {bounds.policy!r}")
    n, cap = bounds.num_experts, bounds.capacity
    req, slot, inlru, rank = args.req, host.slot, host.inlru, host.rank
    miss = tuple(conj(req[e], slot[e] == NO_SLOT) for e in range(n))
    free = tuple(conj(*(slot[e] != s for e in range(n))) for s in range(cap))
    n_free = count(free)
    free_before = [count(free[:s]) for s in range(cap)]
    cand = tuple(conj(inlru[x], neg(req[x])) if protect_requested else inlru[x] for x in range(n))
    # Position of each candidate in LRU order (ranks of LRU members are distinct).
    if step is None:
        cpos = [
            count([conj(cand[y], rank[y] < rank[x]) for y in range(n) if y != x]) for x in range(n)
        ]
    else:
        st = step
        cpos = [
            count(
                [
                    conj(
                        cand[y],
                        disj(conj(neg(st[y]), st[x]), conj(st[y] == st[x], rank[y] < rank[x])),
                    )
                    for y in range(n)
                    if y != x
                ]
            )
            for x in range(n)
        ]
    n_miss = count(miss)
    victim = tuple(conj(cand[x], cpos[x] + n_free < n_miss) for x in range(n))
    crash = n_miss - n_free > count(cand)
    dest: list[Int] = []
    for e in range(n):
        k = count(miss[:e])  # index of e among the misses
        free_slot: Int = NO_SLOT
        for s in reversed(range(cap)):
            free_slot = ite(conj(free[s], free_before[s] == k), s, free_slot)
        victim_slot: Int = NO_SLOT
        for x in reversed(range(n)):
            victim_slot = ite(conj(cand[x], cpos[x] == k - n_free), slot[x], victim_slot)
        dest.append(ite(miss[e], ite(k < n_free, free_slot, victim_slot), NO_SLOT))
    new_slot = tuple(
        ite(miss[e], dest[e], ite(victim[e], NO_SLOT, slot[e]) if clear_victim_entry else slot[e])
        for e in range(n)
    )
    new_inlru = tuple(disj(conj(inlru[e], neg(victim[e])), miss[e]) for e in range(n))
    new_rank = tuple(ite(req[e], top + e, rank[e]) for e in range(n))
    if forward_from_resident:
        fwd = tuple(new_slot[e] != NO_SLOT for e in range(n))
        fwd_slot = tuple(ite(fwd[e], new_slot[e], NO_SLOT) for e in range(n))
    else:
        fwd = tuple(req)
        fwd_slot = tuple(ite(req[e], ite(miss[e], dest[e], slot[e]), NO_SLOT) for e in range(n))
    changed = disj(*(new_slot[e] != slot[e] for e in range(n)))
    new = SymHost(new_slot, new_inlru, new_rank, host.owner, True, fwd, fwd_slot)
    return SymEffect(new, miss, tuple(dest), victim, changed, crash)


def sym_plan_prepare(host: SymHost, args: SymArgs, bounds: Bounds, top: Int) -> SymEffect:
    return _sym_plan_prepare(host, args, bounds, top)


def sym_plan_prepare_unprotected_victim(
    host: SymHost, args: SymArgs, bounds: Bounds, top: Int
) -> SymEffect:
    return _sym_plan_prepare(host, args, bounds, top, protect_requested=False)


def sym_plan_prepare_forward_from_resident(
    host: SymHost, args: SymArgs, bounds: Bounds, top: Int
) -> SymEffect:
    return _sym_plan_prepare(host, args, bounds, top, forward_from_resident=True)


def sym_plan_prepare_keep_victim_mapped(
    host: SymHost, args: SymArgs, bounds: Bounds, top: Int
) -> SymEffect:
    return _sym_plan_prepare(host, args, bounds, top, clear_victim_entry=False)


def _no_effect(host: SymHost, bounds: Bounds) -> SymEffect:
    n = bounds.num_experts
    none = (False,) * n
    return SymEffect(host, none, (NO_SLOT,) * n, none, False, False)


def sym_plan_invalidate(host: SymHost, args: SymArgs, bounds: Bounds, top: Int) -> SymEffect:
    n = bounds.num_experts
    hit = tuple(conj(args.expert == e, host.slot[e] != NO_SLOT) for e in range(n))
    new = host._replace(
        slot=tuple(ite(hit[e], NO_SLOT, host.slot[e]) for e in range(n)),
        inlru=tuple(conj(host.inlru[e], neg(args.expert == e)) for e in range(n)),
    )
    # A call that finds the expert absent changes nothing (not even the LRU list).
    changed = disj(*hit)
    effect = _no_effect(host, bounds)
    return effect._replace(host=_merge_host(changed, new, host), changed=changed)


def sym_no_change(host: SymHost, args: SymArgs, bounds: Bounds, top: Int) -> SymEffect:
    return _no_effect(host, bounds)


SymEffectFn = Callable[[SymHost, SymArgs, Bounds, Int], SymEffect]
SYM_EFFECTS: dict[str, SymEffectFn] = {
    "plan_prepare": sym_plan_prepare,
    "plan_invalidate": sym_plan_invalidate,
    "no_change": sym_no_change,
    "plan_prepare_unprotected_victim": sym_plan_prepare_unprotected_victim,
    "plan_prepare_forward_from_resident": sym_plan_prepare_forward_from_resident,
    "plan_prepare_keep_victim_mapped": sym_plan_prepare_keep_victim_mapped,
}


class EffectFacts(NamedTuple):
    """What the induction's abstract host needs to know about an effect (tests check these
    against the concrete function on every reachable host state):
    sets_forward    an accepted call leaves a forward map
    may_copy        an accepted call may copy experts
    may_change      an accepted call may change the resident map
    change_needs_forward  the map changes only if an expert is resident, which needs an
                    earlier accepted prepare (so a forward map exists)
    change_needs_copy     the map changes only when the call copies (a prepare maps a new
                    expert only by copying it; its hit path relies on this)"""

    sets_forward: bool
    may_copy: bool
    may_change: bool
    change_needs_forward: bool
    change_needs_copy: bool


_PREPARE_FACTS = EffectFacts(True, True, True, False, True)
EFFECT_FACTS: dict[str, EffectFacts] = {
    "plan_prepare": _PREPARE_FACTS,
    "plan_invalidate": EffectFacts(False, False, True, True, False),
    "no_change": EffectFacts(False, False, False, False, False),
    "plan_prepare_unprotected_victim": _PREPARE_FACTS,
    "plan_prepare_forward_from_resident": _PREPARE_FACTS,
    "plan_prepare_keep_victim_mapped": _PREPARE_FACTS,
}

# Guards the abstract host can decide: "has_forward" needs a forward map; the others may reject
# any call, except "always".
GUARD_NEEDS_FORWARD = {"has_forward"}
GUARD_ALWAYS = {"always"}


# ---------------------------------------------------------------- pre-guard effects


def sym_touch_requested(host: SymHost, args: SymArgs, bounds: Bounds, top: Int) -> SymHost:
    n = bounds.num_experts
    touched = tuple(conj(args.req[e], host.inlru[e]) for e in range(n))
    return host._replace(rank=tuple(ite(touched[e], top + e, host.rank[e]) for e in range(n)))


SymPreGuard = Callable[[SymHost, SymArgs, Bounds, Int], SymHost]
SYM_PRE_GUARD: dict[str, SymPreGuard] = {"touch_requested": sym_touch_requested}


def _merge_host(c: Bool, a: SymHost, b: SymHost) -> SymHost:
    return SymHost(*(merge(c, x, y) for x, y in zip(a, b, strict=True)))


def merge(c: Bool, a: Any, b: Any) -> Any:
    """ite over equally shaped (nested) tuples."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        return tuple(merge(c, x, y) for x, y in zip(a, b, strict=True))
    return ite(c, a, b)


# ---------------------------------------------------------------- concrete <-> symbolic


def host_to_sym(host: HostState, bounds: Bounds) -> SymHost:
    n = bounds.num_experts
    fwd = dict(host.forward or ())
    return SymHost(
        slot=tuple(host.slot_of),
        inlru=tuple(e in host.lru for e in range(n)),
        rank=tuple(host.lru.index(e) if e in host.lru else 0 for e in range(n)),
        owner=host.owner,
        has_fwd=host.forward is not None,
        fwd=tuple(e in fwd for e in range(n)),
        fwd_slot=tuple(fwd.get(e, NO_SLOT) for e in range(n)),
    )


def sym_to_host(sym: SymHost) -> HostState:
    """Back to a HostState (all fields concrete)."""
    n = len(sym.slot)
    members = [e for e in range(n) if sym.inlru[e]]
    lru = tuple(sorted(members, key=lambda e: int(sym.rank[e])))
    forward = (
        tuple((e, int(sym.fwd_slot[e])) for e in range(n) if sym.fwd[e]) if sym.has_fwd else None
    )
    return HostState(
        lru=lru, slot_of=tuple(int(s) for s in sym.slot), owner=int(sym.owner), forward=forward
    )


def args_to_sym(op_args: Sequence[str], args: tuple[object, ...], bounds: Bounds) -> SymArgs:
    """The symbolic form of a concrete call's arguments (ids in increasing order, possibly
    with out-of-range or repeated entries)."""
    n = bounds.num_experts
    req: tuple[Bool, ...] = (False,) * n
    bad: Bool = False
    expert: Int = 0
    for name, value in zip(op_args, args, strict=True):
        if name == "ids":
            assert isinstance(value, tuple)
            ints = [e for e in value if isinstance(e, int) and 0 <= e < n]
            req = tuple(e in ints for e in range(n))
            bad = len(ints) != len(value) or len(set(ints)) != len(ints)
        elif name == "expert":
            assert isinstance(value, int)
            expert = value if 0 <= value < n else n
        else:
            raise ValueError(f"no symbolic form for argument {name!r}")
    return SymArgs(req, bad, expert)


def sym_args_text(op_args: Sequence[str], args: SymArgs, bounds: Bounds) -> tuple[object, ...]:
    """A concrete call whose symbolic form is `args` (all fields concrete)."""
    n = bounds.num_experts
    out: list[object] = []
    for name in op_args:
        if name == "ids":
            ids = [e for e in range(n) if args.req[e]]
            if args.bad:
                ids = [*ids, ids[0]] if ids else [n]
            out.append(tuple(ids))
        elif name == "expert":
            out.append(int(args.expert))
    return tuple(out)


def effect_matches(sym: SymEffect, effect: Effect, bounds: Bounds) -> list[str]:
    """Differences between a concrete-valued symbolic effect and the reference Effect."""
    diffs: list[str] = []
    host = sym_to_host(sym.host)
    if host._replace(owner=effect.host.owner) != effect.host:
        diffs.append(f"host {host} != {effect.host}")
    copies = tuple((e, int(sym.dest[e])) for e in range(bounds.num_experts) if sym.miss[e])
    if copies != effect.copies:
        diffs.append(f"copies {copies} != {effect.copies}")
    victims = {e for e in range(bounds.num_experts) if sym.victim[e]}
    if victims != set(effect.victims):
        diffs.append(f"victims {sorted(victims)} != {sorted(effect.victims)}")
    if bool(sym.changed) != effect.changed:
        diffs.append(f"changed {sym.changed} != {effect.changed}")
    return diffs

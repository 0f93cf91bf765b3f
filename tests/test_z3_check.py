"""model_check.z3: the z3 encoding of the table, its bounded check, its induction, mutants.

The encoding is trusted only as far as these tests go:
- the symbolic host functions equal table.reference on every host state reachable within the
  bounds, for every call the explorer makes and every rejected call the encoding allows, for
  the real effects and every mutant effect (so a mutant is never killed by a difference
  between the two), and their z3 terms evaluate like the Python run of the same code;
- the facts the induction assumes about each effect hold on every reachable state;
- the real table passes the bounded check at the explorer's bounds, with every reachability
  observation reached, and the induction proves the ordering properties;
- every mutant is killed, by the property it was seeded against, with a counterexample that
  another device model confirms on replay.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from itertools import combinations
from typing import Any

import pytest
import z3

from model_check.search.models import host_actions
from model_check.table import Step, Table, load_table
from model_check.table.host import Accepted, Rejected, begin_call, finish_host
from model_check.table.mutants import MUTANTS, Mutant
from model_check.table.properties import PROPERTIES
from model_check.table.reference import (
    EFFECTS,
    GUARDS,
    PRE_GUARD_EFFECTS,
    Bounds,
    Counters,
    HostState,
    initial_host,
)
from model_check.z3.check import (
    CONFIGURATIONS,
    REACHABILITY,
    Z3Report,
    check_table,
    replay_hb,
)
from model_check.z3.host import (
    EFFECT_FACTS,
    SYM_EFFECTS,
    SYM_GUARDS,
    SYM_PRE_GUARD,
    SymArgs,
    SymEffect,
    SymHost,
    args_to_sym,
    effect_matches,
    host_to_sym,
    sym_args_text,
    sym_to_host,
)
from model_check.z3.induction import ORDERING, check_invariant, prove
from model_check.z3.invariant import differences, load_invariant
from model_check.z3.streams import P1, P2, P4, P6, P7, P8

TABLE = load_table()
Call = tuple[str, tuple[object, ...], int]


# ---------------------------------------------------------------- variants of the host side


def host_variants() -> list[tuple[str, Table]]:
    """The real table and every table a mutant makes by renaming a reference function."""
    prepare = TABLE.op("prepare")
    out = [("real", TABLE)]
    for effect in SYM_EFFECTS:
        if effect.startswith("plan_prepare_"):
            out.append((effect, TABLE.with_op(replace(prepare, effect=effect))))
    for name in SYM_PRE_GUARD:
        out.append((name, TABLE.with_op(replace(prepare, before_guard=(name,)))))
    return out


@functools.cache
def calls(bounds: Bounds) -> list[Call]:
    """The explorer's host calls, plus every rejected prepare the encoding can express (a set
    of in-range experts with a repeated entry, or one out-of-range id)."""
    out = [(a.op, a.args, a.stream) for a in host_actions(bounds)]
    n = bounds.num_experts
    for size in range(0, n + 1):
        for ids in combinations(range(n), size):
            bad = (*ids, ids[0]) if ids else (n,)
            out.append(("prepare", (bad,), 1))
            if size > bounds.capacity:
                out.append(("prepare", (ids,), 0))
    return list(dict.fromkeys(out))


DEPTH = dict(CONFIGURATIONS)
BOUNDS = list(DEPTH)


@functools.cache
def reachable(table: Table, bounds: Bounds) -> list[HostState]:
    """Host states reachable within the configuration's number of host calls (the states
    the bounded check can visit)."""
    seen = {initial_host(bounds)}
    frontier = [initial_host(bounds)]
    actions = calls(bounds)
    for _ in range(DEPTH[bounds]):
        work, frontier = frontier, []
        for host in work:
            _successors(table, bounds, host, actions, seen, frontier)
    return sorted(seen, key=repr)


def _successors(
    table: Table,
    bounds: Bounds,
    host: HostState,
    actions: list[Call],
    seen: set[HostState],
    frontier: list[HostState],
) -> None:
    for op, args, stream in actions:
        try:
            begun = begin_call(table, bounds, host, Counters(), op, args, stream)
        except IndexError:  # a mutant effect that runs out of victims
            continue
        if isinstance(begun, Rejected):
            nxt = begun.host
        else:
            nxt = finish_host(table.op(op), begun.effect, stream)
        if nxt not in seen:
            seen.add(nxt)
            frontier.append(nxt)


def sym_call(
    table: Table, bounds: Bounds, host: SymHost, op_name: str, args: SymArgs, top: object
) -> tuple[SymHost, object, SymEffect]:
    op = table.op(op_name)
    for name in op.before_guard:
        host = SYM_PRE_GUARD[name](host, args, bounds, top)
    ok = SYM_GUARDS[op.guard](host, args, bounds)
    return host, ok, SYM_EFFECTS[op.effect](host, args, bounds, top)


@pytest.mark.parametrize("bounds", BOUNDS, ids=lambda b: f"{b.num_experts}e{b.capacity}c")
@pytest.mark.parametrize("variant", host_variants(), ids=lambda v: v[0])
def test_symbolic_host_equals_reference(bounds: Bounds, variant: tuple[str, Table]) -> None:
    _, table = variant
    states = reachable(table, bounds)
    actions = [
        (op, args, stream, args_to_sym(table.op(op).args, args, bounds))
        for op, args, stream in calls(bounds)
    ]
    checked = 0
    for host in states:
        sym = host_to_sym(host, bounds)
        assert sym_to_host(sym) == host
        for op_name, args, stream, sargs in actions:
            pre, ok, eff = sym_call(table, bounds, sym, op_name, sargs, bounds.num_experts)
            try:
                begun = begin_call(table, bounds, host, Counters(), op_name, args, stream)
            except IndexError:  # the concrete function ran out of victims
                assert ok and eff.crash, (host, op_name, args)
                continue
            assert sym_to_host(pre) == begun.host, (host, op_name, args)
            if isinstance(begun, Rejected):
                assert ok is False, (host, op_name, args)
                continue
            assert isinstance(begun, Accepted)
            assert ok is True and eff.crash is False, (host, op_name, args)
            diffs = effect_matches(eff, begun.effect, bounds)
            assert not diffs, (host, op_name, args, diffs)
            checked += 1
    assert checked > len(states)


def test_sym_args_round_trip() -> None:
    bounds = Bounds(4, 3)
    for op_name, args, _ in calls(bounds):
        op = TABLE.op(op_name)
        sargs = args_to_sym(op.args, args, bounds)
        assert args_to_sym(op.args, sym_args_text(op.args, sargs, bounds), bounds) == sargs


def _z3_like(template: SymHost | SymArgs, prefix: str) -> tuple[object, list[object]]:
    """z3 constants shaped like a concrete host state or arguments."""
    made: list[object] = []

    def one(name: str, v: object) -> object:
        c = z3.Bool(f"{prefix}{name}") if isinstance(v, bool) else z3.Int(f"{prefix}{name}")
        made.append(c)
        return c

    fields: dict[str, Any] = {}
    for field, value in template._asdict().items():
        if isinstance(value, tuple):
            fields[field] = tuple(one(f"{field}{i}", v) for i, v in enumerate(value))
        else:
            fields[field] = one(field, value)
    return type(template)(**fields), made


def _flat(x: object) -> list[object]:
    if isinstance(x, tuple):
        return [y for v in x for y in _flat(v)]
    return [x]


def _value(v: object) -> object:
    v = z3.simplify(v) if isinstance(v, z3.ExprRef) else v
    if isinstance(v, z3.BoolRef):
        assert z3.is_true(v) or z3.is_false(v), v
        return z3.is_true(v)
    if isinstance(v, z3.IntNumRef):
        return v.as_long()
    return v


@pytest.mark.parametrize("variant", host_variants(), ids=lambda v: v[0])
def test_z3_terms_evaluate_like_python(variant: tuple[str, Table]) -> None:
    """The same code run on z3 constants gives terms that, with a reachable state and call
    substituted, simplify to what the Python run computes (a sample per operation)."""
    _, table = variant
    bounds = Bounds(3, 2)
    states = reachable(table, bounds)
    rng = random.Random(7)
    template = host_to_sym(states[0], bounds)
    sym_host, host_vars = _z3_like(template, "h_")
    top = z3.Int("top")
    for op_name in ("prepare", "invalidate"):
        op = table.op(op_name)
        targs = args_to_sym(op.args, (((0,),) if op_name == "prepare" else (0,)), bounds)
        sym_args, arg_vars = _z3_like(targs, "a_")
        terms = _flat(sym_call(table, bounds, sym_host, op_name, sym_args, top))  # type: ignore[arg-type]
        sample = [c for c in calls(bounds) if c[0] == op_name]
        for host in rng.sample(states, 25):
            conc = host_to_sym(host, bounds)
            for _, args, _ in rng.sample(sample, 6):
                cargs = args_to_sym(op.args, args, bounds)
                expect = _flat(sym_call(table, bounds, conc, op_name, cargs, bounds.num_experts))
                pairs = [
                    (v, z3.BoolVal(c) if isinstance(c, bool) else z3.IntVal(c))
                    for v, c in zip(
                        [*host_vars, *arg_vars, top],
                        [*_flat(conc), *_flat(cargs), bounds.num_experts],
                        strict=True,
                    )
                ]
                got = [
                    _value(z3.substitute(t, *pairs)) if isinstance(t, z3.ExprRef) else t
                    for t in terms
                ]
                assert got == expect, (host, op_name, args)


@pytest.mark.parametrize("bounds", BOUNDS, ids=lambda b: f"{b.num_experts}e{b.capacity}c")
@pytest.mark.parametrize("variant", host_variants(), ids=lambda v: v[0])
def test_effect_facts_hold(bounds: Bounds, variant: tuple[str, Table]) -> None:
    """What the induction assumes of each effect, on every reachable state and call."""
    _, table = variant
    actions = calls(bounds)
    for host in reachable(table, bounds):
        for op_name, args, stream in actions:
            try:
                begun = begin_call(table, bounds, host, Counters(), op_name, args, stream)
            except IndexError:
                continue
            if isinstance(begun, Rejected):
                continue
            op = table.op(op_name)
            facts = EFFECT_FACTS[op.effect]
            eff = begun.effect
            after = finish_host(op, eff, stream)
            if facts.sets_forward:
                assert after.forward is not None
            if host.forward is not None:
                assert after.forward is not None  # a forward map is never withdrawn
            if not facts.may_copy:
                assert not eff.copies
            if not facts.may_change:
                assert not eff.changed
            if facts.change_needs_forward and eff.changed:
                assert host.forward is not None
            if facts.change_needs_copy and eff.changed:
                assert eff.copies
            if op.guard == "has_forward":
                assert host.forward is not None
            # A resident expert needs an earlier accepted prepare, which set the owner.
            if any(s >= 0 for s in after.slot_of) and table.op("prepare").set_owner:
                assert after.owner >= 0


def test_every_effect_and_guard_has_a_symbolic_twin() -> None:
    assert set(SYM_EFFECTS) == set(EFFECTS)
    assert set(EFFECT_FACTS) == set(EFFECTS)
    assert set(SYM_GUARDS) == set(GUARDS)
    assert set(SYM_PRE_GUARD) == set(PRE_GUARD_EFFECTS)


# ---------------------------------------------------------------- the real table


@pytest.fixture(scope="module", params=CONFIGURATIONS, ids=lambda c: f"{c[0].num_experts}e")
def real_report(request: pytest.FixtureRequest) -> Z3Report:
    bounds, depth = request.param
    return check_table(TABLE, bounds, depth)


def test_real_table_passes_bmc(real_report: Z3Report) -> None:
    assert set(real_report.properties) == set(PROPERTIES)
    for prop, result in real_report.properties.items():
        assert result.verdict == "holds", (prop, result.counterexample)
    assert real_report.violation is None
    assert real_report.ok, real_report.text()


def test_real_table_is_not_vacuous(real_report: Z3Report) -> None:
    assert real_report.vacuous == [], real_report.text()
    assert set(REACHABILITY) <= set(real_report.reached)
    # No provider call of the real table synchronizes the host.
    assert real_report.reached["provider_sync_with_read_pending"] is False


def test_real_table_induction(real_report: Z3Report) -> None:
    ind = real_report.induction
    assert ind is not None
    assert ind.proved == dict.fromkeys(ORDERING, True), ind.counterexample
    assert all(ind.per_operation.values())
    assert set(ind.per_operation) == {op.name for op in TABLE.operations}
    # The invariant the issue anticipated is what Houdini keeps and the minimization needs.
    for clause in (
        "read pending => before the owner stream",
        "copy pending => before the owner stream",
        "map:resident pending => before the owner stream",
    ):
        assert clause in ind.invariant, ind.invariant


def test_real_table_induction_is_the_committed_invariant(real_report: Z3Report) -> None:
    """spec/invariant.toml pins the invariant; it is checked on its own and the search finds
    exactly it, with the same proved and vacuous properties."""
    ind = real_report.induction
    assert ind is not None and ind.committed is not None
    assert ind.committed.ok, ind.committed
    assert ind.matches_committed, ind.notes
    committed = load_invariant()
    assert committed is not None
    assert set(committed.invariant) == set(ind.invariant)
    assert set(committed.proves) == set(ORDERING)
    # No step of the real table is a wait_flag or a provider host_sync.
    assert set(committed.vacuous) == {P7, P8}


def test_a_changed_invariant_fails_the_check() -> None:
    committed = load_invariant()
    assert committed is not None
    result = prove(TABLE, Bounds(1, 1), committed=committed.invariant)
    assert not differences(committed, result, 2, 1)
    # A clause too few: the search finds one the file lacks.
    fewer = replace(committed, invariant=committed.invariant[1:])
    assert differences(fewer, result, 2, 1)
    # Every clause is needed: without it the rest is not inductive or lets a violation by.
    for clause in committed.invariant:
        weaker = [c for c in committed.invariant if c != clause]
        assert not check_invariant(TABLE, Bounds(1, 1), weaker).ok, clause
    without_owner = [c for c in committed.invariant if not c.startswith("prepared")]
    assert not all(check_invariant(TABLE, Bounds(1, 1), without_owner).per_operation.values())
    # A clause the template does not have is reported, not ignored.
    assert check_invariant(TABLE, Bounds(1, 1), ["read pending => maybe"]).unknown
    # An ordering mutant's table breaks the committed invariant.
    broken = next(m for m in MUTANTS if m.name == "no_release_wait").apply(TABLE)
    assert not check_invariant(broken, Bounds(1, 1), committed.invariant).ok


def test_report_text_names_every_property(real_report: Z3Report) -> None:
    text = real_report.text()
    for prop in PROPERTIES:
        assert prop in text
    assert "invariant:" in text


# ---------------------------------------------------------------- mutants


def _flag_on_ready_only(table: Table) -> Table:
    prepare = table.op("prepare")
    steps = tuple(
        replace(s, kind="wait_flag") if s.kind == "wait_event" and s.event == "ready" else s
        for s in prepare.steps
    )
    assert steps != prepare.steps
    return table.with_op(replace(prepare, steps=steps))


EXTRA = (
    Mutant(
        "wait_flag_on_ready_only",
        P7,
        "only the wait on ready waits for the event's latest record when it executes",
        _flag_on_ready_only,
    ),
)
ALL_MUTANTS = (*MUTANTS, *EXTRA)


def test_mutant_catalogue_covers_the_issue() -> None:
    """The issue's list, each a change of the table (steps, names, set_owner)."""
    broken = {m.breaks for m in ALL_MUTANTS}
    assert broken == set(PROPERTIES)
    for m in ALL_MUTANTS:
        assert m.apply(TABLE) != TABLE, m.name


@pytest.mark.parametrize("config", CONFIGURATIONS, ids=lambda c: f"{c[0].num_experts}e")
@pytest.mark.parametrize("mutant", ALL_MUTANTS, ids=lambda m: m.name)
def test_mutant_killed(mutant: Mutant, config: tuple[Bounds, int]) -> None:
    bounds, depth = config
    report = check_table(
        mutant.apply(TABLE),
        bounds,
        depth,
        induction=False,
        reachability=False,
        properties=(mutant.breaks,),
    )
    result = report.properties[mutant.breaks]
    assert result.verdict == "violated", mutant.name
    assert report.violation is not None and report.violation.prop == mutant.breaks
    assert result.counterexample and "violation:" in result.counterexample
    assert len(result.calls) >= 1
    # Another device model finds the same property on the same host calls.
    assert result.confirmed, (result.counterexample, result.replayed)


# Mutants of the device side: the reference functions are the real ones.
ORDERING_MUTANTS = [
    m
    for m in ALL_MUTANTS
    if m.breaks in ORDERING
    and all(
        (op.effect, op.before_guard) == (TABLE.op(op.name).effect, TABLE.op(op.name).before_guard)
        for op in m.apply(TABLE).operations
    )
]


@pytest.mark.parametrize("mutant", ORDERING_MUTANTS, ids=lambda m: m.name)
def test_induction_does_not_prove_an_ordering_mutant(mutant: Mutant) -> None:
    result = prove(mutant.apply(TABLE), Bounds(1, 1), minimize=False)
    assert not result.proved[mutant.breaks], mutant.name
    assert result.counterexample is not None


def test_full_check_of_a_mutant_prefers_a_confirmed_counterexample() -> None:
    """wait_for_latest_record: the flag over-approximation also reports P1/P4, which no
    other model confirms; the report's violation is the confirmed deadlock."""
    mutated = next(m for m in MUTANTS if m.name == "wait_for_latest_record").apply(TABLE)
    report = check_table(mutated, Bounds(3, 2), 4, induction=False, reachability=False)
    assert report.violation is not None
    assert report.violation.prop == P7
    assert report.properties[P7].confirmed


def test_counterexample_reads_as_host_calls() -> None:
    mutated = next(m for m in MUTANTS if m.name == "no_release_wait").apply(TABLE)
    report = check_table(
        mutated, Bounds(3, 2), 6, induction=False, reachability=False, properties=(P1,)
    )
    result = report.properties[P1]
    text = result.counterexample or ""
    lines = text.splitlines()
    assert lines[0].strip().startswith("1. prepare(")
    assert "read()" in text
    assert lines[-1].strip().startswith("violation: a copy is enqueued that is not ordered")
    found = replay_hb(mutated, Bounds(3, 2), result.calls)
    assert found is not None and P1 in found


def test_bmc_without_folded_reads_still_kills() -> None:
    mutated = next(m for m in MUTANTS if m.name == "no_ready_wait").apply(TABLE)
    report = check_table(
        mutated,
        Bounds(3, 2),
        2,
        induction=False,
        reachability=False,
        properties=(P2,),
        read_after_prepare=False,
    )
    assert report.properties[P2].verdict == "violated"
    assert [c[0] for c in report.properties[P2].calls] == ["prepare", "read"]


def test_an_unknown_step_order_is_read_from_the_table() -> None:
    """A table whose prepare gains a consumer-independent extra wait still passes: the
    encoding interprets steps, it does not pattern-match the real table."""
    prepare = TABLE.op("prepare")
    extra = Step(kind="wait_event", stream="copy", event="release")
    steps = (*prepare.steps[:2], extra, *prepare.steps[2:])
    table = TABLE.with_op(replace(prepare, steps=steps))
    report = check_table(
        table, Bounds(3, 2), 4, induction=False, reachability=False, properties=(P1, P2, P4, P6, P8)
    )
    assert report.violation is None, report.text()


def test_stop_at_first_kills_every_mutant() -> None:
    bounds, depth = CONFIGURATIONS[0]
    for m in ALL_MUTANTS:
        report = check_table(
            m.apply(TABLE), bounds, depth, induction=False, reachability=False, stop_at_first=True
        )
        assert report.violation is not None, m.name
        # The replaying models find a violation on the same calls (not always the same
        # property: core.check_plan reports P5 before P3 on one plan, for instance).
        replayed = report.properties[report.violation.prop].replayed
        assert any(replayed.values()), m.name


def test_stop_at_first_on_the_real_table_holds() -> None:
    report = check_table(
        TABLE, Bounds(3, 2), 3, induction=False, reachability=False, stop_at_first=True
    )
    assert report.violation is None
    assert {r.verdict for r in report.properties.values()} == {"holds"}

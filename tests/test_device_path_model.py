"""The device-planned path's model: its table entries, both device models, z3, the machine,
the mutant catalogue, and the state counts of every exhaustive check (pinned here)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from model_check.config import DEVICE_CHECKS, DEVICE_MUTANT_CHECKS, Check, Pinned, load_manifest
from model_check.search import Result
from model_check.search import explore as search_explore
from model_check.search.device_models import DeviceHbModel, DeviceQueueModel
from model_check.search.replay import Call
from model_check.streams.device_hb import Summary, device_program
from model_check.streams.device_program import (
    HostPart,
    Interpreter,
    call,
    host_actions,
    initial_host,
    interpret,
)
from model_check.streams.device_queues import execute, host_call, initial_state, replay, runnable
from model_check.table import TableError
from model_check.table.device_functions import (
    FUNCTIONS,
    SAME_STATE_AS_REFERENCE,
    initial_dev,
    plan_pass,
    select,
)
from model_check.table.mutants import DEVICE_MUTANTS, Mutant, device_mutant
from model_check.table.properties import DEVICE_PROPERTIES as PROPERTIES
from model_check.table.properties import DEVICE_REACHABILITY as REACHABILITY
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceStep, DeviceTable, load_device_table, parse_device_table
from model_check.z3.check import CONFIGURATIONS

B32 = Bounds(num_experts=3, capacity=2)
TABLE = load_device_table()
# Observations each model must reach in one of its runs.
EXPECTED_TAGS = {"hb": DeviceHbModel.expected_tags, "interleavings": DeviceQueueModel.expected_tags}


def explore(table: DeviceTable, check: Check, **how: Any) -> Result:
    """One exhaustive check of a device table (`search.explore`)."""
    return search_explore(table, check.bounds, check.depth, model=check.model, **how)


# ---------------------------------------------------------------- the table


def test_table_has_the_device_operations() -> None:
    names = [op.name for op in TABLE.operations]
    for name in ("device_prepare", "handoff", "replay", "device_invalidate", "check_errors"):
        assert name in names
    replay = TABLE.op("replay")
    assert [s.kind for s in replay.steps if s.graph] == ["plan", "gather", "consumer_read"]
    assert all(op.hot for op in TABLE.operations if op.name != "check_errors" and op.provider)


def _raw() -> dict[str, object]:
    import tomllib

    from model_check.table import TABLE_PATH

    with TABLE_PATH.open("rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"kind": "copy_rows"}, "kind"),
        ({"stream": "copy"}, "stream"),
        ({"fn": "plan_pass_typo"}, "fn"),
        ({"when": "owner_change"}, "when"),
        ({"graph": True, "stream": "owner"}, "captured"),
    ],
)
def test_table_rejects_unknown_names(edit: dict[str, object], message: str) -> None:
    import copy

    data = copy.deepcopy(_raw())
    device = data["device"]
    assert isinstance(device, dict)
    step = next(s for s in device["operation"][0]["steps"] if s["kind"] == "plan")
    step.update(edit)
    with pytest.raises(TableError, match=message):
        parse_device_table(data)


def _replay(data: dict[str, object]) -> dict[str, Any]:
    device = data["device"]
    assert isinstance(device, dict)
    return next(op for op in device["operation"] if op["name"] == "replay")


def test_replay_begins_with_the_handoff_it_runs() -> None:
    """Only the provider's handoff() is generated and run before a replay: the table's replay
    must begin with exactly its steps and owner rule, or the model checks what never runs."""
    import copy

    replay, handoff = TABLE.op("replay"), TABLE.op("handoff")
    assert tuple(s for s in replay.steps if not s.graph) == handoff.steps
    data = copy.deepcopy(_raw())
    _replay(data)["steps"][1]["stream"] = "owner"  # the wait on the owner: not handoff's
    with pytest.raises(TableError, match="replay: begins_with 'handoff': its steps before"):
        parse_device_table(data)
    data = copy.deepcopy(_raw())
    _replay(data)["set_owner"] = "current_if_none"
    with pytest.raises(TableError, match="set_owner 'current_if_none'"):
        parse_device_table(data)
    data = copy.deepcopy(_raw())
    _replay(data)["begins_with"] = "device_read"
    with pytest.raises(TableError, match="begins_with 'device_read' names no provider operation"):
        parse_device_table(data)


def test_step_describe_is_readable() -> None:
    step = DeviceStep("plan", "current", fn="plan_pass", graph=True)
    assert step.describe() == "plan on current fn=plan_pass (graph)"


# ---------------------------------------------------------------- semantics


def test_pass_selection_is_the_host_paths_groups() -> None:
    empty = initial_dev(B32).cache
    first = select((2, 0, 1, 0, -1), 0, 2, B32, empty)
    assert first.group == (0, 1) and first.order == (0, 1, 2)
    assert select((2, 0, 1, 0, -1), 1, 2, B32, empty._replace(step=first.order)).group == (2,)
    assert not select((2, 0, -1), 0, 1, B32, empty).error  # -1 is padding, not an error
    bad = select((0, 3), 0, 1, B32, empty)
    assert bad.group == (0,) and bad.error  # an id outside [-1, E) is ignored and counted
    assert not select((0, 3), 1, 2, B32, empty).error  # counted on the first pass only


def test_a_step_exposes_its_hits_first_and_protects_every_expert_it_requests() -> None:
    # Expert 2 resident (slot 0) and 1 resident (slot 1, most recent): the step (0, 1, 2)
    # exposes its hits 1 and 2 first, then copies 0 into the slot of the earlier pass's 2.
    cache = initial_dev(B32).cache._replace(lru=(2, 1), slot_of=(-1, 1, 0))
    first = select((0, 1, 2), 0, 2, B32, cache)
    assert first.group == (1, 2) and first.order == (1, 2, 0) and first.step == (1, 2, 0)
    second = select((0, 1, 2), 1, 2, B32, cache._replace(step=first.order))
    assert second.group == (0,)
    # A step that fits one pass stores no order: a later pass of it exposes nothing.
    assert select((0, 1), 0, 1, B32, cache).order == ()


def test_plan_uses_free_slots_then_lru_victims_never_one_it_exposes() -> None:
    dev = initial_dev(B32)
    out = plan_pass(dev, (0, 1), 0, 1, B32)
    assert out.dev.fwd == ((0, 0), (1, 1)) and out.dev.n_miss == 2
    out = plan_pass(out.dev, (0, 2), 0, 1, B32)
    assert out.victims == (1,) and out.dev.fwd == ((0, 0), (2, 1))
    assert out.dev.misses[0] == (2, 1) and out.dev.misses[1] == (1, 1)  # left from before


def test_record_snapshots_work_enqueued_so_far_and_wait_copies_the_snapshot() -> None:
    state = initial_state(TABLE, B32)
    state = host_call(TABLE, B32, state, call("device_prepare", ((0,), 0), 0)).state
    queue = state.part.queues[0]
    assert [op.kind for op in queue] == ["plan", "gather"] and queue[1].glued
    # A prepare from stream 1: the handoff event holds stream 0's two operations.
    after = host_call(TABLE, B32, state, call("device_prepare", ((1,), 0), 1)).state
    wait = after.part.queues[1][0]
    assert wait.kind == "wait" and wait.wait == (0, 2)
    assert not runnable(after.part, 1) and runnable(after.part, 0)


def test_waiting_on_a_never_recorded_event_does_nothing() -> None:
    state = initial_state(TABLE, B32)
    part, found, _ = execute(state.part, (("wait", 1, 0),))
    assert part.queues[1] == () and found is None


def test_summary_masks_follow_the_same_facts() -> None:
    summary = Summary(TABLE, B32)
    # A read of slot 0 on stream 0, the handoff to stream 1, then a gather into slot 0 there.
    prims = (
        ("op", "read", 0, ((1, 0), (4, 0))),
        ("record", 0, 0),
        ("wait", 1, 0),
        ("op", "gather", 1, ((2, 0), (4, 1))),
    )
    assert summary.run(frozenset(), prims).violation is None
    unordered = (prims[0], prims[3])
    found = summary.run(frozenset(), unordered).violation
    assert found is not None and found.prop == "P1_no_overwrite_under_reader"


def test_rejected_call_changes_nothing() -> None:
    state = initial_state(TABLE, B32)
    state = host_call(TABLE, B32, state, call("device_prepare", ((0, 1), 0), 0)).state
    for action in (call("device_prepare", ((0,), 1), 1), call("device_invalidate", (3,), 1)):
        outcome = host_call(TABLE, B32, state, action)
        assert outcome.state == state and outcome.violation is None


def test_the_device_cannot_raise_errors_reach_the_next_look() -> None:
    state = initial_state(TABLE, B32)
    state = host_call(TABLE, B32, state, call("device_prepare", ((0, 3), 0), 0)).state
    look = host_call(TABLE, B32, state, call("check_errors", (), 0))
    assert look.violation is None and look.state.part.blocked is not None  # waits in host_sync
    assert look.state.host.ghost_err is False  # reported once, then reset


def test_interpreter_memo_is_interpret() -> None:
    memo = Interpreter(TABLE, B32)
    host = initial_host(B32)
    for action in host_actions(TABLE, B32)[:60]:
        assert memo(host, action) == interpret(
            TABLE, B32, host, action.op, action.args, action.stream
        )
        program = memo(host, action)
        if not program.rejected:
            host = program.host


def test_calls_made_on_stream_zero_only_cannot_depend_on_the_stream() -> None:
    """host_actions tries an operation on stream 0 only when no role resolves to the calling
    stream: its program is then the same from every stream."""
    memo = Interpreter(TABLE, B32)
    hosts = [initial_host(B32)]
    for action in host_actions(TABLE, B32)[:30]:
        program = memo(hosts[-1], action)
        if not program.rejected:
            hosts.append(program.host)
    for op in TABLE.operations:
        if op.uses_current:
            continue
        for host in hosts:
            if host.owner < 0 and op.guard == "forward_unread":
                continue
            for args in {a.args for a in host_actions(TABLE, B32) if a.op == op.name}:
                assert memo(host, call(op.name, args, 0)) == memo(host, call(op.name, args, 1))


def _host_parts(depth: int) -> set[HostPart]:
    """Every host part the summary reaches within `depth` calls."""
    model = DeviceHbModel(TABLE, B32)
    level = {model.initial()}
    seen = set(level)
    for _ in range(depth):
        level = {
            o.state
            for state in level
            for action in model.actions(state)
            for o in model.outcomes(state, action)
        } - seen
        seen |= level
    return {state.host for state in seen}


def test_functions_said_to_keep_the_reference_state_do_so() -> None:
    """z3_check ties the shadow's cache state to the reference's when every function of the
    table is in SAME_STATE_AS_REFERENCE: check the claim on every reachable host part."""
    from model_check.table.device_functions import num_passes, plan_fn

    plans = [f for f in SAME_STATE_AS_REFERENCE if f in FUNCTIONS["plan"]]
    assert plans
    calls = [a for a in host_actions(TABLE, B32) if a.op == "device_prepare"]
    for host in _host_parts(3):
        for action in calls:
            ids, p = action.args
            assert isinstance(ids, tuple) and isinstance(p, int)
            total = num_passes(ids, B32)
            if p >= total:
                continue
            want = plan_pass(host.shadow, ids, p, total, B32).dev
            for name in plans:
                got = plan_fn(name)(host.shadow, ids, p, total, B32).dev
                assert (got.cache, got.fwd, got.slots) == (want.cache, want.fwd, want.slots)


# ---------------------------------------------------------------- exhaustive checks


@pytest.mark.parametrize("check", DEVICE_CHECKS, ids=lambda c: c.key)
def test_real_table_holds_and_matches_the_manifest(check: Check) -> None:
    result = explore(TABLE, check)
    assert result.violation is None, result.violation
    pinned = load_manifest()[check.key]
    assert Pinned(result.states, result.transitions, result.max_depth_reached) == pinned
    missing = EXPECTED_TAGS[check.model] - result.tags
    if check.bounds == B32:
        assert not missing, missing


def test_reachability_names_are_documented() -> None:
    for tags in EXPECTED_TAGS.values():
        assert tags <= set(REACHABILITY)


def test_catalogue_covers_every_property_but_deadlock() -> None:
    broken = {m.breaks for m in DEVICE_MUTANTS}
    assert broken == set(PROPERTIES) - {"P7_no_deadlock"}
    assert len(DEVICE_MUTANTS) >= 6


@pytest.mark.parametrize("m", DEVICE_MUTANTS, ids=lambda m: m.name)
def test_every_mutant_is_killed_by_both_searches_and_breaks_its_property(m: object) -> None:
    assert isinstance(m, Mutant)
    table = m.apply(TABLE)
    for check in DEVICE_MUTANT_CHECKS:
        assert explore(table, check).violation is not None, check.key
    target = next(c for c in DEVICE_MUTANT_CHECKS if c.model == "interleavings")
    found = explore(table, target, only=m.breaks).violation
    assert found is not None and found.prop == m.breaks


def test_mutant_lookup_names_the_known_ones() -> None:
    assert device_mutant("dp_gather_past_count").breaks == "P4_map_convergence"
    with pytest.raises(KeyError, match="known"):
        device_mutant("nope")


# ---------------------------------------------------------------- z3 and the machine


def test_z3_holds_on_the_real_table_and_the_induction_proves_the_ordering() -> None:
    from model_check.z3.device_path import check

    report = check(TABLE, B32, 3)
    assert report.ok, (report.verdicts, report.induction)
    assert not report.vacuous
    assert report.induction is not None
    assert all(report.induction.per_operation.values())
    assert "S:W pending => before the owner stream" in report.induction.invariant


@pytest.mark.parametrize(
    "name",
    ["dp_gather_past_count", "dp_replay_wait_on_capture_stream", "dp_errors_reset_by_plan"],
)
def test_z3_kills_mutants(name: str) -> None:
    from model_check.z3.device_path import check

    table = device_mutant(name).apply(TABLE)
    report = check(table, B32, 4, induction=False, reachability=False, stop_at_first=True)
    assert report.violation is not None


def _tuples(x: object) -> object:
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


def z3_kill_fresh(name: str) -> tuple[Bounds, str, list[Call]] | None:
    """z3's first counterexample of a mutant at either bound, in a fresh process, as the kill
    matrix's z3 column (`cli.z3_kill`) runs each row (which counterexample z3 finds first
    depends on the queries its process made before)."""
    code = (
        "import json; from model_check.z3.check import CONFIGURATIONS; "
        "from model_check.z3.device_path import check; "
        "from model_check.table.mutants import device_mutant; "
        "from model_check.table.schema import load_device_table; "
        f"t = device_mutant({name!r}).apply(load_device_table()); k = None\n"
        "for i, (b, d) in enumerate(CONFIGURATIONS):\n"
        "    r = check(t, b, d, induction=False, reachability=False, stop_at_first=True)\n"
        "    if r.violation is not None:\n"
        "        p = r.violation.prop; k = [i, p, r.calls[p]]; break\n"
        "print(json.dumps(k))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    found = json.loads(out.stdout)
    if found is None:
        return None
    index, prop, calls = found
    return CONFIGURATIONS[index][0], prop, [(op, _tuples(args), s) for op, args, s in calls]  # type: ignore[misc]


@pytest.mark.parametrize("m", DEVICE_MUTANTS, ids=lambda m: m.name)
def test_z3_counterexamples_replay_on_the_explicit_model(m: Mutant[DeviceTable]) -> None:
    """Every mutant, killed by z3 as the kill matrix runs it: the explicit model, run on the
    counterexample's host calls with every interleaving, meets the same property (with
    `only`: a pass's plan, gather and read run as one step, and z3 may name the read's). One
    plan's result gets one verdict there (functions.plan_verdict: P9, then P5, then P3), so
    where z3 names a later one, the explicit model meets an earlier one of the same plan."""
    table = m.apply(TABLE)
    killed = z3_kill_fresh(m.name)
    assert killed is not None, m.name
    bounds, prop, calls = killed
    found = replay(table, bounds, calls, only=prop)
    assert found is not None, (m.name, calls)
    if prop not in found:
        order = ["P9_device_errors_reported", "P5_victim_protection", "P3_forward_map_exact"]
        plan = f"the plan of {calls[-1][1][0]}"
        before = order[: order.index(prop)] if prop in order else []
        earlier = [p for p in before if plan in found.get(p, "")]
        assert earlier, (m.name, prop, calls, found)


def test_induction_fails_without_the_handoff() -> None:
    from model_check.z3.device_path import prove

    result = prove(device_mutant("dp_prepare_skips_handoff").apply(TABLE), B32)
    assert not result.proved["P10_ordered_device_state"]


def test_machine_passes_on_the_real_table() -> None:
    from model_check.search.run_machines import run_machine

    assert run_machine(TABLE, Bounds(4, 3), max_examples=60, steps=30) is None


@pytest.mark.parametrize("name", ["dp_prepare_skips_handoff", "dp_check_errors_without_sync"])
def test_machine_kills_mutants(name: str) -> None:
    from model_check.search.run_machines import run_machine

    table = device_mutant(name).apply(TABLE)
    assert run_machine(table, Bounds(4, 3), max_examples=200, steps=30, shrink=False) is not None


def test_summary_reports_what_the_explicit_model_meets_on_a_hand_made_bug() -> None:
    """A gather moved to the capture stream: both models see the unordered slot write."""
    op = TABLE.op("device_prepare")
    steps = tuple(replace(s, stream="capture") if s.kind == "gather" else s for s in op.steps)
    table = TABLE.with_op(replace(op, steps=steps))
    hb = explore(table, Check("hb", B32, 3, "device")).violation
    explicit = explore(table, Check("interleavings", B32, 2, "device")).violation
    assert hb is not None and explicit is not None


def test_device_program_drops_only_payloads() -> None:
    host = initial_host(B32)
    program = interpret(TABLE, B32, host, "device_prepare", ((0,), 0), 0)
    stripped = device_program(program.prims)
    assert [p[0] for p in stripped] == [p[0] for p in program.prims]


def test_full_run_schedules_the_device_checks_too() -> None:
    from model_check.cli import _schedule
    from model_check.config import CHECKS

    jobs = _schedule(CHECKS, DEVICE_CHECKS)
    assert jobs[0][0] == "explore" and jobs[0][1] is not None and jobs[0][1].path == "host"
    keys = sorted(c.key for kind, c in jobs if kind == "device_explore" and c is not None)
    assert keys == sorted(c.key for c in DEVICE_CHECKS)
    assert sum(1 for kind, _ in jobs if kind == "device_z3") == 2  # the LRU bounds
    assert sum(1 for kind, _ in jobs if kind == "device_machine") == 1
    assert _schedule(CHECKS) == [j for j in jobs if not j[0].startswith("device_")]


def test_explain_and_diagram_show_the_device_path(capsys: pytest.CaptureFixture[str]) -> None:
    from model_check.cli import main

    assert main(["explain", "dp_check_errors_without_sync"]) == 0
    out = capsys.readouterr().out
    assert "check_errors() on stream 0" in out and "P9_device_errors_reported" in out
    assert main(["diagram"]) == 0
    assert "replay(ids)" in capsys.readouterr().out


@pytest.mark.parametrize("fn", ["plan_pass_protects_pass_only_hits_first"])
def test_pass_only_protection_is_equivalent_once_the_hits_come_first(fn: str) -> None:
    """With the step's hits exposed by its first pass, protecting only the pass's own experts
    leaves no victim choice to differ: the planner that does so holds every property,
    convergence to the step-wide reference (P4) included, at the mutants' bounds. (The same
    protection with the passes in id order, `dp_protects_pass_only`, is killed above.)"""
    from model_check.table.mutants import FORWARDS, _fn, _steps

    table = _steps(FORWARDS, _fn("plan", fn))(TABLE)
    for check in DEVICE_MUTANT_CHECKS:
        assert explore(table, check).violation is None, check.key


def test_a_planner_that_ignores_the_counts_fails_convergence_under_lfu() -> None:
    """The seeded bug of policy lfu on the device path (counts kept, victims by recency):
    harmless under lru, where it is the planner, and caught at the lfu bounds the check
    explores (`config.B32_LFU`) by both models, as a forward map or a cache state other than
    the reference's (P2 or P4, whichever a search meets first)."""
    from model_check.config import B32_LFU
    from model_check.table.mutants import FORWARDS, _fn, _steps

    mutated = _steps(FORWARDS, _fn("plan", "plan_pass_by_recency"))(TABLE)
    assert explore(mutated, Check("hb", B32, 4, "device")).violation is None
    for model, depth in (("hb", 6), ("interleavings", 3)):
        found = explore(mutated, Check(model, B32_LFU, depth, "device")).violation
        assert found is not None, model
        assert found.prop in ("P2_no_stale_read", "P4_map_convergence"), (model, found)
    assert explore(TABLE, Check("interleavings", B32_LFU, 3, "device")).violation is None


def test_the_device_path_s_lfu_searches_see_the_policy_at_work() -> None:
    from model_check.config import B32_LFU

    for model, depth in (("hb", 6), ("interleavings", 3)):
        result = explore(TABLE, Check(model, B32_LFU, depth, "device"))
        assert result.violation is None
        assert {"victim_by_count", "counts_halved"} <= set(result.expected_tags)
        assert not result.missing_reachability(), (model, result.missing_reachability())

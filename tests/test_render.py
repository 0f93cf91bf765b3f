"""model_check.render: swimlanes of counterexample traces and pictures of the table."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest

from model_check.render import (
    HOST,
    LaneEvent,
    OutcomeLike,
    stream_names,
    swimlane_events,
    swimlane_svg,
    swimlane_text,
    table_diagram,
    table_text,
    trace_summary,
)
from model_check.search import explore
from model_check.streams.interpreter import Action
from model_check.streams.queues import (
    device_step,
    host_call,
    initial_state,
    runnable,
)
from model_check.table import Table, load_table
from model_check.table.properties import Violation
from model_check.table.reference import Bounds

Steps = list[tuple[Action, OutcomeLike]]
BOUNDS = Bounds(3, 2)
COPY = BOUNDS.consumer_streams  # index of the copy stream
LANES = ("host", "s0", "s1", "copy")


def without_release_wait(table: Table) -> Table:
    """The mutant 'drop the copy stream's wait on release' of the prepare entry."""
    prepare = table.op("prepare")
    steps = tuple(s for s in prepare.steps if not (s.kind == "wait_event" and s.event == "release"))
    assert len(steps) == len(prepare.steps) - 1
    return table.with_op(replace(prepare, steps=steps))


def p1_trace() -> Steps:
    """By hand, on the mutant: prepare([0]) on s0, its read on s0, prepare([1, 2]) on s1
    (which evicts expert 0 from slot 0), then the copy stream runs both calls' copies before
    the read ran: expert 2's copy overwrites slot 0 under the pending read."""
    table = without_release_wait(load_table())
    state = initial_state(BOUNDS)
    trace: Steps = []
    for op, args, stream in (
        ("prepare", ((0,),), 0),
        ("read", (), 0),
        ("prepare", ((1, 2),), 1),
    ):
        outcome = host_call(table, BOUNDS, state, op, args, stream)
        assert outcome.violation is None
        trace.append((Action("host", op, args, stream), outcome))
        state = outcome.state
    for _ in range(2):
        assert runnable(state, COPY)
        outcome = device_step(state, COPY)
        trace.append((Action("device", stream=COPY), outcome))
        state = outcome.state
    assert outcome.violation is not None
    assert outcome.violation.prop == "P1_no_overwrite_under_reader"
    return trace


@pytest.fixture(scope="module")
def hand_trace() -> Steps:
    return p1_trace()


@pytest.fixture(scope="module")
def explored() -> tuple[Steps, Violation]:
    result = explore(without_release_wait(load_table()), BOUNDS, 3)
    assert result.violation is not None
    assert result.trace
    return list(result.trace), result.violation


def lane_of(header: str, line: str, cell: str) -> str:
    """The lane whose column `cell` starts in, on `line` of a lane table."""
    start = line.index(cell)
    (name,) = [
        n
        for n in (*LANES, "current", "owner")
        if f"| {n} " in header + " " and header.index(f"| {n}") + 2 == start
    ]
    return name


# ---------------------------------------------------------------- swimlane text


def test_text_names_the_violation_and_every_lane(hand_trace: Steps) -> None:
    text = swimlane_text(hand_trace, 2)
    assert "P1_no_overwrite_under_reader" in text
    assert "copy of expert 2 into slot 0" in text
    header = text.splitlines()[1]
    assert header.startswith("  # | host")
    for name in LANES:
        assert f"| {name}" in header
    assert all(len(line) <= 100 for line in text.splitlines())


def test_text_puts_each_event_in_its_lane(hand_trace: Steps) -> None:
    text = swimlane_text(hand_trace, 2)
    lines = text.splitlines()

    def lanes_with(cell: str) -> list[str]:
        return [lane_of(lines[1], line, cell) for line in lines[3:] if cell in line]

    assert lanes_with("prepare([0]) on s0") == ["host"]
    assert lanes_with("prepare([1, 2]) on s1") == ["host"]
    assert lanes_with("+read {0->slot0}") == ["s0"]
    assert lanes_with("+copy e2->slot0") == ["copy"]
    assert lanes_with(">copy e2->slot0") == ["copy"]
    assert lanes_with("*record ready") == ["copy", "copy"]
    assert lanes_with("+wait ready") == ["s0", "s1"]
    assert lanes_with("!P1_no_overwrite_under_reader") == ["copy"]
    # Time order: enqueued before it ran, the violation last.
    assert text.index("+copy e2->slot0") < text.index(">copy e2->slot0")
    assert text.rindex("P1_no_overwrite_under_reader") > text.index(">copy e2->slot0")


def test_events_follow_operations_from_enqueue_to_run(
    hand_trace: Steps,
) -> None:
    events = swimlane_events(hand_trace, 2)
    assert [e.row for e in events] == list(range(len(events)))
    enqueued = {e.op_id: e for e in events if e.mark == "enqueue"}
    ran = [e for e in events if e.mark == "ran"]
    # Step 4 runs the first call's copy group, step 5 the second's.
    assert [e.text for e in ran] == [
        "copy e0->slot0",
        "upload resident map",
        "copy e1->slot1",
        "copy e2->slot0",
        "upload resident map",
    ]
    for e in ran:
        assert enqueued[e.op_id].text == e.text
        assert enqueued[e.op_id].lane == e.lane == COPY
    # Each consumer stream's wait on ready orders after its call's resident-map upload.
    waits = [e for e in events if e.mark == "enqueue" and e.text == "wait ready"]
    assert [w.lane for w in waits] == [0, 1]
    for w in waits:
        target = enqueued[w.after]
        assert (target.lane, target.text, target.action) == (COPY, "upload resident map", w.action)
    # The read must follow the pending copy into its slot, and the second call's copy into
    # slot 0 the pending read of slot 0; nothing else has such a constraint.
    follows = {
        e.text: enqueued[e.must_follow].text for e in enqueued.values() if e.must_follow >= 0
    }
    assert follows == {"read {0->slot0}": "copy e0->slot0", "copy e2->slot0": "read {0->slot0}"}
    last = events[-1]
    assert last.mark == "violation" and last.lane == COPY and last.action == len(hand_trace) - 1


def test_explored_counterexample(explored: tuple[Steps, Violation]) -> None:
    trace, violation = explored
    text = swimlane_text(trace, 2, violation)
    assert violation.prop in text
    for name in LANES:
        assert f"| {name}" in text.splitlines()[1]
    summary = trace_summary(trace)
    assert len(summary) == len(trace) + 1
    assert summary[-1].startswith(f"!! {violation.prop}")
    assert summary[0].startswith("1. prepare(")


def test_wait_with_nothing_to_wait_for_is_marked() -> None:
    """The first prepare's release wait: release was recorded on an empty stream."""
    table = load_table()
    outcome = host_call(table, BOUNDS, initial_state(BOUNDS), "prepare", ((0,),), 0)
    text = swimlane_text([(Action("host", "prepare", ((0,),), 0), outcome)], 2)
    assert "~wait release" in text
    assert "VIOLATION" not in text


def test_violation_given_separately_goes_on_the_host_lane(
    hand_trace: Steps,
) -> None:
    deadlock = Violation("P7_no_deadlock", "pending operations remain and none can run")
    events = swimlane_events(hand_trace[:3], 2, deadlock)
    assert events[-1] == LaneEvent(
        len(events) - 1, HOST, "violation", f"{deadlock.prop}: {deadlock.detail}", 2
    )
    assert "P7_no_deadlock" in swimlane_text(hand_trace[:3], 2, deadlock)


class _Bare(NamedTuple):
    """An outcome of a model whose states have no queues."""

    state: object
    violation: Violation | None
    tags: frozenset[str]
    trace: tuple[str, ...]


def test_states_without_queues_still_render() -> None:
    trace = [
        (
            Action("host", "prepare", ((1,),), 1),
            _Bare(None, None, frozenset(), ("record release on 1", "wait release on 2")),
        ),
        (Action("device", stream=2), _Bare(None, Violation("P4_x", "detail"), frozenset(), ())),
    ]
    events = swimlane_events(trace, 2)
    assert [(e.lane, e.mark, e.text) for e in events] == [
        (HOST, "call", "prepare([1]) on s1"),
        (1, "record", "record release"),
        (2, "enqueue", "wait release"),
        (2, "ran", "head group"),
        (2, "violation", "P4_x: detail"),
    ]
    assert trace_summary(trace, 2)[1] == "2. device copy ran head group"


def test_long_cells_are_clipped_with_an_ellipsis() -> None:
    trace = [
        (
            Action("host", "prepare", (tuple(range(40)),), 0),
            _Bare(None, None, frozenset(), (f"copy expert {'9' * 90} to slot 0 on 2",)),
        )
    ]
    text = swimlane_text(trace, 2, width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert text.count("…") == 2


def test_stream_names() -> None:
    assert stream_names(2) == ["s0", "s1", "copy"]
    assert stream_names(3) == ["s0", "s1", "s2", "copy"]


# ---------------------------------------------------------------- images


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_swimlane_image_written(hand_trace: Steps, tmp_path: Path, suffix: str) -> None:
    path = swimlane_svg(hand_trace, 2, tmp_path / f"trace{suffix}")
    assert path.exists() and path.stat().st_size > 1000
    head = path.read_bytes()[:8]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else b"<?xml" in head


def test_swimlane_svg_is_deterministic(hand_trace: Steps, tmp_path: Path) -> None:
    a = swimlane_svg(hand_trace, 2, tmp_path / "a.svg")
    b = swimlane_svg(hand_trace, 2, tmp_path / "b.svg")
    assert a.read_bytes() == b.read_bytes()
    assert b"<dc:date>" not in a.read_bytes()


def test_swimlane_of_explored_trace(explored: tuple[Steps, Violation], tmp_path: Path) -> None:
    trace, violation = explored
    path = swimlane_svg(trace, 2, tmp_path / "explored.svg", violation)
    assert path.stat().st_size > 1000


def test_unknown_suffix_is_refused(hand_trace: Steps, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="suffix"):
        swimlane_svg(hand_trace, 2, tmp_path / "trace.pdf")


# ---------------------------------------------------------------- the table


def test_table_text_lists_every_step_in_its_lane() -> None:
    table = load_table()
    text = table_text(table)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "…" not in text
    for op in table.operations:
        assert f"{op.name}(" in text
        assert f"guard {op.guard}" in text
    prepare = text[text.index("prepare(ids)") : text.index("invalidate(expert)")]
    lines = prepare.splitlines()
    header = lines[1]
    # Waits name the step that recorded their event (after the condition, if any).
    assert re.search(r"wait release( \[\w+\])? <1", prepare)
    assert re.search(r"wait ready( \[\w+\])? <7", prepare)
    for cell, lane in (
        ("record release", "owner"),
        ("wait release", "copy"),
        ("copy_rows [misses]", "copy"),
        ("write_staging resident", "host"),
        ("wait ready", "current"),
    ):
        (line,) = [ln for ln in lines if cell in ln]
        assert lane_of(header, line, cell) == lane
    assert len([ln for ln in lines if ln[:3].strip().isdigit()]) == len(table.op("prepare").steps)


def test_table_text_marks_a_wait_recorded_by_an_earlier_call() -> None:
    table = load_table()
    prepare = table.op("prepare")
    # Move the release record after the wait: the wait now sees the previous call's record.
    steps = list(prepare.steps)
    steps[0], steps[1] = steps[1], steps[0]
    text = table_text(table.with_op(replace(prepare, steps=tuple(steps))))
    assert re.search(r"wait release( \[\w+\])? <prev", text)


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_table_diagram_written(tmp_path: Path, suffix: str) -> None:
    path = table_diagram(load_table(), tmp_path / f"table{suffix}")
    assert path.exists() and path.stat().st_size > 1000


def test_table_diagram_is_deterministic(tmp_path: Path) -> None:
    a = table_diagram(load_table(), tmp_path / "a.svg")
    b = table_diagram(load_table(), tmp_path / "b.svg")
    assert a.read_bytes() == b.read_bytes()

"""The device-planned path's checks, as `python -m model_check` runs them: the searches, z3,
the hypothesis machine, a mutant's kill row, and the counterexample of a mutant as text.

The bounds are config.DEVICE_CHECKS (pinned in spec/manifest.toml with the host path's) and
DEVICE_MUTANT_CHECKS; `Z3_CONFIGS` and `MACHINE_BOUNDS` are those of the host path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from model_check import report
from model_check.config import DEVICE_MUTANT_CHECKS, Check, Pinned
from model_check.device_path.core import PROPERTIES, REACHABILITY
from model_check.device_path.explicit import ExplicitModel
from model_check.device_path.hb import HbModel
from model_check.device_path.mutants import DeviceMutant, device_mutant
from model_check.device_path.table import DeviceTable, load_device_table
from model_check.report import Column, Kill
from model_check.search.bfs import bfs
from model_check.search.memo import memo_search
from model_check.search.model import Result
from model_check.search.replay import Call
from model_check.table.reference import Bounds

B32 = Bounds(num_experts=3, capacity=2)
B43 = Bounds(num_experts=4, capacity=3)
Z3_CONFIGS: tuple[tuple[Bounds, int], ...] = ((B32, 6), (B43, 4))
MACHINE_BOUNDS = B43

# Properties each checker decides: P7 is the explicit model's (the summaries' waits are
# snapshot waits, so the happens-before relation is acyclic by construction).
DECIDES = {
    "hb": [p for p in PROPERTIES if p != "P7_no_deadlock"],
    "interleavings": list(PROPERTIES),
    "z3": [p for p in PROPERTIES if p != "P7_no_deadlock"],
    "hypothesis": list(PROPERTIES),
}
# Observations each model must reach in one of its runs.
EXPECTED_TAGS = {
    "hb": frozenset(REACHABILITY) - {"device_idle"},
    "interleavings": frozenset(REACHABILITY),
}


def explore(
    table: DeviceTable,
    check: Check,
    *,
    only: str | None = None,
    stop_at_first: bool = True,
    symmetry: bool = True,
) -> Result:
    """One exhaustive check of the device table: the summary through the memoized search,
    the explicit model through the plain one (both `model_check.search`)."""
    if check.model == "hb":
        hb = HbModel(table, check.bounds)
        if symmetry:
            return memo_search(hb, check.depth, stop_at_first=stop_at_first, only=only)
        return bfs(hb, check.depth, stop_at_first=stop_at_first, symmetry=False, only=only)
    model = ExplicitModel(table, check.bounds, only)
    return bfs(model, check.depth, stop_at_first=stop_at_first, symmetry=symmetry, only=only)


def search_columns(
    runs: Sequence[tuple[Check, Result]], manifest: dict[str, Pinned], write_command: str
) -> list[Column]:
    """Columns of the device searches (`report.search_columns`)."""
    return report.search_columns(
        runs,
        manifest,
        DECIDES,
        lambda check, result: set(EXPECTED_TAGS[check.model] - result.tags),
        "the manifest",
        write_command,
    )


def z3_column(table: DeviceTable, bounds: Bounds, depth: int, induction: bool) -> Column:
    from model_check.device_path.z3_check import check

    report = check(table, bounds, depth, induction=induction)
    found = report.violation
    col = Column(
        f"device/z3/{bounds.num_experts}e{bounds.capacity}c/d{depth}",
        None,
        depth,
        report.seconds,
        DECIDES["z3"],
        found,
    )
    if report.vacuous:
        col.notes.append(f"{col.name}: never reached {', '.join(report.vacuous)}")
    unknown = [p for p, v in report.verdicts.items() if v == "unknown"]
    if unknown:
        col.notes.append(f"{col.name}: unknown: {', '.join(unknown)}")
    ind = report.induction
    if ind is not None and not ind.ok:
        col.notes.append(
            f"{col.name}: induction failed: {ind.proved}, {ind.per_operation}, {ind.counterexample}"
        )
    return col


def machine_column(table: DeviceTable, examples: int, steps: int) -> Column:
    from model_check.device_path.machine import run_machine

    start = time.perf_counter()
    found = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    b = MACHINE_BOUNDS
    return Column(
        f"device/hypothesis/{b.num_experts}e{b.capacity}c",
        None,
        steps,
        time.perf_counter() - start,
        DECIDES["hypothesis"],
        found,
    )


def z3_kill(table: DeviceTable) -> tuple[Bounds, str, list[Call]] | None:
    """z3's first counterexample at either bound of the kill matrix: the bounds, the property
    and the host calls (None: z3 finds none)."""
    from model_check.device_path.z3_check import check as z3_check

    for bounds, depth in Z3_CONFIGS:
        report = z3_check(
            table, bounds, depth, induction=False, reachability=False, stop_at_first=True
        )
        if report.violation is not None:
            prop = report.violation.prop
            return bounds, prop, report.calls[prop]
    return None


def kill_row(m: DeviceMutant, examples: int, steps: int, use_z3: bool = True) -> list[Kill]:
    """The mutant's row of the kill matrix: both searches, the explicit model on the intended
    property, z3 (first counterexample at either bound) and the machine."""
    table = m.apply(load_device_table())
    row: list[Kill] = []
    for check in DEVICE_MUTANT_CHECKS:
        start = time.perf_counter()
        result = explore(table, check)
        row.append(
            Kill(
                check.key,
                result.violation.prop if result.violation else None,
                time.perf_counter() - start,
            )
        )
    start = time.perf_counter()
    target = next(c for c in DEVICE_MUTANT_CHECKS if c.model == "interleavings")
    result = explore(table, target, only=m.breaks)
    row.append(
        Kill(
            "intended",
            result.violation.prop if result.violation else None,
            time.perf_counter() - start,
        )
    )
    if use_z3:
        start = time.perf_counter()
        killed = z3_kill(table)
        found = None if killed is None else killed[1]
        row.append(Kill("z3", found, time.perf_counter() - start))
    from model_check.device_path.machine import run_machine

    start = time.perf_counter()
    found_h = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    row.append(Kill("hypothesis", found_h.prop if found_h else None, time.perf_counter() - start))
    return row


def explain(name: str, depth: int = 3) -> str:
    """The shortest counterexample of a device mutant on the explicit model, as text: every
    host call and device step, each host call with the device operations it enqueued."""
    m = device_mutant(name)
    table = m.apply(load_device_table())
    model = ExplicitModel(table, B32, m.breaks)
    result = bfs(model, depth, only=m.breaks, symmetry=False)
    if result.violation is None:
        return f"{m.name}: no violation of {m.breaks} within {depth} host calls"
    lines = [f"{m.name}: {m.description}", ""]
    for action, outcome in result.trace:
        if action.kind != "host":
            lines.append(f"    {action}")
            continue
        lines.append(f"  {action}")
        state = outcome.state
        part = model.part_of(state) if isinstance(state, tuple) else None
        if part is not None:
            for sid, queue in enumerate(part.queues):
                if queue:
                    shown = ", ".join(op.kind for op in queue)
                    lines.append(f"      pending on stream {sid}: {shown}")
    assert result.violation is not None
    lines.append(f"  => {result.violation.prop}: {result.violation.detail}")
    return "\n".join(lines)

"""What `python -m model_check` prints: checker columns by property, and kill matrices.

Shared by the host path's checks (cli.py) and the device-planned path's
(the same runner, on the `[device]` section), whose properties differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from model_check.config import Check, Pinned
from model_check.search.model import Result
from model_check.table.properties import Violation


@dataclass
class Column:
    """One checker's run: what it covered and what it found."""

    name: str
    states: int | None
    depth: int | None
    seconds: float
    decides: list[str]
    violation: Violation | None = None
    notes: list[str] = field(default_factory=list)
    reached: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None and not self.notes


def verdict_table(columns: list[Column], properties: Sequence[str]) -> str:
    names = [c.name for c in columns]
    width = max(len(p) for p in properties)
    cw = max(12, *(len(n) for n in names))
    lines = ["property".ljust(width) + "".join(n.rjust(cw + 2) for n in names)]
    for prop in properties:
        cells = []
        for col in columns:
            if prop not in col.decides:
                cells.append("-")
            elif col.violation is not None and col.violation.prop == prop:
                cells.append("VIOLATED")
            elif col.violation is not None:
                cells.append("stopped")
            else:
                cells.append("holds")
        lines.append(prop.ljust(width) + "".join(c.rjust(cw + 2) for c in cells))
    lines.append("")
    rows: list[tuple[str, list[str]]] = [
        ("states", ["-" if c.states is None else str(c.states) for c in columns]),
        ("depth", ["-" if c.depth is None else str(c.depth) for c in columns]),
        ("seconds", [f"{c.seconds:.1f}" for c in columns]),
        ("verdict", ["pass" if c.ok else "FAIL" for c in columns]),
    ]
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(x.rjust(cw + 2) for x in cells))
    return "\n".join(lines)


def search_columns(
    runs: Sequence[tuple[Check, Result]],
    manifest: dict[str, Pinned],
    decides: dict[str, list[str]],
    unreached: Callable[[Check, Result], set[str]],
    unpinned: str,
    write_command: str,
) -> list[Column]:
    """Columns of the exhaustive searches of either path: the manifest's counts, and every
    "sometimes" observation each model must reach (`unreached`: those a run did not) reached
    in one of its runs."""
    columns = []
    for check, result in runs:
        col = Column(
            name=check.key,
            states=result.states,
            depth=result.max_depth_reached,
            seconds=result.seconds,
            decides=decides[check.model],
            violation=result.violation,
            reached=set(result.tags),
        )
        pinned = manifest.get(check.key)
        got = Pinned(result.states, result.transitions, result.max_depth_reached)
        if pinned is None:
            col.notes.append(f"{check.key} is not in {unpinned} ({write_command})")
        elif pinned != got:
            col.notes.append(
                f"{check.key}: manifest pins {pinned}, this run found {got} "
                f"(re-pin on purpose with `{write_command}`)"
            )
        columns.append(col)
    for model in sorted({check.model for check, _ in runs}):
        reached: set[str] = set()
        missing: set[str] = set()
        for check, result in runs:
            if check.model == model:
                reached |= result.tags
                missing |= unreached(check, result)
        gaps = sorted(missing - reached)
        if gaps:
            owner = next(
                c for c, (check, _) in zip(columns, runs, strict=True) if check.model == model
            )
            owner.notes.append(f"{model}: never reached {', '.join(gaps)} (a vacuous pass?)")
    return columns


def column_json(col: Column) -> dict[str, Any]:
    return {
        "checker": col.name,
        "states": col.states,
        "depth": col.depth,
        "seconds": round(col.seconds, 3),
        "decides": col.decides,
        "violation": None if col.violation is None else vars(col.violation),
        "notes": col.notes,
        "ok": col.ok,
    }


@dataclass
class Kill:
    checker: str
    found: str | None  # property of the violation found, or None when the mutant survived
    seconds: float
    applicable: bool = True


class Seeded(Protocol):
    """A mutant of either catalogue."""

    @property
    def name(self) -> str: ...

    @property
    def breaks(self) -> str: ...

    @property
    def description(self) -> str: ...


def survivors(rows: Sequence[tuple[Seeded, list[Kill]]]) -> list[tuple[str, str]]:
    """(mutant, checker) of every applicable checker that did not kill it, or that killed it
    with another property than the one it was seeded against (`intended`)."""
    return [
        (m.name, k.checker)
        for m, row in rows
        for k in row
        if k.applicable and (k.found is None or (k.checker == "intended" and k.found != m.breaks))
    ]


def kill_matrix_text(rows: Sequence[tuple[Seeded, list[Kill]]], width: int = 22) -> str:
    checkers = [k.checker for k in rows[0][1]]
    nw = max(len(m.name) for m, _ in rows)
    lines = ["mutant".ljust(nw) + "  breaks" + "".join(c.rjust(width) for c in checkers)]
    for m, row in rows:
        cells = [
            "n/a"
            if not k.applicable
            else (k.found.split("_")[0] if k.found else "SURVIVED") + f" {k.seconds:5.1f}s"
            for k in row
        ]
        lines.append(
            m.name.ljust(nw)
            + "  "
            + m.breaks.split("_")[0].ljust(6)
            + "".join(c.rjust(width) for c in cells)
        )
    return "\n".join(lines)


def kills_json(rows: Sequence[tuple[Seeded, list[Kill]]]) -> list[dict[str, Any]]:
    return [
        {
            "name": m.name,
            "breaks": m.breaks,
            "description": m.description,
            "kills": [vars(k) for k in row],
        }
        for m, row in rows
    ]

"""The generated schedules are fresh, follow the table step by step, and change with it."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from model_check import codegen
from model_check.table import Step, Table, load_table
from rowcache.backends.base import Plan, Roles
from rowcache.schedules import _generated


def test_committed_file_is_fresh() -> None:
    diff = codegen.check()
    assert diff == [], "stale; run `python -m model_check.codegen`:\n" + "\n".join(diff)


def test_check_command_passes() -> None:
    assert codegen.main(["--check"]) == 0


def test_header_says_generated() -> None:
    text = codegen.GENERATED_PATH.read_text()
    assert (
        "Generated from spec/table.toml by `python -m model_check.codegen`; do not edit."
        in (text.splitlines()[2])
    )


def test_codegen_imports_no_torch() -> None:
    code = "import sys, model_check.codegen; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class Calls:
    """A backend that logs (kind, stream role, argument) per call."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []

    def __getattr__(self, kind: str) -> Any:
        def call(*args: Any) -> None:
            if kind == "write_staging":
                self.log.append((kind, "", args[0]))
                return
            label = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            self.log.append((kind, str(args[0]), label))

        return call


ROLES = Roles(current="current", owner="owner", copy="copy")


def expected(step: Step) -> tuple[str, str, str]:
    if step.kind == "write_staging":
        return ("write_staging", "", step.ring)
    if step.kind == "host_sync":
        return ("host_sync", "None" if step.stream == "all" else step.stream, step.stream)
    return (step.kind, step.stream, step.event or step.ring)


# The owner is the current stream: no handoff.
SAME_OWNER = Roles(current="current", owner="current", copy="copy")


def run(
    module: Any, op: str, plan: Plan, roles: Roles[str] = ROLES
) -> tuple[list[tuple[str, str, str]], object]:
    backend = Calls()
    owner = getattr(module, f"run_{op}")(backend, roles, plan)
    return backend.log, owner


def load(source: str) -> types.ModuleType:
    module = types.ModuleType("mutant_schedules")
    exec(compile(source, "<mutant_schedules>", "exec"), module.__dict__)
    return module


def test_every_operation_calls_its_steps_in_table_order() -> None:
    table = load_table()
    busy = Plan(
        copies=((1, 0),), changed=True, resident=(0,), forward=(0,), forward_pairs=((1, 0),)
    )
    idle = Plan()
    for op in table.operations:
        log, owner = run(_generated, op.name, busy)
        assert log == [expected(s) for s in op.steps], op.name
        # Nothing copied, the map unchanged, a call from another stream: the handoff runs.
        log, _ = run(_generated, op.name, idle)
        handoff = ("always", "misses_or_handoff")
        assert log == [expected(s) for s in op.steps if s.when in handoff], op.name
        # The same on the owner stream: only the unconditional steps (the hit path).
        log, _ = run(_generated, op.name, idle, SAME_OWNER)
        on_owner = [expected(s) for s in op.steps if s.when == "always"]
        assert log == [
            (kind, "current" if stream == "owner" else stream, label)
            for kind, stream, label in on_owner
        ], op.name
        assert owner == ("current" if op.set_owner == "current" else None)


def test_a_changed_table_changes_the_schedule() -> None:
    table = load_table()
    prepare = table.op("prepare")
    steps: Sequence[Step] = prepare.steps
    ready = next(i for i, s in enumerate(steps) if s.kind == "record_event" and s.event == "ready")
    copy = next(i for i, s in enumerate(steps) if s.kind == "copy_rows")
    moved = list(steps)
    moved.insert(copy, moved.pop(ready))
    mutant: Table = table.with_op(replace(prepare, steps=tuple(moved)))
    source = codegen.generate(mutant)
    assert source != codegen.generate(table)
    log, _ = run(load(source), "prepare", Plan(copies=((1, 0),), changed=True))
    kinds = [entry[0] for entry in log]
    assert kinds.index("record_event", 1) < kinds.index("copy_rows")

"""The device-planned path's handoff is generated from the table's [device] section: fresh,
step by step the table's, and a mutant of the table's handoff changes what the runtime runs."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any

import pytest

from model_check import codegen
from model_check.table import TableError
from model_check.table.mutants import device_mutant
from model_check.table.schema import DeviceTable, load_device_table
from rowcache.schedules import _device_generated

TABLE = load_device_table()


class Events:
    """Logs (kind, stream, event) per call."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []

    def record_event(self, stream: str, event: str) -> None:
        self.log.append(("record_event", stream, event))

    def wait_event(self, stream: str, event: str) -> None:
        self.log.append(("wait_event", stream, event))


def load(table: DeviceTable) -> types.ModuleType:
    name = "mutant_device_schedules"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    try:
        exec(compile(codegen.generate_device(table), "<mutant>", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def run(
    module: types.ModuleType, op: str, current: str, owner: str | None
) -> tuple[list[tuple[str, str, str]], Any]:
    events = Events()
    takeover = getattr(module, f"handoff_{op}")(events, current, owner)
    return events.log, takeover


def test_committed_file_is_fresh_and_checked() -> None:
    assert codegen.check() == []
    expected = codegen.generate_device(TABLE)
    assert codegen.DEVICE_GENERATED_PATH.read_text(encoding="utf-8") == expected
    text = expected.splitlines()
    assert "Generated from spec/table.toml by `python -m model_check.codegen`" in text[3]


def test_provider_operations_are_the_tables() -> None:
    names = tuple(op.name for op in TABLE.operations if op.provider)
    assert names == _device_generated.PROVIDER_OPERATIONS
    assert set(names) == {"device_prepare", "handoff", "device_invalidate", "check_errors"}


@pytest.mark.parametrize("owner", [None, "s0", "s1"])
def test_every_provider_operation_follows_its_steps(owner: str | None) -> None:
    """Record and wait in table order on the streams their roles name, when the owner
    changes; the work on the role of the operation's other steps; the owner by set_owner."""
    current = "s0"
    for op in TABLE.operations:
        if not op.provider:
            continue
        log, takeover = run(_device_generated, op.name, current, owner)
        on_owner = current if owner is None else owner
        change = owner is not None and owner != current
        roles = {"current": current, "owner": on_owner}
        assert log == [
            (s.kind, roles[s.stream], s.event)
            for s in op.steps
            if s.kind in ("record_event", "wait_event") and (s.when == "always" or change)
        ], op.name
        work = {roles[s.stream] for s in op.steps if s.event == "" and s.stream}
        assert takeover.work == (work.pop() if work else None), op.name
        after = {"current": current, "current_if_none": on_owner, "": owner}[op.set_owner]
        assert takeover.owner == after, op.name
        assert takeover.handed_over == (change and bool(log)), op.name


def test_a_mutant_of_the_handoff_reaches_the_generated_code() -> None:
    """dp_prepare_skips_handoff: an eager prepare from another stream no longer waits."""
    mutated = load(device_mutant("dp_prepare_skips_handoff").apply(TABLE))
    log, takeover = run(mutated, "device_prepare", "s1", "s0")
    assert log == [] and not takeover.handed_over
    real, _ = run(_device_generated, "device_prepare", "s1", "s0")
    assert real == [("record_event", "s0", "handoff"), ("wait_event", "s1", "handoff")]


@pytest.mark.parametrize(
    ("name", "op", "expected"),
    [
        # invalidate's update on the current stream, not the owner's
        ("dp_invalidate_on_current", "device_invalidate", ("s1", "s0")),
        # invalidate before any prepare leaves the owner unset
        ("dp_invalidate_takes_no_owner", "device_invalidate", ("s1", None)),
        # check_errors reads and resets on the current stream
        ("dp_check_errors_on_current", "check_errors", ("s1", "s0")),
    ],
)
def test_mutants_of_the_roles_reach_the_generated_code(
    name: str, op: str, expected: tuple[str, str | None]
) -> None:
    mutated = load(device_mutant(name).apply(TABLE))
    owner = None if name == "dp_invalidate_takes_no_owner" else "s0"
    _, takeover = run(mutated, op, "s1", owner)
    _, real = run(_device_generated, op, "s1", owner)
    assert (takeover.work, takeover.owner) == expected
    assert (takeover.work, takeover.owner) != (real.work, real.owner)


def test_a_handoff_step_after_the_work_has_no_generated_form() -> None:
    op = TABLE.op("device_prepare")
    steps = (*op.steps[2:], *op.steps[:2])
    with pytest.raises(TableError, match="after the operation's work"):
        codegen.generate_device(TABLE.with_op(replace(op, steps=steps)))

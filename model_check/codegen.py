"""Generate the row-level provider's device schedules from the transition table.

`python -m model_check.codegen` reads spec/table.toml (through `model_check.table.load_table`)
and writes rowcache/schedules/_generated.py: for every operation of the table, one
straight-line function `run_<op>(backend, ctx, plan)` that calls the backend method of each
step, in the table's order, on the stream its role names (`ctx.current`, `ctx.owner`,
`ctx.copy`), under a plain `if` for a `when` condition. It returns the stream that becomes the
owner (the table's `set_owner`), or None when the operation leaves the owner unchanged.

From the table's `[device]` section it writes rowcache/schedules/_device_generated.py: for
every provider operation of the device-planned path, `handoff_<op>(events, current, owner)`,
which runs the operation's handoff (its record_event / wait_event steps, under a plain `if` for
`owner_change`) on the streams their roles name and returns a `Takeover`: the stream the
operation's other steps run on, the owner after the call (the table's `set_owner`), and
whether the handoff ran.

`python -m model_check.codegen --check` (and `check()`, which the test suite calls) regenerates
both files in memory and reports any difference with the committed ones. The output is
formatted here, deterministically, in the project's style (ruff-clean, mypy --strict clean),
so generation does not depend on a formatter.

This module writes text only; it imports nothing from rowcache (and no torch).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from model_check.table.schema import (
    TABLE_PATH,
    DeviceOp,
    DeviceTable,
    Operation,
    Step,
    Table,
    TableError,
    load_device_table,
    load_table,
)

ROOT = Path(__file__).resolve().parent.parent
GENERATED_PATH = ROOT / "rowcache" / "schedules" / "_generated.py"
DEVICE_GENERATED_PATH = ROOT / "rowcache" / "schedules" / "_device_generated.py"

COMMAND = "python -m model_check.codegen"
ROLE_EXPR = {"current": "ctx.current", "owner": "ctx.owner", "copy": "ctx.copy"}
WHEN_EXPR = {
    "misses": "plan.copies",
    "changed": "plan.changed",
    # Roles.owner is the current stream when there is no owner yet (see Roles).
    "misses_or_handoff": "plan.copies or ctx.owner != ctx.current",
}
RING_CONTENT = {"resident": "plan.resident", "forward": "plan.forward"}
CONSUMER_KINDS = ("consumer_read",)
MAX_LINE = 100


def _q(text: str) -> str:
    """A double-quoted Python string literal (the project's quote style)."""
    return json.dumps(text)


def _stream(step: Step, where: str) -> str:
    try:
        return ROLE_EXPR[step.stream]
    except KeyError:
        raise TableError(f"{where}: stream role {step.stream!r} has no generated form") from None


def _call(step: Step, where: str) -> str:
    """The backend call of one step (without its `when` guard)."""
    kind = step.kind
    if kind in ("record_event", "wait_event", "wait_flag"):
        return f"backend.{kind}({_stream(step, where)}, {_q(step.event)})"
    if kind == "copy_rows":
        return f"backend.copy_rows({_stream(step, where)}, plan.copies)"
    if kind == "write_staging":
        return f"backend.write_staging({_q(step.ring)}, {RING_CONTENT[step.ring]})"
    if kind in ("upload_map", "release_staging"):
        return f"backend.{kind}({_stream(step, where)}, {_q(step.ring)})"
    if kind == "consumer_read":
        return f"backend.consumer_read({_stream(step, where)}, plan.forward_pairs)"
    if kind == "host_sync":
        target = "None" if step.stream == "all" else _stream(step, where)
        return f"backend.host_sync({target}, {_q(step.stream)})"
    raise TableError(f"{where}: step kind {kind!r} has no generated form")


def _docstring(op: Operation) -> list[str]:
    args = ", ".join(op.args)
    owner = f"; owner := {op.set_owner}" if op.set_owner else ""
    first = f"{op.name}({args}): guard {op.guard}, effect {op.effect}{owner}."
    lines = [f'    """{first}', ""]
    if not op.provider:
        lines += ["    A consumer operation: the provider never runs it; tests use it.", ""]
    if op.before_guard:
        lines += [f"    Before the guard: {', '.join(op.before_guard)}.", ""]
    if op.steps:
        lines.append("    Steps, in table order:")
        lines += [f"      {i}. {step.describe()}" for i, step in enumerate(op.steps)]
    else:
        lines.append("    No steps.")
    lines.append('    """')
    return lines


def _function(op: Operation) -> list[str]:
    if not op.name.isidentifier():
        raise TableError(f"operation name {op.name!r} is not a Python identifier")
    consumer = any(step.kind in CONSUMER_KINDS for step in op.steps)
    backend_type = "ConsumerBackend[S]" if consumer else "Backend[S]"
    lines = [
        f"def run_{op.name}(backend: {backend_type}, ctx: Roles[S], plan: Plan) -> S | None:",
        *_docstring(op),
    ]
    open_when = "always"  # consecutive steps with one condition share one `if`
    for index, step in enumerate(op.steps):
        where = f"{op.name} step {index}"
        call = _call(step, where)
        if step.when == "always":
            lines.append(f"    {call}")
        elif step.when in WHEN_EXPR:
            if open_when != step.when:
                lines.append(f"    if {WHEN_EXPR[step.when]}:")
            lines.append(f"        {call}")
        else:
            raise TableError(f"{where}: when {step.when!r} has no generated form")
        open_when = step.when
    if op.set_owner == "current":
        lines.append("    return ctx.current")
    elif not op.set_owner:
        lines.append("    return None")
    else:
        raise TableError(f"{op.name}: set_owner {op.set_owner!r} has no generated form")
    return lines


def generate(table: Table) -> str:
    """The full text of rowcache/schedules/_generated.py for `table`."""
    functions = [_function(op) for op in table.operations]
    names = [op.name for op in table.operations]
    if len(set(names)) != len(names):
        raise TableError(f"operation names repeat: {names}")
    uses_consumer = any("ConsumerBackend[S]" in fn[0] for fn in functions)
    imported = ["Backend", *(["ConsumerBackend"] if uses_consumer else []), "Plan", "Roles", "S"]
    provider_ops = tuple(op.name for op in table.operations if op.provider)
    consumer_ops = tuple(op.name for op in table.operations if not op.provider)
    exported = sorted(["CONSUMER_OPERATIONS", "PROVIDER_OPERATIONS", *(f"run_{n}" for n in names)])
    out = [
        '"""Device schedules of the row-level provider: one function per operation of the table.',
        "",
        f"Generated from spec/table.toml by `{COMMAND}`; do not edit.",
        "",
        "Each `run_<op>` calls the backend method of each of the operation's steps, in table",
        "order, on the stream its role names, and returns the stream that becomes the owner",
        "(None: the owner is unchanged).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        f"from rowcache.backends.base import {', '.join(imported)}",
        "",
        "__all__ = [",
        *[f"    {_q(name)}," for name in exported],
        "]",
        "",
        f"PROVIDER_OPERATIONS: tuple[str, ...] = {_tuple(provider_ops)}",
        f"CONSUMER_OPERATIONS: tuple[str, ...] = {_tuple(consumer_ops)}",
    ]
    return _module(out, functions)


def _module(head: list[str], functions: list[list[str]]) -> str:
    """The module's text: its head, then each function after two blank lines."""
    out = list(head)
    for fn in functions:
        out += ["", "", *fn]
    text = "\n".join(out) + "\n"
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_LINE:
            raise TableError(f"generated line {number} is longer than {MAX_LINE}: {line!r}")
    return text


def _tuple(items: Sequence[str]) -> str:
    if not items:
        return "()"
    if len(items) == 1:
        return f"({_q(items[0])},)"
    return "(" + ", ".join(_q(item) for item in items) + ")"


# ---------------------------------------------------------------- the device-planned path

HANDOFF_KINDS = ("record_event", "wait_event")
DEVICE_ROLE_EXPR = {"current": "current", "owner": "on_owner"}
DEVICE_WHEN_EXPR = {"owner_change": "owner is not None and owner != current"}
SET_OWNER_EXPR = {
    "current": "current",
    "current_if_none": "on_owner",
    "": "owner",
}


def _device_stream(role: str, where: str) -> str:
    try:
        return DEVICE_ROLE_EXPR[role]
    except KeyError:
        raise TableError(f"{where}: stream role {role!r} has no generated form") from None


def _handoff_function(op: DeviceOp) -> list[str]:
    """`handoff_<op>`: the operation's handoff steps, then its work stream and new owner."""
    if not op.name.isidentifier():
        raise TableError(f"operation name {op.name!r} is not a Python identifier")
    args = ", ".join(op.args)
    owner_text = f"; owner := {op.set_owner}" if op.set_owner else ""
    lines = [
        f"def handoff_{op.name}(events: Events[S], current: S, owner: S | None) -> Takeover[S]:",
        f'    """{op.name}({args}): guard {op.guard}{owner_text}.',
        "",
        "    Steps, in table order (the handoff here; the provider runs the others on `work`):",
        *[f"      {i}. {step.describe()}" for i, step in enumerate(op.steps)],
        '    """',
        "    on_owner = current if owner is None else owner",
    ]
    work: set[str] = set()
    handed = "False"
    open_when = "always"
    for index, step in enumerate(op.steps):
        where = f"{op.name} step {index}"
        if step.kind not in HANDOFF_KINDS:
            if step.stream:
                work.add(_device_stream(step.stream, where))
            continue
        if work:
            raise TableError(f"{where}: a {step.kind} after the operation's work")
        call = f"events.{step.kind}({_device_stream(step.stream, where)}, {_q(step.event)})"
        if step.when == "always":
            lines.append(f"    {call}")
            handed = "True"
        elif step.when in DEVICE_WHEN_EXPR:
            if open_when != step.when:
                lines.append(f"    handed_over = {DEVICE_WHEN_EXPR[step.when]}")
                lines.append("    if handed_over:")
                handed = "handed_over"
            lines.append(f"        {call}")
        else:
            raise TableError(f"{where}: when {step.when!r} has no generated form")
        open_when = step.when
    if len(work) > 1:
        raise TableError(f"{op.name}: its work runs on more than one role: {sorted(work)}")
    if op.set_owner not in SET_OWNER_EXPR:
        raise TableError(f"{op.name}: set_owner {op.set_owner!r} has no generated form")
    stream = work.pop() if work else "None"
    lines.append(f"    return Takeover({stream}, {SET_OWNER_EXPR[op.set_owner]}, {handed})")
    return lines


def generate_device(table: DeviceTable) -> str:
    """The full text of rowcache/schedules/_device_generated.py for `table`."""
    ops = [op for op in table.operations if op.provider]
    functions = [_handoff_function(op) for op in ops]
    handoffs = sorted(f"handoff_{op.name}" for op in ops)
    exported = ["PROVIDER_OPERATIONS", "Events", "Takeover", *handoffs]
    out = [
        '"""Stream handoff of the device-planned provider: one function per provider operation',
        "of the table's [device] section.",
        "",
        f"Generated from spec/table.toml by `{COMMAND}`; do not edit.",
        "",
        "Each `handoff_<op>(events, current, owner)` runs the operation's handoff steps (record",
        "and wait an event) on the streams their roles name (`owner` is None before the first",
        "owner; the owner role is then the current stream) and returns a `Takeover`: the stream",
        "the operation's other steps run on (None: it has none), the owner after the call, and",
        "whether the handoff ran. Capture is not the table's: a call during a CUDA graph capture",
        "changes no owner, and the provider does not call these then.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        "from typing import Generic, Protocol, TypeVar",
        "",
        "__all__ = [",
        *[f"    {_q(name)}," for name in exported],
        "]",
        "",
        'S = TypeVar("S")',
        'S_contra = TypeVar("S_contra", contravariant=True)',
        "",
        "PROVIDER_OPERATIONS: tuple[str, ...] = (",
        *[f"    {_q(op.name)}," for op in ops],
        ")",
        "",
        "",
        "class Events(Protocol[S_contra]):",
        '    """Record a named event on a stream; make a stream wait for it."""',
        "",
        "    def record_event(self, stream: S_contra, event: str) -> None: ...",
        "",
        "    def wait_event(self, stream: S_contra, event: str) -> None: ...",
        "",
        "",
        "@dataclass(frozen=True, slots=True)",
        "class Takeover(Generic[S]):",
        '    """The streams of one provider call after its handoff."""',
        "",
        "    work: S | None  # the stream of the operation's other steps (None: it has none)",
        "    owner: S | None  # the owner after the call",
        "    handed_over: bool  # the handoff's steps ran",
    ]
    return _module(out, functions)


def _diff(path: Path, expected: str, source: str) -> list[str]:
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    if actual == expected:
        return []
    return list(
        difflib.unified_diff(
            actual.splitlines(),
            expected.splitlines(),
            fromfile=f"{path} (committed)",
            tofile=f"{path} (generated from {source})",
            lineterm="",
        )
    )


def check(
    path: Path = GENERATED_PATH,
    table_path: Path = TABLE_PATH,
    device_path: Path = DEVICE_GENERATED_PATH,
) -> list[str]:
    """Regenerate in memory; the unified diffs against the committed files (empty: fresh)."""
    return _diff(path, generate(load_table(table_path)), table_path.name) + _diff(
        device_path, generate_device(load_device_table(table_path)), table_path.name
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="report a stale generated file instead of writing"
    )
    parser.add_argument("--table", type=Path, default=TABLE_PATH, help="the transition table")
    parser.add_argument("--out", type=Path, default=GENERATED_PATH, help="the generated file")
    parser.add_argument(
        "--device-out",
        type=Path,
        default=DEVICE_GENERATED_PATH,
        help="the generated file of the device-planned path's handoff",
    )
    options = parser.parse_args(argv)
    if options.check:
        diff = check(options.out, options.table, options.device_out)
        if diff:
            print("\n".join(diff))
            print(
                f"{options.out} or {options.device_out} is stale: run `{COMMAND}`", file=sys.stderr
            )
            return 1
        print(f"{options.out} and {options.device_out} are up to date")
        return 0
    outputs = (
        (options.out, generate(load_table(options.table))),
        (options.device_out, generate_device(load_device_table(options.table))),
    )
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate the row-level provider's device schedules from the transition table.

`python -m model_check.codegen` reads spec/table.toml (through `model_check.table.load_table`)
and writes rowcache/schedules/_generated.py: for every operation of the table, one
straight-line function `run_<op>(backend, ctx, plan)` that calls the backend method of each
step, in the table's order, on the stream its role names (`ctx.current`, `ctx.owner`,
`ctx.copy`), under a plain `if` for a `when` condition. It returns the stream that becomes the
owner (the table's `set_owner`), or None when the operation leaves the owner unchanged.

`python -m model_check.codegen --check` (and `check()`, which the test suite calls) regenerates
in memory and reports any difference with the committed file. The output is formatted here,
deterministically, in the project's style (ruff-clean, mypy --strict clean), so generation does
not depend on a formatter.

This module writes text only; it imports nothing from rowcache (and no torch).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from model_check.table.schema import TABLE_PATH, Operation, Step, Table, TableError, load_table

ROOT = Path(__file__).resolve().parent.parent
GENERATED_PATH = ROOT / "rowcache" / "schedules" / "_generated.py"

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


def check(path: Path = GENERATED_PATH, table_path: Path = TABLE_PATH) -> list[str]:
    """Regenerate in memory; the unified diff against the committed file (empty: fresh)."""
    expected = generate(load_table(table_path))
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    if actual == expected:
        return []
    return list(
        difflib.unified_diff(
            actual.splitlines(),
            expected.splitlines(),
            fromfile=f"{path} (committed)",
            tofile=f"{path} (generated from {table_path.name})",
            lineterm="",
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="report a stale generated file instead of writing"
    )
    parser.add_argument("--table", type=Path, default=TABLE_PATH, help="the transition table")
    parser.add_argument("--out", type=Path, default=GENERATED_PATH, help="the generated file")
    options = parser.parse_args(argv)
    if options.check:
        diff = check(options.out, options.table)
        if diff:
            print("\n".join(diff))
            print(f"{options.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{options.out} is up to date")
        return 0
    text = generate(load_table(options.table))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loading and validating the device-planned path's entries of the transition table.

The entries live in `spec/table.toml` under `[device]` (see the comment there for their
semantics). Like the host path's loader (model_check/table/schema.py, which ignores the
section), this one only parses plain data into frozen dataclasses and rejects any name the
semantics does not know.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_check.table import TABLE_PATH, TableError
from model_check.table.schema import Operations, describe_step, step_fields

ROLES = ("current", "owner", "capture")
DEVICE_KINDS = (
    "record_event",
    "wait_event",
    "plan",
    "gather",
    "consumer_read",
    "free_slot",
    "read_errors",
    "reset_errors",
)
HOST_KINDS = ("host_sync", "report")
KINDS = DEVICE_KINDS + HOST_KINDS
WHENS = ("always", "owner_change")
SET_OWNER = ("", "current", "current_if_none")
FN_KINDS = ("plan", "gather", "free_slot")
# Steps that read device state back to the host or block it: forbidden on the hot path (P8).
BLOCKING_KINDS = ("host_sync", "read_errors")

__all__ = [
    "DeviceOp",
    "DeviceStep",
    "DeviceTable",
    "load_device_table",
    "parse_device_table",
]


@dataclass(frozen=True)
class DeviceStep:
    kind: str
    stream: str = ""
    event: str = ""
    fn: str = ""
    when: str = "always"
    graph: bool = False

    def describe(self) -> str:
        return describe_step(self, {"fn": self.fn}, "(graph)" if self.graph else "")


@dataclass(frozen=True)
class DeviceOp:
    name: str
    args: tuple[str, ...]
    guard: str
    steps: tuple[DeviceStep, ...]
    set_owner: str = ""
    provider: bool = True
    hot: bool = False

    @property
    def uses_current(self) -> bool:
        """Whether the calling stream can matter: some role resolves to it (`owner` does when
        there is no owner yet, which a call that needs an unread forward map never meets)."""
        roles = {s.stream for s in self.steps}
        if self.guard == "forward_unread":
            roles.discard("owner")
        return bool(self.set_owner) or bool(roles & {"current", "owner"})


@dataclass(frozen=True)
class DeviceTable(Operations[DeviceOp]):
    consumer_streams: tuple[str, ...]
    capture_stream: str
    events: tuple[str, ...]
    operations: tuple[DeviceOp, ...]

    def uses_role(self, role: str) -> bool:
        return any(s.stream == role for op in self.operations for s in op.steps)


def _step(raw: dict[str, Any], events: tuple[str, ...], where: str) -> DeviceStep:
    fields = step_fields(raw, {"kind", "stream", "event", "fn", "when", "graph"}, where)
    step = DeviceStep(**{**fields, "graph": bool(raw.get("graph", False))})  # type: ignore[arg-type]
    validate_step(step, events, where)
    return step


def validate_step(step: DeviceStep, events: tuple[str, ...], where: str) -> None:
    from model_check.device_path.functions import FUNCTIONS

    if step.kind not in KINDS:
        raise TableError(f"{where}: kind {step.kind!r} is not one of {KINDS}")
    if step.kind == "report":
        if step.stream:
            raise TableError(f"{where}: report is a host step and takes no stream")
    elif step.kind == "host_sync":
        if step.stream not in (*ROLES, "all"):
            raise TableError(f"{where}: host_sync stream {step.stream!r} is not a role or 'all'")
    elif step.stream not in ROLES:
        raise TableError(f"{where}: stream {step.stream!r} is not one of {ROLES}")
    needs_event = step.kind in ("record_event", "wait_event")
    if needs_event != bool(step.event) or (step.event and step.event not in events):
        raise TableError(f"{where}: event {step.event!r} invalid for {step.kind}; events {events}")
    if (step.kind in FN_KINDS) != bool(step.fn):
        raise TableError(
            f"{where}: {step.kind} {'needs' if step.kind in FN_KINDS else 'takes no'} fn"
        )
    if step.fn and step.fn not in FUNCTIONS[step.kind]:
        raise TableError(
            f"{where}: fn {step.fn!r} is not a {step.kind} function; "
            f"known {sorted(FUNCTIONS[step.kind])}"
        )
    if step.when not in WHENS:
        raise TableError(f"{where}: when {step.when!r} is not one of {WHENS}")
    if step.when != "always" and step.kind not in ("record_event", "wait_event", "host_sync"):
        raise TableError(f"{where}: only events and host_sync take a `when`")
    if step.graph and (step.stream != "current" or step.kind in HOST_KINDS):
        raise TableError(
            f"{where}: a captured step runs on the replay stream: it must name 'current' and be a "
            "device operation"
        )


def validate_operation(op: DeviceOp) -> None:
    from model_check.device_path.functions import GUARDS

    if op.guard not in GUARDS:
        raise TableError(f"{op.name}: guard {op.guard!r} is not one of {sorted(GUARDS)}")
    if op.set_owner not in SET_OWNER:
        raise TableError(f"{op.name}: set_owner {op.set_owner!r} is not one of {SET_OWNER}")
    for arg in op.args:
        if arg not in ("ids", "pass", "expert"):
            raise TableError(f"{op.name}: argument {arg!r} is not ids, pass or expert")
    graph = [i for i, s in enumerate(op.steps) if s.graph]
    if graph and graph != list(range(graph[0], graph[-1] + 1)):
        raise TableError(f"{op.name}: the captured steps must be contiguous")
    if graph and "ids" not in op.args:
        raise TableError(f"{op.name}: a replay takes the step's ids")
    if any(s.kind == "plan" for s in op.steps) and "ids" not in op.args:
        raise TableError(f"{op.name}: a plan step needs ids")
    if any(s.kind == "free_slot" for s in op.steps) and "expert" not in op.args:
        raise TableError(f"{op.name}: a free_slot step needs an expert")


def parse_device_table(data: dict[str, Any]) -> DeviceTable:
    section = data["device"]
    events = tuple(str(e) for e in section.get("events", []))
    ops: list[DeviceOp] = []
    for raw in section["operation"]:
        name = str(raw["name"])
        known = {"name", "args", "guard", "steps", "set_owner", "provider", "hot"}
        extra = set(raw) - known
        if extra:
            raise TableError(f"{name}: unknown keys {sorted(extra)}; allowed {sorted(known)}")
        steps = tuple(
            _step(s, events, f"{name} step {i}") for i, s in enumerate(raw.get("steps", []))
        )
        op = DeviceOp(
            name=name,
            args=tuple(str(a) for a in raw.get("args", [])),
            guard=str(raw["guard"]),
            steps=steps,
            set_owner=str(raw.get("set_owner", "")),
            provider=bool(raw.get("provider", True)),
            hot=bool(raw.get("hot", False)),
        )
        validate_operation(op)
        ops.append(op)
    return DeviceTable(
        consumer_streams=tuple(str(s) for s in section["consumer"]),
        capture_stream=str(section["capture"]),
        events=events,
        operations=tuple(ops),
    )


def load_device_table(path: Path = TABLE_PATH) -> DeviceTable:
    """The device entries of the table (`[device]` in spec/table.toml)."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    if "device" not in data:
        raise TableError(f"no [device] section in {path}")
    return parse_device_table(data)


def table_text(table: DeviceTable) -> str:
    """The device section at a glance (spec/README.md shows it)."""
    consumers = ", ".join(table.consumer_streams)
    lines = [
        f"device streams: consumer {consumers}; capture {table.capture_stream} (graphs are "
        "captured there)",
        "roles: current = the calling stream; owner = the stream of the previous eager prepare "
        "or handoff",
        "  (current when none); capture = the capture stream",
    ]
    for op in table.operations:
        args = ", ".join(op.args)
        marks = [m for m, on in (("hot", op.hot), ("consumer", not op.provider)) if on]
        head = f"{op.name}({args})   guard {op.guard}"
        if marks:
            head += f"   ({', '.join(marks)})"
        if op.set_owner == "current":
            head += "   then owner := current"
        elif op.set_owner == "current_if_none":
            head += "   then owner := current if none"
        lines += ["", head]
        for i, step in enumerate(op.steps):
            text = step.kind
            if step.stream:
                text += f" on {step.stream}"
            if step.event:
                text += f" {step.event}"
            if step.fn:
                text += f" ({step.fn})"
            if step.when != "always":
                text += f" [{step.when}]"
            if step.graph:
                text += "   captured, every pass"
            lines.append(f"  {i + 1:2d}  {text}")
    return "\n".join(lines)

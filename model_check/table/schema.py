"""Loading and validating the transition table (spec/table.toml).

The table is plain data; this module only parses it into frozen dataclasses and rejects
entries that name an unknown role, kind, event or reference function, so that a typo in the
table fails loudly instead of silently changing the semantics.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar, cast

from model_check.table.reference import EFFECTS, GUARDS, PRE_GUARD_EFFECTS

TABLE_PATH = Path(__file__).resolve().parents[2] / "spec" / "table.toml"

STREAM_ROLES = ("current", "owner", "copy")
STEP_KINDS = (
    "record_event",
    "wait_event",
    "wait_flag",
    "copy_rows",
    "write_staging",
    "upload_map",
    "release_staging",
    "consumer_read",
    "host_sync",
)
EVENTS = ("release", "ready")
RINGS = ("resident", "forward")
WHENS = ("always", "misses", "changed", "misses_or_handoff")
HOST_ONLY_KINDS = ("write_staging",)


class TableError(ValueError):
    """The table names something the semantics does not know."""


def describe_step(step: Any, named: dict[str, str], tail: str = "") -> str:
    """`kind on stream event=... <named>=... when=... <tail>`: a step of either path."""
    parts = [step.kind]
    if step.stream:
        parts.append(f"on {step.stream}")
    if step.event:
        parts.append(f"event={step.event}")
    parts += [f"{key}={value}" for key, value in named.items() if value]
    if step.when != "always":
        parts.append(f"when={step.when}")
    return " ".join([*parts, tail] if tail else parts)


def step_fields(raw: dict[str, Any], known: set[str], where: str) -> dict[str, str]:
    """The string fields of a raw step (or operation), rejecting keys not in `known`."""
    extra = set(raw) - known
    if extra:
        raise TableError(f"{where}: unknown keys {sorted(extra)}; allowed {sorted(known)}")
    return {k: str(raw.get(k, "always" if k == "when" else "")) for k in known}


class Named(Protocol):
    @property
    def name(self) -> str: ...


Op = TypeVar("Op", bound=Named)


class Operations(Generic[Op]):
    """The operations of a table, by name."""

    operations: tuple[Op, ...]

    def op(self, name: str) -> Op:
        for operation in self.operations:
            if operation.name == name:
                return operation
        raise KeyError(f"the table has no operation {name!r}")

    def with_op(self, operation: Op) -> Self:
        ops = tuple(operation if o.name == operation.name else o for o in self.operations)
        changed: Self = replace(cast(Any, self), operations=ops)
        return changed


@dataclass(frozen=True)
class Step:
    kind: str
    stream: str = ""
    event: str = ""
    ring: str = ""
    when: str = "always"

    def describe(self) -> str:
        return describe_step(self, {"ring": self.ring})


@dataclass(frozen=True)
class Operation:
    name: str
    args: tuple[str, ...]
    guard: str
    effect: str
    steps: tuple[Step, ...]
    set_owner: str = ""
    provider: bool = True
    before_guard: tuple[str, ...] = ()


@dataclass(frozen=True)
class Table(Operations[Operation]):
    consumer_streams: tuple[str, ...]
    operations: tuple[Operation, ...]


def _step(raw: dict[str, Any], where: str) -> Step:
    step = Step(**step_fields(raw, {"kind", "stream", "event", "ring", "when"}, where))
    validate_step(step, where)
    return step


def validate_step(step: Step, where: str) -> None:
    if step.kind not in STEP_KINDS:
        raise TableError(f"{where}: kind {step.kind!r} is not one of {STEP_KINDS}")
    if step.kind in HOST_ONLY_KINDS:
        if step.stream:
            raise TableError(f"{where}: {step.kind} is a host step and takes no stream")
    elif step.kind == "host_sync":
        if step.stream not in (*STREAM_ROLES, "all"):
            raise TableError(f"{where}: host_sync stream {step.stream!r} is not a role or 'all'")
    elif step.stream not in STREAM_ROLES:
        raise TableError(f"{where}: stream {step.stream!r} is not one of {STREAM_ROLES}")
    needs_event = step.kind in ("record_event", "wait_event", "wait_flag")
    if needs_event != bool(step.event) or (step.event and step.event not in EVENTS):
        raise TableError(f"{where}: event {step.event!r} invalid for {step.kind}; events {EVENTS}")
    needs_ring = step.kind in ("write_staging", "upload_map", "release_staging")
    if needs_ring != bool(step.ring) or (step.ring and step.ring not in RINGS):
        raise TableError(f"{where}: ring {step.ring!r} invalid for {step.kind}; rings {RINGS}")
    if step.when not in WHENS:
        raise TableError(f"{where}: when {step.when!r} is not one of {WHENS}")


def parse_table(data: dict[str, Any]) -> Table:
    consumer = tuple(str(s) for s in data["streams"]["consumer"])
    ops: list[Operation] = []
    for raw in data["operation"]:
        name = str(raw["name"])
        steps = tuple(_step(s, f"{name} step {i}") for i, s in enumerate(raw.get("steps", [])))
        op = Operation(
            name=name,
            args=tuple(str(a) for a in raw.get("args", [])),
            guard=str(raw["guard"]),
            effect=str(raw["effect"]),
            steps=steps,
            set_owner=str(raw.get("set_owner", "")),
            provider=bool(raw.get("provider", True)),
            before_guard=tuple(str(x) for x in raw.get("before_guard", [])),
        )
        validate_operation(op, GUARDS, EFFECTS, PRE_GUARD_EFFECTS)
        ops.append(op)
    return Table(consumer_streams=consumer, operations=tuple(ops))


def validate_operation(op: Operation, guards: Any, effects: Any, pre_guard: Any) -> None:
    if op.guard not in guards:
        raise TableError(f"{op.name}: guard {op.guard!r} is not a reference function")
    if op.effect not in effects:
        raise TableError(f"{op.name}: effect {op.effect!r} is not a reference function")
    for name in op.before_guard:
        if name not in pre_guard:
            raise TableError(f"{op.name}: before_guard {name!r} is not a reference function")
    if op.set_owner and op.set_owner not in ("current",):
        raise TableError(f"{op.name}: set_owner {op.set_owner!r} must be 'current'")


def load_table(path: Path = TABLE_PATH) -> Table:
    with path.open("rb") as f:
        return parse_table(tomllib.load(f))

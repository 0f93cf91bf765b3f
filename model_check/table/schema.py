"""Loading and validating the transition table (spec/table.toml), both of its paths.

The table is plain data; this module only parses it into frozen dataclasses and rejects
entries that name an unknown role, kind, event or reference function, so that a typo in the
table fails loudly instead of silently changing the semantics. The host path's operations
(`Table`, `load_table`) and the device-planned path's, under `[device]` (`DeviceTable`,
`load_device_table`), are two kinds of operations of one table: steps a host call enqueues on
streams, and plans and copies that run on the stream of the layer, captured and replayed.
Both are read by the same step and operation code, each with its own vocabulary (`Vocabulary`).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, NamedTuple, Protocol, Self, TypeVar, cast

from model_check.table import device_functions
from model_check.table.reference import EFFECTS, GUARDS, NO_STREAM, PRE_GUARD_EFFECTS

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

# The device-planned path's vocabulary (`[device]`).
DEVICE_ROLES = ("current", "owner", "capture")
DEVICE_KINDS = (
    "record_event",
    "wait_event",
    "plan",
    "gather",
    "consumer_read",
    "free_slot",
    "read_errors",
    "reset_errors",
    "host_sync",
    "report",
)
DEVICE_HOST_KINDS = ("host_sync", "report")
DEVICE_WHENS = ("always", "owner_change")
SET_OWNER = ("", "current", "current_if_none")
FN_KINDS = ("plan", "gather", "free_slot")
# Steps that read device state back to the host or block it: forbidden on the hot path (P8).
BLOCKING_KINDS = ("host_sync", "read_errors")


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
S = TypeVar("S")


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


class Vocabulary(NamedTuple):
    """What the steps of one path may name."""

    kinds: tuple[str, ...]
    host_only: tuple[str, ...]  # host steps: no stream
    roles: tuple[str, ...]
    event_kinds: tuple[str, ...]
    events: tuple[str, ...]
    whens: tuple[str, ...]


HOST_VOCABULARY = Vocabulary(
    STEP_KINDS,
    HOST_ONLY_KINDS,
    STREAM_ROLES,
    ("record_event", "wait_event", "wait_flag"),
    EVENTS,
    WHENS,
)


def check_kind_and_stream(step: Any, v: Vocabulary, where: str) -> None:
    """A step's kind, stream role and event against a path's vocabulary."""
    if step.kind not in v.kinds:
        raise TableError(f"{where}: kind {step.kind!r} is not one of {v.kinds}")
    if step.kind in v.host_only:
        if step.stream:
            raise TableError(f"{where}: {step.kind} is a host step and takes no stream")
    elif step.kind == "host_sync":
        if step.stream not in (*v.roles, "all"):
            raise TableError(f"{where}: host_sync stream {step.stream!r} is not a role or 'all'")
    elif step.stream not in v.roles:
        raise TableError(f"{where}: stream {step.stream!r} is not one of {v.roles}")
    needs_event = step.kind in v.event_kinds
    if needs_event != bool(step.event) or (step.event and step.event not in v.events):
        raise TableError(
            f"{where}: event {step.event!r} invalid for {step.kind}; events {v.events}"
        )


def check_when(step: Any, v: Vocabulary, where: str) -> None:
    if step.when not in v.whens:
        raise TableError(f"{where}: when {step.when!r} is not one of {v.whens}")


def validate_step(step: Step, where: str) -> None:
    check_kind_and_stream(step, HOST_VOCABULARY, where)
    needs_ring = step.kind in ("write_staging", "upload_map", "release_staging")
    if needs_ring != bool(step.ring) or (step.ring and step.ring not in RINGS):
        raise TableError(f"{where}: ring {step.ring!r} invalid for {step.kind}; rings {RINGS}")
    check_when(step, HOST_VOCABULARY, where)


def parse_steps(
    raw: dict[str, Any], name: str, step: Callable[[dict[str, Any], str], S]
) -> tuple[S, ...]:
    return tuple(step(s, f"{name} step {i}") for i, s in enumerate(raw.get("steps", [])))


def parse_table(data: dict[str, Any]) -> Table:
    consumer = tuple(str(s) for s in data["streams"]["consumer"])
    ops: list[Operation] = []
    for raw in data["operation"]:
        name = str(raw["name"])
        steps = parse_steps(raw, name, _step)
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
    return parse_table(_read(path))


def _read(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


# ---------------------------------------------------------------- the device-planned path


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

    def owner_after(self, owner: int, current: int) -> int:
        """The owner stream once the call on `current` returns (`set_owner`)."""
        if self.set_owner == "current" or (
            self.set_owner == "current_if_none" and owner == NO_STREAM
        ):
            return current
        return owner


@dataclass(frozen=True)
class DeviceTable(Operations[DeviceOp]):
    consumer_streams: tuple[str, ...]
    capture_stream: str
    events: tuple[str, ...]
    operations: tuple[DeviceOp, ...]

    def uses_role(self, role: str) -> bool:
        return any(s.stream == role for op in self.operations for s in op.steps)


def device_vocabulary(events: tuple[str, ...]) -> Vocabulary:
    return Vocabulary(
        DEVICE_KINDS,
        ("report",),
        DEVICE_ROLES,
        ("record_event", "wait_event"),
        events,
        DEVICE_WHENS,
    )


def _device_step(raw: dict[str, Any], events: tuple[str, ...], where: str) -> DeviceStep:
    fields = step_fields(raw, {"kind", "stream", "event", "fn", "when", "graph"}, where)
    step = DeviceStep(**{**fields, "graph": bool(raw.get("graph", False))})  # type: ignore[arg-type]
    validate_device_step(step, events, where)
    return step


def validate_device_step(step: DeviceStep, events: tuple[str, ...], where: str) -> None:
    functions = device_functions.FUNCTIONS
    v = device_vocabulary(events)
    check_kind_and_stream(step, v, where)
    if (step.kind in FN_KINDS) != bool(step.fn):
        raise TableError(
            f"{where}: {step.kind} {'needs' if step.kind in FN_KINDS else 'takes no'} fn"
        )
    if step.fn and step.fn not in functions[step.kind]:
        raise TableError(
            f"{where}: fn {step.fn!r} is not a {step.kind} function; "
            f"known {sorted(functions[step.kind])}"
        )
    check_when(step, v, where)
    if step.when != "always" and step.kind not in ("record_event", "wait_event", "host_sync"):
        raise TableError(f"{where}: only events and host_sync take a `when`")
    if step.graph and (step.stream != "current" or step.kind in DEVICE_HOST_KINDS):
        raise TableError(
            f"{where}: a captured step runs on the replay stream: it must name 'current' and be a "
            "device operation"
        )


def validate_device_operation(op: DeviceOp) -> None:
    guards = device_functions.GUARDS
    if op.guard not in guards:
        raise TableError(f"{op.name}: guard {op.guard!r} is not one of {sorted(guards)}")
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
    begins: dict[str, str] = {}
    for raw in section["operation"]:
        name = str(raw["name"])
        step_fields(
            raw,
            {"name", "args", "guard", "steps", "set_owner", "provider", "hot", "begins_with"},
            name,
        )
        if "begins_with" in raw:
            begins[name] = str(raw["begins_with"])
        op = DeviceOp(
            name=name,
            args=tuple(str(a) for a in raw.get("args", [])),
            guard=str(raw["guard"]),
            steps=parse_steps(raw, name, lambda s, where: _device_step(s, events, where)),
            set_owner=str(raw.get("set_owner", "")),
            provider=bool(raw.get("provider", True)),
            hot=bool(raw.get("hot", False)),
        )
        validate_device_operation(op)
        ops.append(op)
    by_name = {op.name: op for op in ops}
    for name, first in begins.items():
        _check_begins_with(by_name, name, first)
    return DeviceTable(
        consumer_streams=tuple(str(s) for s in section["consumer"]),
        capture_stream=str(section["capture"]),
        events=events,
        operations=tuple(ops),
    )


def _check_begins_with(ops: dict[str, DeviceOp], name: str, first: str) -> None:
    """`begins_with`: the operation starts with another provider operation's call (a replay
    with the provider's handoff(), which the consumer calls first). Its steps before the
    captured ones must be that operation's, and its owner rule the same: only the provider
    operation's handoff is generated, so a difference would be checked here and not run."""
    where = f"{name}: begins_with {first!r}"
    if first not in ops or not ops[first].provider:
        raise TableError(f"{where} names no provider operation")
    op, called = ops[name], ops[first]
    prefix = tuple(s for s in op.steps if not s.graph)
    if prefix != called.steps or op.set_owner != called.set_owner:
        raise TableError(
            f"{where}: its steps before the captured ones and its set_owner must be {first}'s "
            f"(they are {[s.describe() for s in prefix]}, set_owner {op.set_owner!r}; "
            f"{first}: {[s.describe() for s in called.steps]}, set_owner {called.set_owner!r})"
        )


def load_device_table(path: Path = TABLE_PATH) -> DeviceTable:
    """The device entries of the table (`[device]` in spec/table.toml)."""
    data = _read(path)
    if "device" not in data:
        raise TableError(f"no [device] section in {path}")
    return parse_device_table(data)

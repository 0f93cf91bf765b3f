"""Seeded bugs of the device-planned path: each a change to the device table (a step dropped,
moved, or put on another stream; a function name swapped for its buggy twin in functions.py),
with the property it breaks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from model_check.device_path.table import DeviceOp, DeviceStep, DeviceTable


@dataclass(frozen=True)
class DeviceMutant:
    name: str
    breaks: str
    description: str
    apply: Callable[[DeviceTable], DeviceTable]


Edit = Callable[[list[DeviceStep]], list[DeviceStep]]


def _ops(
    names: tuple[str, ...], edit: Callable[[DeviceOp], DeviceOp]
) -> Callable[[DeviceTable], DeviceTable]:
    def apply(table: DeviceTable) -> DeviceTable:
        for name in names:
            table = table.with_op(edit(table.op(name)))
        return table

    return apply


def _steps(names: tuple[str, ...], edit: Edit) -> Callable[[DeviceTable], DeviceTable]:
    return _ops(names, lambda op: replace(op, steps=tuple(edit(list(op.steps)))))


def _find(steps: list[DeviceStep], kind: str, **fields: object) -> int:
    for i, step in enumerate(steps):
        if step.kind == kind and all(getattr(step, k) == v for k, v in fields.items()):
            return i
    raise LookupError(f"no {kind} step with {fields} to mutate")


def _fn(kind: str, fn: str) -> Edit:
    def edit(steps: list[DeviceStep]) -> list[DeviceStep]:
        return [replace(s, fn=fn) if s.kind == kind else s for s in steps]

    return edit


def _restream(kind: str, stream: str, **fields: object) -> Edit:
    def edit(steps: list[DeviceStep]) -> list[DeviceStep]:
        out = list(steps)
        found = False
        for i, s in enumerate(out):
            if s.kind == kind and all(getattr(s, k) == v for k, v in fields.items()):
                out[i] = replace(s, stream=stream)
                found = True
        if not found:
            raise LookupError(f"no {kind} step with {fields} to mutate")
        return out

    return edit


def _drop(*kinds: str) -> Edit:
    def edit(steps: list[DeviceStep]) -> list[DeviceStep]:
        out = [s for s in steps if s.kind not in kinds]
        if len(out) == len(steps):
            raise LookupError(f"no {kinds} step to drop")
        return out

    return edit


def _sync_owner_first(steps: list[DeviceStep]) -> list[DeviceStep]:
    return [DeviceStep(kind="host_sync", stream="owner"), *steps]


def _read_before_gather(steps: list[DeviceStep]) -> list[DeviceStep]:
    out = list(steps)
    g, r = _find(out, "gather", graph=True), _find(out, "consumer_read", graph=True)
    out[g], out[r] = out[r], out[g]
    return out


FORWARDS = ("device_prepare", "replay")

DEVICE_MUTANTS: tuple[DeviceMutant, ...] = (
    DeviceMutant(
        "dp_victim_from_group",
        "P5_victim_protection",
        "the planner may take a victim among the experts its pass exposes",
        _steps(FORWARDS, _fn("plan", "plan_pass_unprotected_victim")),
    ),
    DeviceMutant(
        "dp_protects_pass_only",
        "P5_victim_protection",
        "the planner protects only the experts its pass exposes and orders the step by id, so "
        "a pass may evict a resident that another pass of the same step requests while a "
        "victim outside the step exists",
        _steps(FORWARDS, _fn("plan", "plan_pass_protects_pass_only")),
    ),
    DeviceMutant(
        "dp_hits_not_first",
        # Its first pass evicts a resident that a later pass of the step requests while it
        # could have exposed it (P5); z3's first counterexample is the exposure itself (P3).
        "P5_victim_protection",
        "the step's passes expose its experts in id order instead of its hits first, so a pass "
        "may copy into the slot of a hit that a later pass then copies back",
        _steps(FORWARDS, _fn("plan", "plan_pass_hits_not_first")),
    ),
    DeviceMutant(
        "dp_next_pass_gather_unordered",
        "P1_no_overwrite_under_reader",
        "the captured forward gathers on the capture stream, so a later pass of a step may copy "
        "into a slot an earlier pass exposed before that pass's reader has used it",
        _steps(("replay",), _restream("gather", "capture", graph=True)),
    ),
    DeviceMutant(
        "dp_stale_forward_entry",
        "P3_forward_map_exact",
        "the planner writes the pass's entries into the forward map without clearing the "
        "previous pass's",
        _steps(FORWARDS, _fn("plan", "plan_pass_stale_forward")),
    ),
    DeviceMutant(
        "dp_gather_past_count",
        "P4_map_convergence",
        "the gather copies every entry of the miss list, not only the first `count` (the "
        "entries past it are left from an earlier pass)",
        _steps(FORWARDS, _fn("gather", "gather_whole_list")),
    ),
    DeviceMutant(
        "dp_graph_reads_before_gather",
        "P2_no_stale_read",
        "the captured graph runs the MoE kernel before the gather",
        _steps(("replay",), _read_before_gather),
    ),
    DeviceMutant(
        "dp_replay_wait_on_capture_stream",
        "P10_ordered_device_state",
        "the replay's handoff wait is enqueued on the capture stream instead of the replay stream",
        _steps(("replay",), _restream("wait_event", "capture", event="handoff")),
    ),
    DeviceMutant(
        "dp_prepare_skips_handoff",
        "P1_no_overwrite_under_reader",
        "an eager prepare from another stream than the owner skips the handoff",
        _steps(("device_prepare",), _drop("record_event", "wait_event")),
    ),
    DeviceMutant(
        "dp_invalidate_on_current",
        "P10_ordered_device_state",
        "invalidate enqueues its update on the current stream instead of the owner's",
        _steps(("device_invalidate",), _restream("free_slot", "current")),
    ),
    DeviceMutant(
        "dp_invalidate_takes_no_owner",
        "P10_ordered_device_state",
        "invalidate before any prepare runs on the current stream without making it the owner, "
        "so a prepare from another stream is not ordered after it",
        _ops(("device_invalidate",), lambda op: replace(op, set_owner="")),
    ),
    DeviceMutant(
        "dp_errors_reset_by_plan",
        "P9_device_errors_reported",
        "every pass overwrites the error counters instead of adding to them, so an error is "
        "lost when a clean pass runs before the next look",
        _steps(FORWARDS, _fn("plan", "plan_pass_resets_errors")),
    ),
    DeviceMutant(
        "dp_unchecked_ids",
        "P9_device_errors_reported",
        "the planner skips only -1 and uses other ids outside [0, E) as indices",
        _steps(FORWARDS, _fn("plan", "plan_pass_unchecked_ids")),
    ),
    DeviceMutant(
        "dp_check_errors_on_current",
        "P9_device_errors_reported",
        "check_errors reads and resets the counters on the current stream, not behind the "
        "owner's passes",
        _steps(
            ("check_errors",),
            lambda s: _restream("host_sync", "current")(
                _restream("reset_errors", "current")(_restream("read_errors", "current")(s))
            ),
        ),
    ),
    DeviceMutant(
        "dp_check_errors_without_sync",
        "P9_device_errors_reported",
        "check_errors looks at the counters without waiting for their copy to land",
        _steps(("check_errors",), _drop("host_sync")),
    ),
    DeviceMutant(
        "dp_host_sync_on_hot_path",
        "P8_hot_path_never_blocks",
        "an eager prepare synchronizes the owner stream before planning",
        _steps(("device_prepare",), _sync_owner_first),
    ),
)


def device_mutant(name: str) -> DeviceMutant:
    for m in DEVICE_MUTANTS:
        if m.name == name:
            return m
    raise KeyError(
        f"no device mutant named {name!r}; known: {', '.join(m.name for m in DEVICE_MUTANTS)}"
    )

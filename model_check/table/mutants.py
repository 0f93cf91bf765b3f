"""The catalogue of seeded bugs.

Each mutant is a small change to the table (a step dropped, moved, or put on another stream;
a reference function swapped for its buggy twin) together with the property it is expected
to break. A checker's green run means something only because every mutant here turns it red;
`python -m model_check mutants` prints who kills which.

Both paths' bugs are here: `MUTANTS` changes the host path's operations, `DEVICE_MUTANTS` the
device-planned path's (`[device]`; a function name swapped for its buggy twin in
`device_functions`), each through the same edits of a table's operations and steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from model_check.table.schema import DeviceStep, DeviceTable, Operations, Step, Table

T = TypeVar("T", bound=Operations[Any])


@dataclass(frozen=True)
class Mutant(Generic[T]):
    name: str
    breaks: str  # the property the bug violates
    description: str
    apply: Callable[[T], T]


def _edit(op_names: str | tuple[str, ...], edit: Callable[[Any], Any]) -> Callable[[T], T]:
    """Apply `edit` to the named operation (or to each of several)."""
    names = (op_names,) if isinstance(op_names, str) else op_names

    def apply(table: T) -> T:
        for name in names:
            table = table.with_op(edit(table.op(name)))
        return table

    return apply


def _steps(
    op_names: str | tuple[str, ...], edit: Callable[[list[Any]], list[Any]]
) -> Callable[[T], T]:
    return _edit(op_names, lambda op: replace(op, steps=tuple(edit(list(op.steps)))))


def _matches(step: Any, kind: str, fields: dict[str, object]) -> bool:
    return bool(step.kind == kind and all(getattr(step, k) == v for k, v in fields.items()))


def _find(steps: list[Any], kind: str, **fields: object) -> int:
    for i, step in enumerate(steps):
        if _matches(step, kind, fields):
            return i
    raise LookupError(f"no {kind} step with {fields} to mutate")


def _drop(kind: str, **fields: object) -> Callable[[list[Any]], list[Any]]:
    def edit(steps: list[Any]) -> list[Any]:
        del steps[_find(steps, kind, **fields)]
        return steps

    return edit


def _restream(
    kind: str, stream: str, *, every: bool = False, **fields: object
) -> Callable[[list[Any]], list[Any]]:
    """Put the first matching step (`every`: each one) on another stream."""

    def edit(steps: list[Any]) -> list[Any]:
        found = [i for i, s in enumerate(steps) if _matches(s, kind, fields)]
        if not found:
            raise LookupError(f"no {kind} step with {fields} to mutate")
        for i in found if every else found[:1]:
            steps[i] = replace(steps[i], stream=stream)
        return steps

    return edit


def _ready_before_copies(steps: list[Step]) -> list[Step]:
    ready = steps.pop(_find(steps, "record_event", event="ready"))
    steps.insert(_find(steps, "copy_rows"), ready)
    return steps


def _resident_map_first_on_current(steps: list[Step]) -> list[Step]:
    moved = [replace(s, stream="current") if s.stream else s for s in steps if s.ring == "resident"]
    return moved + [s for s in steps if s.ring != "resident"]


def _no_resident_reuse_event(steps: list[Step]) -> list[Step]:
    return [s for s in steps if not (s.kind == "release_staging" and s.ring == "resident")]


def _prepend(step: Any) -> Callable[[list[Any]], list[Any]]:
    return lambda steps: [step, *steps]


def _flag_wait_ready(steps: list[Step]) -> list[Step]:
    i = _find(steps, "wait_event", event="ready")
    steps[i] = replace(steps[i], kind="wait_flag")
    i = _find(steps, "wait_event", event="release")
    steps[i] = replace(steps[i], kind="wait_flag")
    return steps


def _hit_path_on_handoff(keep: tuple[str, ...]) -> Callable[[list[Step]], list[Step]]:
    """Steps guarded by misses_or_handoff run on misses only, except those of a kind in
    `keep`: an all-hit call from another stream skips (part of) the handoff."""

    def edit(steps: list[Step]) -> list[Step]:
        hits = [i for i, s in enumerate(steps) if s.when == "misses_or_handoff"]
        if not hits:
            raise LookupError("no misses_or_handoff step to mutate")
        for i in hits:
            if steps[i].kind not in keep and not (
                steps[i].kind == "wait_event" and steps[i].event in keep
            ):
                steps[i] = replace(steps[i], when="misses")
        return steps

    return edit


def _both(*edits: Callable[[Table], Table]) -> Callable[[Table], Table]:
    def apply(table: Table) -> Table:
        for edit in edits:
            table = edit(table)
        return table

    return apply


MUTANTS: tuple[Mutant[Table], ...] = (
    Mutant(
        "no_release_wait",
        "P1_no_overwrite_under_reader",
        "the copy stream does not wait on the release event before overwriting slots",
        _steps("prepare", _drop("wait_event", event="release")),
    ),
    Mutant(
        "release_on_current",
        "P1_no_overwrite_under_reader",
        "release is recorded on the current stream, not on the previous owner's",
        _steps("prepare", _restream("record_event", "current", event="release")),
    ),
    Mutant(
        "owner_not_updated",
        "P1_no_overwrite_under_reader",
        "prepare never makes the current stream the owner, so release is recorded on a "
        "stream the last forward may not have used",
        _edit("prepare", lambda op: replace(op, set_owner="")),
    ),
    Mutant(
        "hit_path_ignores_handoff",
        "P1_no_overwrite_under_reader",
        "an all-hit prepare from another stream skips the handoff too, so the next release, "
        "recorded on the new owner, does not cover the old owner's pending reads",
        _steps("prepare", _hit_path_on_handoff(keep=())),
    ),
    Mutant(
        "handoff_without_ready_wait",
        "P2_no_stale_read",
        "an all-hit prepare from another stream records release and ready but the current "
        "stream does not wait on ready, so its reads may overtake copies still in flight",
        _steps("prepare", _hit_path_on_handoff(keep=("record_event", "release"))),
    ),
    Mutant(
        "ready_before_copies",
        "P2_no_stale_read",
        "the ready event is recorded before the copies are enqueued",
        _steps("prepare", _ready_before_copies),
    ),
    Mutant(
        "no_ready_wait",
        "P2_no_stale_read",
        "the current stream does not wait on the ready event",
        _steps("prepare", _drop("wait_event", event="ready")),
    ),
    Mutant(
        "ready_on_current",
        "P2_no_stale_read",
        "ready is recorded on the current stream instead of the copy stream",
        _steps("prepare", _restream("record_event", "current", event="ready")),
    ),
    Mutant(
        "resident_map_on_current_first",
        "P4_map_convergence",
        "the resident map is uploaded on the current stream before the release wait",
        _steps("prepare", _resident_map_first_on_current),
    ),
    Mutant(
        "invalidate_map_on_current",
        "P4_map_convergence",
        "invalidate writes the resident map on the current stream, not the owner's",
        _steps(
            "invalidate",
            lambda s: _restream("release_staging", "current")(
                _restream("upload_map", "current")(s)
            ),
        ),
    ),
    Mutant(
        "keep_victim_mapped",
        "P4_map_convergence",
        "an evicted expert keeps its entry in the resident map",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_keep_victim_mapped")),
    ),
    Mutant(
        "victim_not_protected",
        "P5_victim_protection",
        "the LRU victim may be an expert the same call requested",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_unprotected_victim")),
    ),
    Mutant(
        "forward_map_from_resident",
        "P3_forward_map_exact",
        "the forward map exposes every resident expert, not just the requested ones",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_forward_from_resident")),
    ),
    Mutant(
        "staging_reuse_without_event",
        "P6_staging_lifetime",
        "no reuse event is recorded for resident-map staging buffers",
        _both(
            _steps("prepare", _no_resident_reuse_event),
            _steps("invalidate", _no_resident_reuse_event),
        ),
    ),
    Mutant(
        "forward_reuse_event_on_copy",
        "P6_staging_lifetime",
        "the forward-map staging buffer's reuse event is recorded on the copy stream, which "
        "reaches it before the upload on the current stream ran",
        _steps("prepare", _restream("release_staging", "copy", ring="forward")),
    ),
    Mutant(
        "host_sync_on_owner",
        "P8_no_host_block_on_reader",
        "prepare synchronizes the owner stream before enqueueing",
        _steps("prepare", _prepend(Step(kind="host_sync", stream="owner"))),
    ),
    Mutant(
        "validate_after_touch",
        "P9_validation_first",
        "prepare refreshes the LRU position of requested experts before validating the call",
        _edit("prepare", lambda op: replace(op, before_guard=("touch_requested",))),
    ),
    Mutant(
        "wait_for_latest_record",
        "P7_no_deadlock",
        "the waits on release and ready wait for the event's latest record when they execute "
        "(a device-side flag), not for the snapshot taken when the wait was enqueued",
        _steps("prepare", _flag_wait_ready),
    ),
)


def mutant(name: str) -> Mutant[Table]:
    return _named(MUTANTS, name, "mutant")


def _named(catalogue: tuple[Mutant[T], ...], name: str, what: str) -> Mutant[T]:
    for m in catalogue:
        if m.name == name:
            return m
    raise KeyError(f"no {what} named {name!r}; known: {', '.join(m.name for m in catalogue)}")


# ---------------------------------------------------------------- the device-planned path

DeviceEdit = Callable[[list[DeviceStep]], list[DeviceStep]]


def _fn(kind: str, fn: str) -> DeviceEdit:
    def edit(steps: list[DeviceStep]) -> list[DeviceStep]:
        return [replace(s, fn=fn) if s.kind == kind else s for s in steps]

    return edit


def _drop_kinds(*kinds: str) -> DeviceEdit:
    def edit(steps: list[DeviceStep]) -> list[DeviceStep]:
        out = [s for s in steps if s.kind not in kinds]
        if len(out) == len(steps):
            raise LookupError(f"no {kinds} step to drop")
        return out

    return edit


def _read_before_gather(steps: list[DeviceStep]) -> list[DeviceStep]:
    out = list(steps)
    g, r = _find(out, "gather", graph=True), _find(out, "consumer_read", graph=True)
    out[g], out[r] = out[r], out[g]
    return out


FORWARDS = ("device_prepare", "replay")

DEVICE_MUTANTS: tuple[Mutant[DeviceTable], ...] = (
    Mutant(
        "dp_victim_from_group",
        "P5_victim_protection",
        "the planner may take a victim among the experts its pass exposes",
        _steps(FORWARDS, _fn("plan", "plan_pass_unprotected_victim")),
    ),
    Mutant(
        "dp_protects_pass_only",
        "P5_victim_protection",
        "the planner protects only the experts its pass exposes and orders the step by id, so "
        "a pass may evict a resident that another pass of the same step requests while a "
        "victim outside the step exists",
        _steps(FORWARDS, _fn("plan", "plan_pass_protects_pass_only")),
    ),
    Mutant(
        "dp_hits_not_first",
        # Its first pass evicts a resident that a later pass of the step requests while it
        # could have exposed it (P5); z3's first counterexample is the exposure itself (P3).
        "P5_victim_protection",
        "the step's passes expose its experts in id order instead of its hits first, so a pass "
        "may copy into the slot of a hit that a later pass then copies back",
        _steps(FORWARDS, _fn("plan", "plan_pass_hits_not_first")),
    ),
    Mutant(
        "dp_next_pass_gather_unordered",
        "P1_no_overwrite_under_reader",
        "the captured forward gathers on the capture stream, so a later pass of a step may copy "
        "into a slot an earlier pass exposed before that pass's reader has used it",
        _steps(("replay",), _restream("gather", "capture", every=True, graph=True)),
    ),
    Mutant(
        "dp_stale_forward_entry",
        "P3_forward_map_exact",
        "the planner writes the pass's entries into the forward map without clearing the "
        "previous pass's",
        _steps(FORWARDS, _fn("plan", "plan_pass_stale_forward")),
    ),
    Mutant(
        "dp_gather_past_count",
        "P4_map_convergence",
        "the gather copies every entry of the miss list, not only the first `count` (the "
        "entries past it are left from an earlier pass)",
        _steps(FORWARDS, _fn("gather", "gather_whole_list")),
    ),
    Mutant(
        "dp_graph_reads_before_gather",
        "P2_no_stale_read",
        "the captured graph runs the MoE kernel before the gather",
        _steps(("replay",), _read_before_gather),
    ),
    Mutant(
        "dp_replay_wait_on_capture_stream",
        "P10_ordered_device_state",
        "the replay's handoff wait is enqueued on the capture stream instead of the replay stream",
        _steps(("replay",), _restream("wait_event", "capture", every=True, event="handoff")),
    ),
    Mutant(
        "dp_prepare_skips_handoff",
        "P1_no_overwrite_under_reader",
        "an eager prepare from another stream than the owner skips the handoff",
        _steps(("device_prepare",), _drop_kinds("record_event", "wait_event")),
    ),
    Mutant(
        "dp_invalidate_on_current",
        "P10_ordered_device_state",
        "invalidate enqueues its update on the current stream instead of the owner's",
        _steps(("device_invalidate",), _restream("free_slot", "current", every=True)),
    ),
    Mutant(
        "dp_invalidate_takes_no_owner",
        "P10_ordered_device_state",
        "invalidate before any prepare runs on the current stream without making it the owner, "
        "so a prepare from another stream is not ordered after it",
        _edit(("device_invalidate",), lambda op: replace(op, set_owner="")),
    ),
    Mutant(
        "dp_errors_reset_by_plan",
        "P9_device_errors_reported",
        "every pass overwrites the error counters instead of adding to them, so an error is "
        "lost when a clean pass runs before the next look",
        _steps(FORWARDS, _fn("plan", "plan_pass_resets_errors")),
    ),
    Mutant(
        "dp_unchecked_ids",
        "P9_device_errors_reported",
        "the planner skips only -1 and uses other ids outside [0, E) as indices",
        _steps(FORWARDS, _fn("plan", "plan_pass_unchecked_ids")),
    ),
    Mutant(
        "dp_check_errors_on_current",
        "P9_device_errors_reported",
        "check_errors reads and resets the counters on the current stream, not behind the "
        "owner's passes",
        _steps(
            ("check_errors",),
            lambda s: _restream("host_sync", "current", every=True)(
                _restream("reset_errors", "current", every=True)(
                    _restream("read_errors", "current", every=True)(s)
                )
            ),
        ),
    ),
    Mutant(
        "dp_check_errors_without_sync",
        "P9_device_errors_reported",
        "check_errors looks at the counters without waiting for their copy to land",
        _steps(("check_errors",), _drop_kinds("host_sync")),
    ),
    Mutant(
        "dp_host_sync_on_hot_path",
        "P8_hot_path_never_blocks",
        "an eager prepare synchronizes the owner stream before planning",
        _steps(("device_prepare",), _prepend(DeviceStep(kind="host_sync", stream="owner"))),
    ),
)


def device_mutant(name: str) -> Mutant[DeviceTable]:
    return _named(DEVICE_MUTANTS, name, "device mutant")

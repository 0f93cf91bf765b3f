"""The properties every checker decides, and the "sometimes" observations that keep a green
run from being vacuous (spec/README.md states both): the host path's (`PROPERTIES`,
`REACHABILITY`) and the device-planned path's (`DEVICE_PROPERTIES`, `DEVICE_REACHABILITY`)."""

from __future__ import annotations

from dataclasses import dataclass

PROPERTIES: dict[str, str] = {
    "P1_no_overwrite_under_reader": "a copy into a slot never runs before an earlier-enqueued "
    "read of that slot finished",
    "P2_no_stale_read": "a read runs after every earlier-enqueued copy into its slots and finds "
    "exactly the experts its forward map names",
    "P3_forward_map_exact": "the forward map exposes exactly the requested experts, each in "
    "its own slot, and agrees with the resident map",
    "P4_map_convergence": "when the device is idle the device resident map equals the host "
    "mirror and every mapped slot holds its expert",
    "P5_victim_protection": "no expert requested by a call is evicted by it, and none its step "
    "requests while a victim outside the step exists",
    "P6_staging_lifetime": "the host never rewrites a staging buffer an enqueued upload still "
    "reads",
    "P7_no_deadlock": "the device can always run some pending operation",
    "P8_no_host_block_on_reader": "no provider call blocks the host on consumer work",
    "P9_validation_first": "a rejected call leaves the whole state unchanged",
}

# Reachability ("sometimes") observations: tags the device models attach to transitions.
REACHABILITY: dict[str, str] = {
    "eviction": "a prepare evicts a resident expert",
    "owner_change": "a prepare is called from a stream other than the owner",
    "prepare_all_hits": "a prepare finds every requested expert resident",
    "copy_while_slot_read_pending": "a copy into a slot is enqueued while a read of it is pending",
    "freed_slot_reused_while_read_pending": "a slot freed by invalidate is refilled while a "
    "reader of it is pending",
    "copy_waits_on_reader": "the copy stream's release wait depends on a pending read",
    "invalidate_resident": "invalidate removes a resident expert",
    "staging_resident_buffer_reused": "a resident-map staging buffer is reused",
    "staging_resident_fresh_buffer": "a resident-map staging buffer is still in flight, so a "
    "fresh one is taken",
    "rejected_prepare": "a prepare with bad input is rejected",
    "device_idle": "the device drains completely after work was enqueued",
}


# Seen only under a policy other than LRU (both paths): the searches of such bounds expect it.
POLICY_REACHABILITY: dict[str, str] = {
    "victim_by_count": "a victim is not the one least recent use would choose (policy lfu)",
    "counts_halved": "a pass halves every request count (policy lfu)",
}


def with_policy_tags(tags: frozenset[str], policy: str) -> frozenset[str]:
    """The tags a search at bounds of ``policy`` must see: ``tags``, and under "lfu" the
    policy's own."""
    return tags | frozenset(POLICY_REACHABILITY) if policy == "lfu" else tags


# The device-planned path's ([device] in spec/table.toml): P6 has no counterpart (no staging
# buffers); P10 is its race property on the device cache state.
DEVICE_PROPERTIES: dict[str, str] = {
    "P1_no_overwrite_under_reader": "a gather into a slot never runs before an earlier-enqueued "
    "read of that slot finished",
    "P2_no_stale_read": "a read runs after the gather that filled its slots and finds exactly its "
    "pass's forward map and the experts it names",
    "P3_forward_map_exact": "a pass's forward map exposes exactly the experts of its group, each "
    "in its own slot, agreeing with the resident map",
    "P4_map_convergence": "when the device is idle its cache state equals the reference applied in "
    "host-call order and every mapped slot holds its expert",
    "P5_victim_protection": "no expert a pass exposes is evicted by it, and none its step "
    "requests while a resident outside the step stays",
    "P7_no_deadlock": "the device can always run some pending operation",
    "P8_hot_path_never_blocks": "the hot path (prepare, handoff, replay, invalidate) never blocks "
    "the host and never reads device state",
    "P9_device_errors_reported": "a call the host rejects changes nothing; a plan writes nothing "
    "out of bounds, and the error it counts reaches the host at the next look (check_errors, "
    "stats) after it, never dropped",
    "P10_ordered_device_state": "every two accesses to the device cache state, forward map, miss "
    "list or error counters, one of them a write, are ordered by happens-before",
}

# Its reachability observations.
DEVICE_REACHABILITY: dict[str, str] = {
    "eviction": "a pass evicts a resident expert",
    "owner_change": "a hot-path call is made on another stream than the owner",
    "replay_on_other_stream": "a graph is replayed on another stream than the owner",
    "multi_pass_replay": "a replay runs more than one pass",
    "empty_pass": "a pass exposes no expert (all padding)",
    "invalidate_resident": "invalidate frees a resident expert",
    "error_counted": "a pass counts an error (an id outside [-1, E))",
    "error_reported": "check_errors reports an error",
    "rejected_device_prepare": "a prepare with a bad pass index is rejected",
    "rejected_device_invalidate": "invalidate of an expert outside [0, E) is rejected",
    "gather_while_slot_read_pending": "a gather into a slot is enqueued while a read of it is "
    "pending on another stream",
    "state_access_pending_elsewhere": "a plan or invalidate is enqueued while an access to the "
    "cache state is pending on another stream",
    "device_idle": "the device drains completely after work was enqueued",
}


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str


# What every explicit model reports when pending operations remain and none can run.
DEADLOCK = Violation("P7_no_deadlock", "pending operations remain and none can run")

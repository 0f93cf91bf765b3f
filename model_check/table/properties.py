"""The properties every checker decides, and the "sometimes" observations that keep a green
run from being vacuous (spec/README.md states both)."""

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


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str


# What every explicit model reports when pending operations remain and none can run.
DEADLOCK = Violation("P7_no_deadlock", "pending operations remain and none can run")

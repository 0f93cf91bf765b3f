"""The planner as plain torch operations: the reference of the fused planner and the CPU path.

Fixed shapes throughout (vectors of ``E`` experts and ``C`` slots, never a value read back), so
it is also capturable on CUDA. One call plans one pass of one step:

1. mark the requested experts: ids in ``[0, E)``; ``-1`` is padding; anything else is counted
   as a bad id (first pass only, so each entry counts once) and otherwise ignored;
2. the step's order: its first pass ranks the requested experts, those resident then (its
   hits) first, then the others, each in ascending id order, and stores the ranks in
   ``step_rank`` when the step needs more than one pass; pass ``p`` selects the requested
   experts of rank ``[p*C, (p+1)*C)`` (``model_check.table.reference.step_order``); so the
   first pass serves every hit before any copy can evict it, and later passes only copy;
3. hits keep their slots; misses, in ascending id order, take the free slots in ascending slot
   order, then the slots of the residents outside the step, then those of the step's experts
   that other passes expose, never one this pass selects (the model's ``_plan_prepare`` with
   the step: victim protection over the whole step); within each the least recently used
   first, or under policy ``lfu`` the fewest requests first (the selected experts counted
   first, ``rowcache.policy``), ties to the least recently used;
4. the selected experts become the most recently used, in ascending id order (stamps
   ``clock + rank``);
5. the forward map exposes exactly the selected experts; the miss list names the copies.

The last pass also counts requested experts that no pass exposed (``overflow``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rowcache.device_plan.state import (
    BAD_IDS,
    EVICTIONS,
    HITS,
    INVALIDATIONS,
    MISSES,
    OVERFLOW,
    PASSES,
    PREPARE_CALLS,
    DeviceCacheState,
)

__all__ = ["invalidate_expert", "plan_pass"]

_NEVER = 1 << 62  # sort key of a slot that must not be taken (its expert is selected)
_STEP_TIER = 1 << 50  # added to the key of a slot whose expert the step requests: taken last
# Under lfu, a slot's key holds its expert's count above the stamps and below the step's tier
# (counts are at most 15). The clock advances by at most C a pass: at C = 32 and 1,000 passes
# a second a layer, stamps reach 2**44 after 17 years (past it lfu's order would be wrong, and
# only past 2**48 in the fused planner, 2**50 here, LRU's; no write ever goes out of bounds).
COUNT_SHIFT = 44


def _exclusive_rank(mask: Tensor) -> Tensor:
    """For every True entry, the number of True entries before it."""
    as_int = mask.to(torch.int64)
    return torch.cumsum(as_int, 0) - as_int


def _scatter(target: Tensor, index: Tensor, values: Tensor, keep: Tensor) -> None:
    """``target[index[i]] = values[i]`` where ``keep[i]``, with a sink entry for the rest, so
    that no index outside ``target`` is ever written."""
    sink = target.shape[0]
    padded = torch.cat([target, target.new_zeros(1)])
    padded.scatter_(0, torch.where(keep, index, sink), values.to(target.dtype))
    target.copy_(padded[:sink])


def plan_pass(state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int) -> None:
    """Plan pass ``pass_index`` of ``num_passes`` for ``topk_ids`` (any integer dtype, any
    shape; on the state's device), updating ``state`` in place."""
    num_experts, capacity = state.num_experts, state.capacity
    device = state.resident.device
    ids = topk_ids.reshape(-1).to(device=device, dtype=torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    counters = state.counters
    if pass_index == 0 and ids.numel() > 0:
        bad = ~valid & (ids != -1)
        first = ids[torch.argmax(bad.to(torch.int32))]
        unseen = (counters[BAD_IDS] == 0) & bad.any()
        state.first_bad.copy_(torch.where(unseen, first, state.first_bad[0]).reshape(1))
        counters[BAD_IDS] += bad.sum()

    requested = torch.zeros(num_experts + 1, dtype=torch.bool, device=device)
    requested.scatter_(0, torch.where(valid, ids, num_experts), True)
    requested = requested[:num_experts]
    if pass_index == 0:
        # The step's order: hits first, then misses, each in ascending id order; stored for
        # the later passes only when there are any (a short order would give them nothing).
        hit = requested & (state.resident >= 0)
        rest = requested & ~hit
        fresh = torch.where(hit, _exclusive_rank(hit), hit.sum() + _exclusive_rank(rest))
        rank = torch.where(requested, fresh, -1)
        long = requested.sum() > capacity
        state.step_rank.copy_(torch.where(long & requested, fresh, -1))
    else:
        rank = state.step_rank.to(torch.int64)
    low = pass_index * capacity
    selected = requested & (rank >= low) & (rank < low + capacity)
    # The step's experts this pass protects: the stored order's that these ids request (the
    # pass's own when none is stored).
    stored = state.step_rank >= 0
    in_step = torch.where(stored.any(), stored & requested, selected)
    if pass_index == num_passes - 1:
        over = requested.sum() - num_passes * capacity
        counters[OVERFLOW] += over.clamp(min=0)

    if state.count_max:
        # Policy lfu: the selected experts' requests, every count halved first when one of
        # them is at the maximum.
        full = (selected & (state.counts >= state.count_max)).any()
        halved = torch.where(full, state.counts // 2, state.counts)
        state.counts.copy_(halved + selected.to(torch.int32))

    experts = torch.arange(num_experts, device=device)
    slots = torch.arange(capacity, device=device)
    slot_of = state.resident.to(torch.int64)
    miss = selected & (slot_of < 0)
    miss_rank = _exclusive_rank(miss)
    n_selected = selected.sum()
    n_miss = miss.sum()

    # Victim order: free slots by slot number, then residents outside the step by stamp
    # (oldest first), then the step's other experts by stamp; slots of selected experts never.
    owners = state.owners.to(torch.int64)
    free = owners < 0
    owned = owners.clamp(min=0)
    owner_selected = selected[owned] & ~free
    tier = torch.where(in_step[owned], _STEP_TIER, 0)
    if state.count_max:
        tier = tier + (state.counts[owned].to(torch.int64) << COUNT_SHIFT)
    key = torch.where(
        free, slots, torch.where(owner_selected, _NEVER, capacity + tier + state.stamps)
    )
    order = torch.argsort(key, stable=True)
    assigned = order[miss_rank.clamp(max=capacity - 1)]
    evicted = owners[assigned]
    evicts = miss & (evicted >= 0)

    _scatter(state.resident, evicted, torch.full_like(evicted, -1), evicts)
    _scatter(state.resident, experts, assigned, miss)
    _scatter(state.owners, assigned, experts, miss)
    slot_now = torch.where(miss, assigned, slot_of)
    clock = state.clock[0]
    # Selected experts become the most recently used in ascending id order.
    _scatter(state.stamps, slot_now, clock + _exclusive_rank(selected), selected)
    state.clock.add_(n_selected)

    state.forward.copy_(torch.where(selected, slot_now, -1))
    state.miss_experts.fill_(-1)
    state.miss_slots.fill_(-1)
    _scatter(state.miss_experts, miss_rank, experts, miss)
    _scatter(state.miss_slots, miss_rank, assigned, miss)
    state.miss_count.copy_(n_miss.reshape(1))

    counters[HITS] += n_selected - n_miss
    counters[MISSES] += n_miss
    counters[EVICTIONS] += evicts.sum()
    counters[PREPARE_CALLS] += ((n_selected > 0) | (pass_index == 0)).to(torch.int64)
    counters[PASSES] += 1


def invalidate_expert(state: DeviceCacheState, expert_id: int) -> None:
    """Free ``expert_id``'s slot if it is resident (a no-op otherwise), on the device.

    ``expert_id`` is a host int already checked against ``[0, E)``; the slot is read on the
    device, so the host never waits for it.
    """
    slot = state.resident.narrow(0, expert_id, 1).to(torch.int64)
    resident = slot >= 0
    safe = slot.clamp(min=0)
    kept = torch.where(resident, -1, state.owners.index_select(0, safe))
    state.owners.index_copy_(0, safe, kept.to(torch.int32))
    state.resident.narrow(0, expert_id, 1).fill_(-1)
    state.counters[INVALIDATIONS] += resident.to(torch.int64).sum()

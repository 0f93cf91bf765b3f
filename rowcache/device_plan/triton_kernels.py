"""The fused CUDA kernels of the device-planned path, in Triton.

* ``plan_kernel``: one program plans one pass (``rowcache.device_plan.torch_planner`` is the
  same algorithm in torch operations and the reference the GPU tests compare against). One
  program is enough: the vectors are ``E`` experts and ``C`` slots long, a few hundred lanes,
  and one program can order its own global writes and reads with ``debug_barrier`` (a block
  barrier), which a multi-program kernel could not.
* ``gather_kernel``: a fixed grid of programs walks the work items (miss, piece of a region)
  of the chunk table (``rowcache.device_plan.regions``); the number of items comes from the
  miss count on the device, so with no miss every program returns after one load. Sources are
  pinned host memory read through unified addressing.
* ``invalidate_kernel``: frees one expert's slot.

No kernel here can write outside its tensors: every store is masked by bounds derived from
``E``, ``C`` and the miss count, and ids outside ``[0, E)`` only ever reach counters.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEVER = tl.constexpr(1 << 50)  # sort key of a slot never taken; times BLOCK_C (<= 4096) fits int64
STEP_TIER = tl.constexpr(1 << 48)  # added to the key of a slot whose expert the step requests
# Policy lfu: the expert's request count (<= 15) sits in the key between the stamp (below
# 2**44) and the step's tier.
COUNT_SHIFT = tl.constexpr(44)


# The step's sizes are plain runtime integers: Triton would otherwise build a kernel apart for
# each value that is 1 or a multiple of 16 (a pass index of 1, a routing-entry count divisible
# by 16), and a server would build those on its first prompts of each kind, stalling a step
# about 0.37 s each (measured on an H100, Triton 3.6: four builds for each new prompt size
# class). With them plain, a kernel differs only by its block sizes and pass flags, which the
# profile run and the graph captures build (``kernels.launch_plan``).
@triton.jit(do_not_specialize=["n_ids", "count_max", "pass_index", "num_passes"])
def plan_kernel(
    ids_ptr,
    n_ids,
    resident_ptr,
    owners_ptr,
    stamps_ptr,
    clock_ptr,
    forward_ptr,
    miss_experts_ptr,
    miss_slots_ptr,
    miss_count_ptr,
    counters_ptr,
    first_bad_ptr,
    marks_ptr,
    order_ptr,
    step_rank_ptr,
    counts_ptr,
    count_max,
    pass_index,
    num_passes,
    E,
    C,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FIRST_PASS: tl.constexpr,
    LAST_PASS: tl.constexpr,
    COUNTED: tl.constexpr = False,
    MUTANT: tl.constexpr = 0,
):
    e = tl.arange(0, BLOCK_E)
    e_in = e < E
    s = tl.arange(0, BLOCK_C)
    s_in = s < C

    # 1. Mark the requested experts; count ids outside [-1, E) (first pass only).
    tl.store(marks_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_in)
    tl.debug_barrier()
    n_bad = tl.zeros([], dtype=tl.int64)
    first_k = tl.zeros([], dtype=tl.int64) + n_ids
    for start in range(0, n_ids, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        k_in = k < n_ids
        ids = tl.load(ids_ptr + k, mask=k_in, other=-1).to(tl.int64)
        valid = k_in & (ids >= 0) & (ids < E)
        tl.store(marks_ptr + ids, tl.full([BLOCK_N], 1, tl.int32), mask=valid)
        if FIRST_PASS:
            bad = k_in & (ids != -1) & ~valid
            n_bad += tl.sum(bad.to(tl.int64), axis=0)
            first_k = tl.minimum(first_k, tl.min(tl.where(bad, k.to(tl.int64), n_ids), axis=0))
    tl.debug_barrier()

    # 2. The step's order (hits first, then misses, each in ascending id order), fixed by its
    #    first pass and stored for the later ones when there are any; this pass selects the
    #    requested experts of rank [pass*C, (pass+1)*C).
    requested = (tl.load(marks_ptr + e, mask=e_in, other=0) > 0) & e_in
    req_i = requested.to(tl.int32)
    slot_of = tl.load(resident_ptr + e, mask=e_in, other=0)
    if FIRST_PASS:
        if (MUTANT == 5) or (MUTANT == 6):
            hit = requested & (slot_of < -1)
        else:
            hit = requested & (slot_of >= 0)
        hit_i = hit.to(tl.int32)
        rest_i = (requested & ~hit).to(tl.int32)
        fresh = tl.where(
            hit,
            tl.cumsum(hit_i, axis=0) - hit_i,
            tl.sum(hit_i, axis=0) + tl.cumsum(rest_i, axis=0) - rest_i,
        )
        rank = tl.where(requested, fresh, -1)
        long = tl.sum(req_i, axis=0) > C
        tl.store(step_rank_ptr + e, tl.where(requested & long, fresh, -1), mask=e_in)
        stored = requested & long
    else:
        rank = tl.load(step_rank_ptr + e, mask=e_in, other=-1)
        stored = (rank >= 0) & e_in
    low = pass_index * C
    selected = requested & (rank >= low) & (rank < low + C)
    # The step's experts this pass protects: the stored order's that these ids request.
    any_stored = tl.sum(stored.to(tl.int32), axis=0) > 0
    # Seeded bug 6: only the pass's own experts are protected, and (5's) the passes follow
    # id order; with the hits first, pass-only protection alone spares the step's experts
    # anyway (tests/test_device_path_model.py shows the two equivalent).
    if MUTANT == 6:  # noqa: SIM108 (a branch on a constexpr)
        in_step = selected
    else:
        in_step = tl.where(any_stored, stored & requested, selected)
    miss = selected & (slot_of < 0)
    miss_i = miss.to(tl.int32)
    miss_rank = tl.cumsum(miss_i, axis=0) - miss_i
    sel_i = selected.to(tl.int32)
    sel_rank = tl.cumsum(sel_i, axis=0) - sel_i
    n_selected = tl.sum(selected.to(tl.int64), axis=0)
    n_miss = tl.sum(miss_i, axis=0)

    # Policy lfu: the selected experts' requests counted, every count halved first when one
    # of them is at the maximum (seeded bug 8: never halved, the counts only saturate).
    if COUNTED:
        count = tl.load(counts_ptr + e, mask=e_in, other=0)
        full = tl.sum((selected & (count >= count_max)).to(tl.int32), axis=0) > 0
        if MUTANT == 8:
            count = tl.minimum(count + selected.to(tl.int32), count_max)
        else:
            count = tl.where(full, count >> 1, count) + selected.to(tl.int32)
        tl.store(counts_ptr + e, count, mask=e_in)

    # 3. Victim order: free slots by number, then residents outside the step, then the step's
    #    other experts, each oldest first (lfu: fewest requests first, then oldest); never a
    #    selected expert's slot. The marks now hold 2 for a selected expert, 1 for another of
    #    the step's, 0 elsewhere.
    tl.debug_barrier()
    tl.store(marks_ptr + e, selected.to(tl.int32) + in_step.to(tl.int32), mask=e_in)
    tl.debug_barrier()
    owners = tl.load(owners_ptr + s, mask=s_in, other=-1)
    free = owners < 0
    owner_mark = tl.load(marks_ptr + owners, mask=s_in & ~free, other=0)
    owner_selected = owner_mark > 1
    tier = tl.where(owner_mark > 0, STEP_TIER, 0).to(tl.int64)
    if COUNTED and MUTANT != 7:  # seeded bug 7: the counts are kept but never read
        owner_count = tl.load(counts_ptr + owners, mask=s_in & ~free, other=0)
        tier += owner_count.to(tl.int64) << COUNT_SHIFT
    stamps = tl.load(stamps_ptr + s, mask=s_in, other=0)
    s64 = s.to(tl.int64)
    if MUTANT == 1:  # seeded bug: any resident's slot may be taken, oldest first
        key = tl.where(free, s64, C + stamps)
    else:
        key = tl.where(free, s64, tl.where(owner_selected, NEVER, C + tier + stamps))
    key = tl.where(s_in, key, NEVER)
    ordered = tl.sort(key * BLOCK_C + s64)
    tl.store(order_ptr + s, (ordered % BLOCK_C).to(tl.int32), mask=s_in)
    tl.debug_barrier()

    # 4. Misses take the first slots of that order; their previous owners are evicted.
    assigned = tl.load(order_ptr + miss_rank, mask=miss, other=0)
    evicted = tl.load(owners_ptr + assigned, mask=miss, other=-1)
    evicts = miss & (evicted >= 0)
    tl.debug_barrier()
    tl.store(resident_ptr + evicted, tl.full([BLOCK_E], -1, tl.int32), mask=evicts)
    tl.debug_barrier()
    tl.store(resident_ptr + e, assigned, mask=miss)
    tl.store(owners_ptr + assigned, e.to(tl.int32), mask=miss)

    # 5. Selected experts become the most recently used, in ascending id order.
    slot_now = tl.where(miss, assigned, slot_of)
    clock = tl.load(clock_ptr)
    if MUTANT == 4:  # seeded bug: hits keep their old stamps
        tl.store(stamps_ptr + slot_now, clock + sel_rank.to(tl.int64), mask=miss)
    else:
        tl.store(stamps_ptr + slot_now, clock + sel_rank.to(tl.int64), mask=selected)
    if MUTANT == 2:  # seeded bug: entries of the previous pass stay in the forward map
        tl.store(forward_ptr + e, slot_now, mask=selected)
    else:
        tl.store(forward_ptr + e, tl.where(selected, slot_now, -1), mask=e_in)
    tl.store(miss_experts_ptr + miss_rank, e.to(tl.int32), mask=miss)
    tl.store(miss_slots_ptr + miss_rank, assigned, mask=miss)
    if MUTANT != 3:  # seeded bug 3 leaves the previous pass's entries past the count
        stale = s_in & (s >= n_miss)
        tl.store(miss_experts_ptr + s, tl.full([BLOCK_C], -1, tl.int32), mask=stale)
        tl.store(miss_slots_ptr + s, tl.full([BLOCK_C], -1, tl.int32), mask=stale)
    tl.store(miss_count_ptr, n_miss)
    tl.store(clock_ptr, clock + n_selected)

    # 6. Counters (storage order of rowcache.device_plan.state.COUNTERS).
    n_evicted = tl.sum(evicts.to(tl.int64), axis=0)
    n_miss64 = n_miss.to(tl.int64)
    tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + n_selected - n_miss64)
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_miss64)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + n_evicted)
    first = (n_selected > 0) | (pass_index == 0)
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + first.to(tl.int64))
    tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + 1)
    if FIRST_PASS:
        bad_before = tl.load(counters_ptr + 5)
        first_id = tl.load(ids_ptr + first_k, mask=first_k < n_ids, other=0).to(tl.int64)
        old_first = tl.load(first_bad_ptr)
        tl.store(first_bad_ptr, tl.where((bad_before == 0) & (n_bad > 0), first_id, old_first))
        tl.store(counters_ptr + 5, bad_before + n_bad)
    if LAST_PASS:
        over = tl.maximum(tl.sum(req_i.to(tl.int64), axis=0) - num_passes * C, 0)
        tl.store(counters_ptr + 6, tl.load(counters_ptr + 6) + over)


@triton.jit
def gather_kernel(
    table_ptr,
    num_chunks,
    miss_experts_ptr,
    miss_slots_ptr,
    miss_count_ptr,
    capacity,
    BLOCK: tl.constexpr,
    MUTANT: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Seeded bug 3 copies every entry of the miss list, not the first count.
    if MUTANT == 3:  # noqa: SIM108 (a branch on a constexpr, resolved at compile time)
        total = capacity * num_chunks
    else:
        total = tl.load(miss_count_ptr) * num_chunks
    for item in range(pid, total, nprog):
        m = item // num_chunks
        j = item % num_chunks
        expert = tl.load(miss_experts_ptr + m).to(tl.int64)
        slot = tl.load(miss_slots_ptr + m).to(tl.int64)
        # Entries are never negative below the count; past it (only mutant 3 reads there) a
        # -1 entry must not turn into an address before the buffers.
        if (expert >= 0) & (slot >= 0):
            row = table_ptr + j * 7
            offset = tl.load(row + 4)
            src = tl.load(row) + expert * tl.load(row + 1) + offset
            dst = tl.load(row + 2) + slot * tl.load(row + 3) + offset
            length = tl.load(row + 5)
            if tl.load(row + 6) != 0:
                src_words = src.to(tl.pointer_type(tl.int64))
                dst_words = dst.to(tl.pointer_type(tl.int64))
                n_words = length // 8
                for w in range(0, n_words, BLOCK):
                    at = w + tl.arange(0, BLOCK)
                    inside = at < n_words
                    tl.store(dst_words + at, tl.load(src_words + at, mask=inside), mask=inside)
            else:
                src_bytes = src.to(tl.pointer_type(tl.uint8))
                dst_bytes = dst.to(tl.pointer_type(tl.uint8))
                for b in range(0, length, BLOCK):
                    at = b + tl.arange(0, BLOCK)
                    inside = at < length
                    tl.store(dst_bytes + at, tl.load(src_bytes + at, mask=inside), mask=inside)


@triton.jit
def invalidate_kernel(resident_ptr, owners_ptr, counters_ptr, expert):
    slot = tl.load(resident_ptr + expert)
    if slot >= 0:
        tl.store(owners_ptr + slot, -1)
        tl.store(resident_ptr + expert, -1)
        tl.store(counters_ptr + 7, tl.load(counters_ptr + 7) + 1)

"""``DevicePlannedProvider``: the cache whose planning and miss copies run on the device.

The host does no bookkeeping and reads no device state on the hot path: ``prepare`` checks
what it can check without reading values (dtype, rank, device, the pass index), hands the
stream over when the caller's stream changed, and enqueues two launches on the current stream:
the planner (``rowcache.device_plan.kernels``) and the gather. The returned
``ExpertWeightResult`` is the same object on every call: the slot buffers and the device
forward map, at fixed addresses, so a forward that uses them can be captured in a CUDA graph
once per batch size and replayed with new ``topk_ids`` written into the captured input.

A step with more distinct experts than slots runs as ``num_passes(topk_ids)`` passes, a number
fixed by the step's shape (``rowcache.device_plan.passes``); ``run_with_expert_cache`` drives
them. Pass ``p`` exposes the requested experts of rank ``[p*C, (p+1)*C)``: the host path's
expert groups, so a pass is the host path's ``prepare`` of one group and the model's reference
decides both.

Ordering (``spec/table.toml``, section ``[device]``: ``device_prepare``, ``handoff``,
``replay``, ``device_invalidate``, ``check_errors``; the handoff of every call is the table's,
through the functions ``python -m model_check.codegen`` generates from it,
``rowcache.schedules._device_generated``, run on ``rowcache.device_plan.streams``):
every pass runs on the stream it is enqueued on, reading and writing the cache state and the
slots there, and the consumer reads the slots on that same stream. When an eager call comes
from another stream than the previous one (the owner), the owner's work is handed over first:
an event recorded on the owner, waited on by the current stream. ``invalidate`` enqueues its
update on the owner stream, behind the last forward's reads. Graph replays are not seen by the
provider: call ``handoff()`` on the replaying stream before every replay (host-only work, and
nothing at all on the owner stream), so that the provider knows the stream the replayed passes
ran on; a later ``invalidate`` or ``check_errors`` then runs behind them. ``invalidate`` and
``check_errors`` with no owner yet make the current stream the owner.

Errors the device meets (ids outside ``[-1, E)``, a step with more distinct experts than its
passes expose) cannot raise there: those ids are ignored and counted, and ``check_errors()``
(which ``stats()`` calls) raises ``DeviceInputError`` once for them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from rowcache.device_plan.kernels import Kernels, kernels_for
from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.state import (
    COUNTERS,
    DeviceCacheState,
    DeviceInputError,
    error_message,
    new_state,
    read_counters,
)
from rowcache.device_plan.streams import CudaStreams, Streams
from rowcache.errors import InvalidInputError
from rowcache.packing import Layout, check_layout
from rowcache.policy import COUNT_MAX, Policy, check_policy
from rowcache.provider_base import Planner, RowCacheWeightProvider
from rowcache.schedules._device_generated import (
    Events,
    Takeover,
    handoff_check_errors,
    handoff_device_invalidate,
    handoff_device_prepare,
    handoff_handoff,
)
from rowcache.surface import check_split
from rowcache.types import ExpertWeightResult, Split, UniqueIds
from rowcache.validation import check_topk_ids

__all__ = ["DevicePlannedProvider", "Handoff"]

Handoff = Callable[[Events[Any], Any, Any], Takeover[Any]]
"""A generated ``handoff_<op>(events, current, owner)``."""


class DevicePlannedProvider(RowCacheWeightProvider, planner="device"):
    """Expert-weight cache planned on the device (see the module docstring); what
    ``RowCacheWeightProvider(..., planner="device")`` builds. A miss evicts the least recently
    used resident, or with ``policy="lfu"`` the one of fewest requests (``rowcache.policy``;
    ``count_max`` the counts' saturation, 1 to 15), as the host planner does.

    ``kernels``: ``"triton"`` (the fused launches; the default on CUDA) or ``"torch"`` (torch
    operations; the default on the CPU). ``compress=True`` holds bf16 ``w13`` and ``w2`` as
    lossless bf16 planes in host memory (``rowcache.compress``: about three quarters of the
    bytes) and decodes each miss into its slots after the gather, by the same miss list. The
    split is always by expert groups (``"expert"``):
    passes over all rows, summed in fp32 when there is more than one. A sibling of the host
    planner's ``rowcache.row_provider.HostPlannedProvider`` (the same policy and inspection
    surface, ``rowcache.provider_base``): it has no copy backend (its copies are the gather
    launch) and no ``step_groups`` (it orders a step's passes on the device).
    """

    def __init__(
        self,
        w13: Tensor,
        w2: Tensor,
        w13_scale: Tensor | None = None,
        w2_scale: Tensor | None = None,
        *,
        capacity: int,
        device: torch.device | str,
        w13_scale_2: Tensor | None = None,
        w2_scale_2: Tensor | None = None,
        w13_bias: Tensor | None = None,
        w2_bias: Tensor | None = None,
        layout: Layout = "separate",
        kernels: str | None = None,
        share_sources: bool = False,
        split: Split = "expert",
        compress: bool = False,
        planner: Planner = "device",
        policy: Policy = "lru",
        count_max: int = COUNT_MAX,
    ) -> None:
        target = torch.device(device)
        check_layout(layout)
        self._policy, count_max = check_policy(policy, count_max)
        if planner != "device":
            raise InvalidInputError(f"{type(self).__name__} plans on the device, got {planner!r}")
        if check_split(split) != "expert":
            raise InvalidInputError(
                f"the device planner splits a step by passes over expert groups: split must "
                f"be 'expert', got {split!r}"
            )
        if target.type not in ("cpu", "cuda"):
            raise InvalidInputError(f"no device planner for device {target} (supported: cpu, cuda)")
        self._set_up_slots(
            w13,
            w2,
            w13_scale,
            w2_scale,
            w13_scale_2,
            w2_scale_2,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            capacity=capacity,
            split="expert",
            device=target,
            layout=layout,
            share_sources=share_sources,
            compress=compress,
        )
        self._kernels: Kernels = kernels_for(self._sources, self._slots, self._num_experts, kernels)
        self._state: DeviceCacheState = new_state(
            self._num_experts, capacity, target, count_max if self._policy == "lfu" else 0
        )
        self._expert_bytes = self._sources.expert_bytes  # what a miss writes into its slots
        self._cuda = target.type == "cuda"
        # The streams the handoff runs on (none on the CPU: no handoff, no owner).
        self._streams: Streams[Any] | None = CudaStreams(target) if self._cuda else None
        # The generated handoff of each provider operation of the table, as attributes
        # (``_handoff_<op>``) so that a test can substitute a mutant's.
        self._handoff_device_prepare: Handoff = handoff_device_prepare
        self._handoff_handoff: Handoff = handoff_handoff
        self._handoff_device_invalidate: Handoff = handoff_device_invalidate
        self._handoff_check_errors: Handoff = handoff_check_errors
        # The owner (the stream of the last eager call or handoff), the guard and the result.
        self._set_up_calls(self._state.forward)

    # -- surface -----------------------------------------------------------------------

    @property
    def kernels(self) -> str:
        return self._kernels.name

    @property
    def state(self) -> DeviceCacheState:
        """The device tensors (tests and debugging; reading them waits for the device)."""
        return self._state

    def num_passes(self, topk_ids: Tensor) -> int:
        """Passes a step of this shape runs (fixed by the shape, so one capture holds)."""
        return num_passes(topk_ids.numel(), self._num_experts, self._capacity)

    def prepare(
        self,
        topk_ids: Tensor,
        unique_ids: UniqueIds | None = None,
        *,
        pass_index: int = 0,
        passes: int | None = None,
    ) -> ExpertWeightResult:
        """Enqueue pass ``pass_index`` of ``passes`` for ``topk_ids`` on the current stream and
        return the live slot buffers and forward map.

        ``passes`` defaults to 1: a step served by one pass, whose requested experts beyond
        ``capacity`` count as overflow (``run_with_expert_cache`` runs ``num_passes(topk_ids)``
        passes, which never overflow).

        Nothing is read from the device: ids are range-checked there (see the class
        docstring). Reads of the returned buffers must be enqueued on the current stream
        before the next ``prepare``.
        """
        with self._guard("prepare"):
            ids = check_topk_ids(topk_ids, "prepare", self._device)
            if unique_ids is not None:
                raise InvalidInputError(
                    "prepare: the device planner takes no unique_ids (pass pass_index to "
                    "select a group of the routed experts)"
                )
            total = 1 if passes is None else passes
            if isinstance(total, bool) or not isinstance(total, int) or total < 1:
                raise InvalidInputError(f"prepare: passes must be an int >= 1, got {total!r}")
            if isinstance(pass_index, bool) or not isinstance(pass_index, int):
                raise InvalidInputError(f"prepare: pass_index must be an int, got {pass_index!r}")
            if not 0 <= pass_index < total:
                raise InvalidInputError(
                    f"prepare: pass_index {pass_index} outside [0, {total}) for this step"
                )
            if self._cuda and ids.is_cpu:
                raise InvalidInputError(
                    "prepare: the device planner reads topk_ids on the device; got a CPU "
                    f"tensor for a cache on {self._device}"
                )
            with self._run_on(self._take_over(self._handoff_device_prepare)):
                self._kernels.plan(self._state, ids, pass_index, total)
                self._kernels.gather(self._state)
            return self._result

    def handoff(self) -> None:
        """Make the current stream the owner, ordered after the owner's work: call before
        replaying a captured forward on another stream than the last eager call's."""
        with self._guard("handoff"):
            self._take_over(self._handoff_handoff)  # no work of its own (table: handoff)

    def invalidate(self, expert_id: int) -> None:
        """Free ``expert_id``'s slot (a no-op when it is not resident), on the owner stream."""
        with self._guard("invalidate"):
            self._check_expert_id(expert_id)
            if self._streams is not None and self._streams.capturing():
                raise InvalidInputError(
                    f"invalidate({expert_id}) during a CUDA graph capture would be captured and "
                    "run again at every replay; call it outside the capture"
                )
            with self._run_on(self._hand_over(self._handoff_device_invalidate)):
                self._kernels.invalidate(self._state, expert_id)

    def check_errors(self) -> None:
        """Raise ``DeviceInputError`` for errors the device counted since the last report
        (waits for the owner stream; never call it on the hot path). The read and the reset
        run on the owner stream, behind its pending passes (table: ``check_errors``)."""
        with self._guard("check_errors"), self._errors_handoff():
            self._check_errors_on_owner()

    def _check_errors_on_owner(self) -> None:
        counters, first_bad = read_counters(self._state)
        message = error_message(counters, first_bad, self._num_experts)
        if message is not None:
            self._state.counters[COUNTERS.index("bad_ids")] = 0
            self._state.counters[COUNTERS.index("overflow")] = 0
            raise DeviceInputError(message)

    def stats(self) -> dict[str, int]:
        """Counters read back from the device (waits for it); raises ``DeviceInputError``
        first when the device counted errors."""
        # Not guarded, as the host providers' stats(): it may be called while another thread
        # is inside a call (it then reads whatever the device has done so far).
        with self._errors_handoff():
            self._check_errors_on_owner()
            counters, _ = read_counters(self._state)
            resident = int((self._state.resident >= 0).sum().item())
            # What the last pass copied (0 before the first, as on the host path).
            last_copies = int(self._state.miss_count.item())
        return {
            "hits": counters["hits"],
            "misses": counters["misses"],
            "evictions": counters["evictions"],
            "resident": resident,
            "capacity": self._capacity,
            "prepare_calls": counters["prepare_calls"],
            "passes": counters["passes"],
            "owner_changes": self._owner_changes,
            "invalidations": counters["invalidations"],
            "last_copies": last_copies,
            "last_copy_bytes": last_copies * self._expert_bytes,
            "slot_bytes": self._slots.slot_bytes,
            "host_bytes": self._sources.host_bytes,
        }

    # -- inspection (tests, debugging; each waits for the device) ----------------------

    def resident_experts(self) -> dict[int, int]:
        """Resident expert id -> slot."""
        return {e: s for e, s in enumerate(self._state.resident.tolist()) if s >= 0}

    def lru_order(self) -> tuple[int, ...]:
        """Resident experts, least recently used first."""
        owners = self._state.owners.tolist()
        stamps = self._state.stamps.tolist()
        held = sorted((stamps[s], e) for s, e in enumerate(owners) if e >= 0)
        return tuple(e for _, e in held)

    def slot_of(self) -> tuple[int, ...]:
        """The resident map: the slot of every expert, -1 when not resident."""
        return tuple(self._state.resident.tolist())

    @property
    def policy(self) -> Policy:
        """The victim policy (``rowcache.policy``)."""
        return self._policy

    def request_counts(self) -> tuple[int, ...]:
        """Every expert's request count under policy ``lfu``; () under ``lru``."""
        return tuple(self._state.counts.tolist()) if self._state.count_max else ()

    @property
    def forward_pairs(self) -> tuple[tuple[int, int], ...] | None:
        """(expert, slot) exposed by the last pass, ascending (None before the first)."""
        if int(self._state.counters[COUNTERS.index("passes")].item()) == 0:
            return None
        return tuple((e, s) for e, s in enumerate(self._state.forward.tolist()) if s >= 0)

    def forward_map(self) -> tuple[int, ...]:
        return tuple(self._state.forward.tolist())

    # -- streams ------------------------------------------------------------------------

    def _errors_handoff(self) -> AbstractContextManager[None]:
        """``check_errors``'s handoff, then its stream (table: on the owner stream, behind its
        pending passes; with no owner yet the current stream becomes the owner, so that a later
        call from another stream hands over from it)."""
        return self._run_on(self._hand_over(self._handoff_check_errors))

    def _take_over(self, handoff: Handoff) -> Any:
        """``_hand_over`` of an eager call: a call during a CUDA graph capture (which runs
        after the device drained: ``torch.cuda.graph`` synchronizes first) hands nothing over
        and changes no owner; its work runs on the capturing stream."""
        if self._streams is None or self._streams.capturing():
            return None
        return self._hand_over(handoff)

    def _hand_over(self, handoff: Handoff) -> Any:
        """Run the generated ``handoff`` of a call on the current stream and the owner: the
        records and waits of the table, then the owner it leaves. Returns the stream the call's
        other work runs on, None for the current stream (or no work, or no streams)."""
        streams = self._streams
        if streams is None:
            return None
        current = streams.current_stream()
        took = handoff(streams, current, self._owner)
        if took.handed_over:
            self._owner_changes += 1
        self._owner = took.owner
        return None if took.work is None or took.work == current else took.work

    def _run_on(self, stream: Any) -> AbstractContextManager[None]:
        """Make ``stream`` current for the block (None: leave the current stream)."""
        if stream is None or self._streams is None:
            return nullcontext()
        return self._streams.on(stream)

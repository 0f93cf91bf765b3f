"""The two implementations of a pass's device work behind one interface.

``TorchKernels`` runs the planner as torch operations (``torch_planner``) and copies misses
with tensor indexing: it serves CPU caches and is the reference the fused kernels are tested
against. ``TritonKernels`` launches the fused planner and the gather (``triton_kernels``): one
launch each per pass, fixed shapes, no host synchronization, capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from rowcache.compress import decode_experts
from rowcache.device_plan.regions import CHUNK_BYTES, chunk_table, copy_regions
from rowcache.device_plan.state import DeviceCacheState
from rowcache.device_plan.torch_planner import invalidate_expert, plan_pass
from rowcache.sources import ExpertSources, SlotBuffers, planes_and_slots

__all__ = ["Kernels", "TorchKernels", "TritonKernels", "kernels_for", "launch_plan"]


class Kernels(Protocol):
    name: str

    def plan(
        self, state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int
    ) -> None: ...

    def gather(self, state: DeviceCacheState) -> None: ...

    def invalidate(self, state: DeviceCacheState, expert_id: int) -> None: ...


class TorchKernels:
    """Torch operations; the miss copies read the miss count back, so this serves the CPU
    (where nothing is asynchronous) and tests, not a captured graph. Sources held as bf16
    planes are decoded by the reference decode (``rowcache.compress.decode_experts``)."""

    name = "torch"

    def __init__(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        self._pairs = [
            (src, dst)
            for src, dst in zip(sources.copied(), slots.tensors(), strict=True)
            if src is not None and dst is not None
        ]
        self._decoded = planes_and_slots(sources, slots)

    def plan(
        self, state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int
    ) -> None:
        plan_pass(state, topk_ids, pass_index, num_passes)

    def gather(self, state: DeviceCacheState) -> None:
        count = int(state.miss_count.item())
        if count == 0:
            return
        # Row by row: copy_ takes every dtype (index_copy_ has no fp8 on the CPU), and there
        # are at most C misses.
        pairs = zip(
            state.miss_experts[:count].tolist(), state.miss_slots[:count].tolist(), strict=True
        )
        for expert, slot in pairs:
            for src, dst in self._pairs:
                dst[slot].copy_(src[expert])
            for planes, buffer in self._decoded:
                buffer[slot].copy_(decode_experts(planes, [expert])[0])

    def invalidate(self, state: DeviceCacheState, expert_id: int) -> None:
        invalidate_expert(state, expert_id)


def _block(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


SMALL_STEP_ENTRIES = 64
"""Routing entries up to which the planner reads a step in one block of this width (small
decode steps, which the graph captures of small batches build); a larger step loops over
blocks of ``LARGE_BLOCK`` (which the profile run's step builds)."""
LARGE_BLOCK = 1024


def _entries_block(n: int) -> int:
    """The planner's block over a step's routing entries: one width for small steps, one for
    every larger step, so that prompts of any length use the kernels the profile run built
    (its step is the largest) instead of building one per power of two on first use."""
    return SMALL_STEP_ENTRIES if n <= SMALL_STEP_ENTRIES else LARGE_BLOCK


def launch_plan(
    state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int, mutant: int = 0
) -> None:
    """One launch of the fused planner (``triton_kernels.plan_kernel``) for a pass: what
    ``TritonKernels.plan`` runs, and what the CPU tests run under Triton's interpreter.
    ``mutant`` (tests only) selects a seeded bug of the kernel."""
    from rowcache.device_plan.triton_kernels import plan_kernel

    ids = topk_ids.reshape(-1)
    plan_kernel[(1,)](
        ids,
        ids.numel(),
        state.resident,
        state.owners,
        state.stamps,
        state.clock,
        state.forward,
        state.miss_experts,
        state.miss_slots,
        state.miss_count,
        state.counters,
        state.first_bad,
        state.marks,
        state.order,
        state.step_rank,
        state.counts,
        state.count_max,
        pass_index,
        num_passes,
        state.num_experts,
        state.capacity,
        BLOCK_E=_block(state.num_experts),
        BLOCK_C=_block(state.capacity),
        BLOCK_N=_entries_block(ids.numel()),
        FIRST_PASS=pass_index == 0,
        LAST_PASS=pass_index == num_passes - 1,
        COUNTED=state.count_max > 0,
        MUTANT=mutant,
        num_warps=4,
    )


MAX_LANES = 4096
"""Largest E or C the one-program planner takes (its vectors live in registers)."""

GATHER_PROGRAMS_PER_SM = 8
"""Gather programs per SM: enough loads in flight over PCIe to cover its latency at one miss."""


class TritonKernels:
    """The fused Triton planner and gather (CUDA)."""

    name = "triton"

    def __init__(
        self,
        sources: ExpertSources,
        slots: SlotBuffers,
        num_experts: int,
        mutant: int = 0,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        programs_per_sm: int = GATHER_PROGRAMS_PER_SM,
        gather_warps: int = 4,
    ) -> None:
        from rowcache.errors import InvalidInputError

        self._mutant = mutant  # seeded bugs of the GPU conformance tests; 0 in production
        try:
            import triton  # noqa: F401  (the kernels import it at their first launch)
        except ImportError as error:
            raise InvalidInputError(
                "the device planner on CUDA launches Triton kernels, and triton is not "
                "importable here (pip install triton; PyTorch's CUDA wheels bring it)"
            ) from error
        if num_experts > MAX_LANES:
            raise InvalidInputError(
                f"the fused device planner takes at most {MAX_LANES} experts, got {num_experts}"
            )
        device = slots.w13.device
        self._table = chunk_table(copy_regions(sources, slots), device, chunk_bytes)
        # One load per work item: a piece is chunk_bytes, loaded in words (or bytes).
        if chunk_bytes < 64 or chunk_bytes & (chunk_bytes - 1):
            raise InvalidInputError(f"chunk_bytes must be a power of two >= 64, got {chunk_bytes}")
        self._gather_block = chunk_bytes // 8
        self._gather_warps = gather_warps
        self._num_chunks = int(self._table.shape[0])
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._gather_grid = (sms * programs_per_sm,)
        # Sources held as bf16 planes: decoded into their slots after the copies, by the same
        # miss list; the 16-byte codebook read on the device, the planes through unified
        # addressing like every other source.
        from rowcache.compress.triton_decode import SlotDecoder

        self._decoders = [
            SlotDecoder(
                planes, buffer, grid=self._gather_grid[0], codebook=planes.codebook.to(device)
            )
            for planes, buffer in planes_and_slots(sources, slots)
        ]

    def plan(
        self, state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int
    ) -> None:
        launch_plan(state, topk_ids, pass_index, num_passes, self._mutant)

    def gather(self, state: DeviceCacheState) -> None:
        from rowcache.device_plan.triton_kernels import gather_kernel

        gather_kernel[self._gather_grid](
            self._table,
            self._num_chunks,
            state.miss_experts,
            state.miss_slots,
            state.miss_count,
            state.capacity,
            BLOCK=self._gather_block,
            MUTANT=self._mutant,
            num_warps=self._gather_warps,
        )
        for decode in self._decoders:
            decode(state.miss_experts, state.miss_slots, state.miss_count)

    def invalidate(self, state: DeviceCacheState, expert_id: int) -> None:
        from rowcache.device_plan.triton_kernels import invalidate_kernel

        invalidate_kernel[(1,)](state.resident, state.owners, state.counters, expert_id)


def kernels_for(
    sources: ExpertSources, slots: SlotBuffers, num_experts: int, kind: str | None, mutant: int = 0
) -> Kernels:
    """``kind`` ``"torch"`` or ``"triton"``; None picks Triton on CUDA, torch elsewhere.
    ``mutant`` (tests only) selects a seeded bug of the Triton kernels."""
    from rowcache.errors import InvalidInputError

    device = slots.w13.device
    chosen = kind if kind is not None else ("triton" if device.type == "cuda" else "torch")
    if chosen == "torch":
        return TorchKernels(sources, slots)
    if chosen == "triton":
        if device.type != "cuda":
            raise InvalidInputError(f"kernels='triton' needs a CUDA device, got {device}")
        return TritonKernels(sources, slots, num_experts, mutant)
    raise InvalidInputError(f"kernels must be 'torch' or 'triton', got {kind!r}")

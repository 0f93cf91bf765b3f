"""GPU conformance of the device-planned path: the fused Triton planner and gather against the
torch planner on the CPU (itself checked step by step against the host path and the model's
reference by ``tests/test_device_planner.py``), inside CUDA graphs.

Every step of the hypothesis machine is a forward of a random batch size. Forwards of a
captured size are replays: the graph of every size is captured once (all its passes, and after
each pass a snapshot of the forward map and of every slot buffer, which is the consumer's read),
and each replay writes new ``topk_ids`` into the captured input. Replays run on the capture's
replay stream or on another one (``handoff()`` first), eager forwards of other sizes come
between them, and so do invalidations. After every step: each pass's forward map equals the
reference's, every slot it maps holds exactly its expert's bytes in every tensor, and the
device state (resident map, slot owners, stamps, counters) equals the reference's.

The race fixture replays a graph that overwrites slots while a reader of them on another stream
is still pending. The GPU mutants are seeded bugs of the fused kernels and of the handoff; each
must be detected.

``ROWCACHE_CUDA_EXAMPLES`` sets the number of examples (default 200).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from cuda_support import cycles_for_ms, gpu_sleep
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from torch import Tensor

from rowcache.device_plan.kernels import TritonKernels
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.packing import Layout

pytestmark = pytest.mark.cuda

E, C, K = 8, 3, 2
SIZES = (1, 2, 3)  # captured batch sizes; eager forwards use 1 to 5 rows
EXAMPLES = int(os.environ.get("ROWCACHE_CUDA_EXAMPLES", "200"))
GEOMETRIES = ("bf16", "bf16_scaled", "nvfp4")


def sources(geometry: str, seed: int = 0) -> dict[str, Tensor]:
    """Random per-expert tensors with distinct bytes per expert: bf16 (two tensors), bf16 with
    block scales (four) or NVFP4-like (six: packed fp4 weights and fp8 scales as bytes, fp32
    global scales, whose 4-byte rows take the gather's byte path)."""
    gen = torch.Generator().manual_seed(seed)

    def raw(*shape: int) -> Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    if geometry == "bf16":
        return {
            "w13": torch.randn(E, 64, 32, generator=gen).to(torch.bfloat16),
            "w2": torch.randn(E, 32, 32, generator=gen).to(torch.bfloat16),
        }
    if geometry == "bf16_scaled":
        return {
            "w13": torch.randn(E, 64, 32, generator=gen).to(torch.bfloat16),
            "w2": torch.randn(E, 32, 32, generator=gen).to(torch.bfloat16),
            "w13_scale": torch.rand(E, 4, 2, generator=gen),
            "w2_scale": torch.rand(E, 2, 2, generator=gen),
        }
    return {
        "w13": raw(E, 64, 16),
        "w2": raw(E, 32, 32),
        "w13_scale": raw(E, 64, 2),
        "w2_scale": raw(E, 32, 4),
        "w13_scale_2": torch.rand(E, generator=gen),
        "w2_scale_2": torch.rand(E, generator=gen),
    }


def provider(
    tensors: dict[str, Tensor], device: str, layout: Layout, mutant: int = 0
) -> DevicePlannedProvider:
    p = DevicePlannedProvider(
        **{k: v.pin_memory() if device == "cuda" else v for k, v in tensors.items()},
        capacity=C,
        device=device,
        layout=layout,
        kernels="triton" if device == "cuda" else "torch",
    )
    if mutant:
        p._kernels = TritonKernels(p._sources, p._slots, E, mutant=mutant)
    return p


def slot_buffers(p: DevicePlannedProvider) -> list[Tensor]:
    return [t for t in p._slots.tensors() if t is not None]


def host_rows(p: DevicePlannedProvider) -> list[Tensor]:
    return [t for t in p._sources.tensors() if t is not None]


def as_bytes(t: Tensor) -> Tensor:
    """The bytes of every row (works for strided packed views too)."""
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return fresh.reshape(-1).view(torch.uint8)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    ids: Tensor
    passes: int
    maps: list[Tensor]
    slots: list[list[Tensor]]
    staged: Tensor


@dataclass
class Harness:
    """The GPU provider, the CPU reference and the captured graphs of one example."""

    geometry: str
    layout: Layout
    mutant: int = 0
    skip_handoff: bool = False
    gpu: DevicePlannedProvider = field(init=False)
    ref: DevicePlannedProvider = field(init=False)
    graphs: dict[int, Captured] = field(default_factory=dict)
    streams: list[torch.cuda.Stream] = field(default_factory=list)

    def __post_init__(self) -> None:
        tensors = sources(self.geometry)
        self.gpu = provider(tensors, "cuda", self.layout, self.mutant)
        self.ref = provider(tensors, "cpu", self.layout)
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self._warm(tensors)

    def _warm(self, tensors: dict[str, Tensor]) -> None:
        """Compile every kernel specialization the captures use, on a throwaway cache (a
        compilation cannot happen inside a capture)."""
        scratch = provider(tensors, "cuda", self.layout, self.mutant)
        for rows in (*SIZES, 4, 5):
            ids = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
            total = scratch.num_passes(ids)
            for index in range(total):
                scratch.prepare(ids, pass_index=index, passes=total)
        torch.cuda.synchronize()

    def _capture(self, rows: int) -> Captured:
        ids = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
        total = self.gpu.num_passes(ids)
        maps = [torch.empty(E, dtype=torch.int32, device="cuda") for _ in range(total)]
        snaps = [[torch.empty_like(t) for t in slot_buffers(self.gpu)] for _ in range(total)]
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: freeing an earlier example's pinned buffers
        # queries their events, which a capture forbids (torch.cuda.graph collects before it
        # begins, not during).
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph):
                for index in range(total):
                    result = self.gpu.prepare(ids, pass_index=index, passes=total)
                    maps[index].copy_(result.expert_map)
                    for snap, buf in zip(snaps[index], slot_buffers(self.gpu), strict=True):
                        snap.copy_(buf)
        finally:
            gc.enable()
        staged = torch.zeros(rows, K, dtype=torch.int32, pin_memory=True)
        return Captured(graph, ids, total, maps, snaps, staged)

    def forward(
        self,
        rows: list[list[int]],
        stream: int,
        replay: bool,
        before_sync: Callable[[torch.cuda.Event], str | None] | None = None,
        event: torch.cuda.Event | None = None,
    ) -> list[str]:
        """One step, checked against the reference. ``before_sync(event)``, when given, runs
        right after the step is issued, before the device is synchronized; its message (if
        any) is returned first."""
        size = len(rows)
        early: list[str] = []
        host_ids = torch.tensor(rows, dtype=torch.int32)
        problems: list[str] = []
        with torch.cuda.stream(self.streams[stream]):
            if replay:
                captured = self.graphs.get(size)
                if captured is None:
                    torch.cuda.synchronize()
                    captured = self.graphs[size] = self._capture(size)
                # Through a pinned buffer allocated at capture time, asynchronously: a copy
                # from pageable memory or a new pinned allocation can wait for other streams'
                # work, which would hide a missing handoff.
                captured.staged.copy_(host_ids)
                captured.ids.copy_(captured.staged, non_blocking=True)
                if not self.skip_handoff:
                    self.gpu.handoff()
                captured.graph.replay()
                maps, snaps, total = captured.maps, captured.slots, captured.passes
            else:
                ids = host_ids.cuda()
                total = self.gpu.num_passes(ids)
                maps, snaps = [], []
                for index in range(total):
                    result = self.gpu.prepare(ids, pass_index=index, passes=total)
                    maps.append(result.expert_map.clone())
                    snaps.append([t.clone() for t in slot_buffers(self.gpu)])
        if before_sync is not None and event is not None:
            message = before_sync(event)
            if message is not None:
                early.append(message)
        torch.cuda.synchronize()
        for index in range(total):
            expected = self.ref.prepare(host_ids, pass_index=index, passes=total).expert_map
            got = maps[index].cpu()
            if not torch.equal(got, expected):
                problems.append(f"pass {index}: forward map {got.tolist()} != {expected.tolist()}")
                continue
            for expert, slot in enumerate(got.tolist()):
                if slot < 0:
                    continue
                for snap, src in zip(snaps[index], host_rows(self.gpu), strict=True):
                    if not torch.equal(
                        as_bytes(snap[slot : slot + 1].cpu()), as_bytes(src[expert : expert + 1])
                    ):
                        problems.append(f"pass {index}: slot {slot} does not hold expert {expert}")
        return early + problems + self.state_mismatches()

    def invalidate(self, expert: int) -> list[str]:
        self.gpu.invalidate(expert)
        self.ref.invalidate(expert)
        torch.cuda.synchronize()
        return self.state_mismatches()

    def state_mismatches(self) -> list[str]:
        out = []
        for name in ("resident", "owners", "counters", "clock"):
            got = getattr(self.gpu.state, name).cpu()
            want = getattr(self.ref.state, name)
            if not torch.equal(got, want):
                out.append(f"{name}: {got.tolist()} != {want.tolist()}")
        if self.gpu.lru_order() != self.ref.lru_order():
            out.append(f"LRU order {self.gpu.lru_order()} != {self.ref.lru_order()}")
        return out


ROWS = st.lists(
    st.lists(st.integers(min_value=-1, max_value=E - 1), min_size=K, max_size=K),
    min_size=1,
    max_size=5,
)


def machine(geometry: str, layout: Layout, mutant: int, skip_handoff: bool) -> type:
    class DevicePlannerMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.h = Harness(geometry, layout, mutant, skip_handoff)

        @rule(rows=ROWS, stream=st.integers(0, 1))
        def replay(self, rows: list[list[int]], stream: int) -> None:
            rows = rows[: max(SIZES)]
            problems = self.h.forward(rows, stream, replay=True)
            assert not problems, problems

        @rule(rows=ROWS, stream=st.integers(0, 1))
        def eager(self, rows: list[list[int]], stream: int) -> None:
            problems = self.h.forward(rows, stream, replay=False)
            assert not problems, problems

        @rule(expert=st.integers(0, E - 1))
        def invalidate(self, expert: int) -> None:
            problems = self.h.invalidate(expert)
            assert not problems, problems

    return DevicePlannerMachine


def run_machine(geometry: str, layout: Layout, examples: int, mutant: int = 0) -> None:
    run_state_machine_as_test(
        machine(geometry, layout, mutant, skip_handoff=False),
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            # A mutant only has to be found; shrinking GPU runs would cost minutes.
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            if mutant
            else [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )


@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_device_planner_in_lockstep_inside_graphs(geometry: str, layout: Layout) -> None:
    # 200 examples in all by default, spread over the six geometry x layout cells.
    run_machine(
        geometry, layout, max(1, EXAMPLES // 3) if geometry == "nvfp4" else max(1, EXAMPLES // 6)
    )


def _kernel_copy(dst: Tensor, src: Tensor) -> None:
    """``dst[:] = src`` by an elementwise kernel over the bits (a device-to-device memcpy issued
    between two streams' commands may serialize them, which would hide a race)."""
    torch.bitwise_or(src.view(torch.int16), 0, out=dst.view(torch.int16))


def _still_pending(event: torch.cuda.Event) -> str | None:
    """None while ``event`` has not completed; otherwise why the fixture proves nothing."""
    if event.query():
        return "inconclusive: the spinning work had finished before the call under test"
    return None


def _race(skip_handoff: bool) -> tuple[list[str], list[str]]:
    """A reader on stream 0 is still pending (it spins first) when a replay on stream 1
    overwrites every slot it reads; with the handoff the replay waits for it.

    Returns (violations, inconclusive). The graph is captured and replayed once before, in
    lockstep with the reference: a graph's first launch uploads it, which can wait for the
    device."""
    h = Harness("bf16", "separate", skip_handoff=skip_handoff)
    warm = h.forward([[6, 7], [7, 6]], stream=1, replay=True)
    first = [[0, 1], [2, 0]]
    warm += h.forward(first, stream=0, replay=False)  # stream 0 becomes the owner
    assert warm == [], warm
    # Read before the reader is enqueued: a read-back on the default stream would wait for it.
    expected = {e: s for e, s in enumerate(h.gpu.forward_map()) if s >= 0}
    sleep = cycles_for_ms(20.0)
    # Allocated before the spin: an allocation between two commands of different streams
    # serializes them.
    seen = [torch.empty_like(t) for t in slot_buffers(h.gpu)]
    read_done = torch.cuda.Event()
    torch.cuda.synchronize()
    reader = h.streams[0]
    with torch.cuda.stream(reader):
        gpu_sleep(sleep)
        for snap, buf in zip(seen, slot_buffers(h.gpu), strict=True):
            _kernel_copy(snap, buf)
        read_done.record(reader)
    problems = h.forward(
        [[3, 4], [5, 3]], stream=1, replay=True, before_sync=_still_pending, event=read_done
    )
    inconclusive = [p for p in problems if p.startswith("inconclusive")]
    problems = [p for p in problems if not p.startswith("inconclusive")]
    src = host_rows(h.gpu)
    for expert, slot in expected.items():
        for snap, rows in zip(seen, src, strict=True):
            if not torch.equal(
                as_bytes(snap[slot : slot + 1].cpu()), as_bytes(rows[expert : expert + 1])
            ):
                problems.append(f"pending reader saw slot {slot} overwritten (expert {expert})")
    return problems, inconclusive


def test_replay_waits_for_a_pending_reader_on_another_stream() -> None:
    assert _race(skip_handoff=False) == ([], [])


def _invalidate_during_replay(on_current_stream: bool) -> tuple[list[str], list[str]]:
    """A replay is still pending on the owner stream (behind a spin) when the host invalidates
    one of the experts that replay makes resident: the invalidation must land after it, so the
    expert ends up not resident, as in the reference (replay, then invalidate). Returns
    (violations, inconclusive); the graph is replayed once before (see ``_race``)."""
    h = Harness("bf16", "separate")
    assert h.forward([[0, 1]], stream=0, replay=True) == []  # stream 0 becomes the owner
    assert h.forward([[4, 1]], stream=0, replay=False) == []
    captured = h.graphs[1]
    owner = h.streams[0]
    sleep = cycles_for_ms(20.0)
    captured.staged.copy_(torch.tensor([[2, 3]], dtype=torch.int32))  # before the spin
    replay_done = torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(owner):
        gpu_sleep(sleep)
        captured.ids.copy_(captured.staged, non_blocking=True)
        h.gpu.handoff()  # the table's replay: handoff, then the graph (a no-op on the owner)
        captured.graph.replay()
        replay_done.record(owner)
    with torch.cuda.stream(h.streams[1]):
        if on_current_stream:  # the seeded bug: enqueued on the calling stream
            h.gpu._kernels.invalidate(h.gpu.state, 2)
        else:
            h.gpu.invalidate(2)
    pending = _still_pending(replay_done)
    torch.cuda.synchronize()
    h.ref.prepare(torch.tensor([[2, 3]]))
    h.ref.invalidate(2)
    return h.state_mismatches(), [] if pending is None else [pending]


def test_invalidate_lands_after_a_pending_replay() -> None:
    assert _invalidate_during_replay(on_current_stream=False) == ([], [])


MUTANTS = {
    "victim_taken_from_selected": 1,
    "forward_entry_left_from_previous_pass": 2,
    "gather_past_miss_count": 3,
    "hits_keep_old_stamps": 4,
}


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_device_mutant_is_detected(name: str) -> None:
    with pytest.raises(AssertionError):
        run_machine("nvfp4", "separate", 50, mutant=MUTANTS[name])


@pytest.mark.gpu_mutant
def test_device_mutant_invalidate_on_the_calling_stream_is_detected() -> None:
    problems, inconclusive = _invalidate_during_replay(on_current_stream=True)
    assert inconclusive == [] and problems != []


@pytest.mark.gpu_mutant
def test_device_mutant_replay_without_handoff_is_detected() -> None:
    problems, inconclusive = _race(skip_handoff=True)
    assert inconclusive == [] and problems != []

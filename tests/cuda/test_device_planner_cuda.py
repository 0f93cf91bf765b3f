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

The two race fixtures hold the racing work behind a kernel spinning on a flag in pinned host
memory (``flag_spin``) and release it only after the call under test has returned and the host
has polled whether the call's racing work ran meanwhile: a replay that would overwrite slots
while a reader of them on another stream is still pending; an invalidate made while a replay on
the owner stream is still pending. Each run gives a verdict (``tests/race_verdict.py``: pass,
fail or inconclusive, with the table of what each observation means for the correct provider
and for a mutant); inconclusive runs are retried, at most three times. The GPU mutants are
seeded bugs of the fused kernels, and mutants of the table's handoff (a replay without it,
invalidate on the calling stream) that the provider runs through the code generated from the
mutated table (``tests/device_handoff_mutants.py``); each must be detected. The device's error
counts (bad ids once per step, overflow once per step, the first bad id named) are checked on
the fused planner, eagerly and replayed from graphs (``tests/test_device_errors.py``).

``ROWCACHE_CUDA_EXAMPLES`` sets the number of examples (default 200), shared out over the
lockstep's cells unless ``ROWCACHE_LOCKSTEP_EXAMPLES`` gives each cell its own;
``ROWCACHE_RACE_RUNS`` the number of runs of every race test (default 5: each must decide as
required every time).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import test_device_errors as errors
import torch
from cuda_support import sanitizer_enabled
from device_handoff_mutants import install_mutant
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from race_verdict import Observation, Outcome, Role, log_outcomes, settle
from torch import Tensor

from rowcache.compress import decode
from rowcache.device_plan.kernels import TritonKernels
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.device_plan.state import COUNTERS
from rowcache.packing import Layout
from rowcache.sources import SOURCE_NAMES

pytestmark = pytest.mark.cuda

E, C, K = 8, 3, 2
SIZES = (1, 2, 3)  # captured batch sizes; eager forwards use 1 to 5 rows
EXAMPLES = int(os.environ.get("ROWCACHE_CUDA_EXAMPLES", "200"))
# Examples in every lockstep cell; unset or empty: the cell's share of EXAMPLES.
PER_CELL = int(os.environ.get("ROWCACHE_LOCKSTEP_EXAMPLES") or 0)
GEOMETRIES = ("bf16", "bf16_scaled", "nvfp4", "fp8_block", "mxfp4", "compressed")
# The compressed geometry holds its sources as bf16 planes, which take the separate layout only.
CELLS = [
    (g, lay)
    for g in GEOMETRIES
    for lay in ("separate", "packed")
    if (g, lay) != ("compressed", "packed")
]
RACE_RUNS = [f"run{n}" for n in range(1, int(os.environ.get("ROWCACHE_RACE_RUNS", "5")) + 1)]


@contextmanager
def no_collection() -> Iterator[None]:
    """Cyclic garbage collection held off while a capture or a race fixture runs: collecting
    an earlier example's pinned buffers frees them, which queries their events, and a capture
    forbids that (it invalidated a capture once). Nothing is collected before: a full
    collection per capture is what torch's own ``torch.cuda.graph`` stopped doing by default
    (``torch.compiler.config.force_cudagraph_gc``) because of its cost with many captures in a
    row, and an example here captures one graph per step size it meets."""
    was_enabled = gc.isenabled()  # nested uses leave it held off until the outermost ends
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def sources(geometry: str, seed: int = 0) -> dict[str, Tensor]:
    """Random per-expert tensors with distinct bytes per expert: bf16 (two tensors), bf16 with
    block scales (four), NVFP4-like (six: packed fp4 weights and fp8 scales as bytes, fp32
    global scales, whose 4-byte rows take the gather's byte path) or vLLM's block-scaled FP8
    (four: float8_e4m3fn w13 [E, 2I, H] and w2 [E, H, I] as random bytes, float32 128 x 128
    block scales [E, 2, 3] and [E, 3, 1] for H=384, I=128; the 12-byte w2 scale rows take the
    byte path in the separate layout) or gpt-oss's MXFP4 (six: packed uint8 values [E, 2I, H/2]
    and [E, H, I/2], uint8 e8m0 scales [E, 2I, H/32] and [E, H, I/32], float32 biases [E, 2I]
    and [E, H], for H=64, I=32, all as random bytes) or bf16 held compressed (two: bf16 over
    many binades, every special class among them, so that the decode escapes in every block)."""
    gen = torch.Generator().manual_seed(seed)

    def raw(*shape: int) -> Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    if geometry == "compressed":
        scale = torch.exp2(torch.randint(-24, 8, (E, 64 * 32), generator=gen).float())
        w13 = (torch.randn(E, 64 * 32, generator=gen) * scale).to(torch.bfloat16)
        specials = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81]
        bits = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in specials])
        w13.view(torch.int16)[:, : len(specials)] = bits.to(torch.int16)
        return {
            "w13": w13.reshape(E, 64, 32),
            "w2": (torch.randn(E, 32, 32, generator=gen) * 0.02).to(torch.bfloat16),
        }
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
    if geometry == "fp8_block":
        return {
            "w13": raw(E, 256, 384).view(torch.float8_e4m3fn),
            "w2": raw(E, 384, 128).view(torch.float8_e4m3fn),
            "w13_scale": raw(E, 2, 3 * 4).view(torch.float32),
            "w2_scale": raw(E, 3, 1 * 4).view(torch.float32),
        }
    if geometry == "mxfp4":
        return {
            "w13": raw(E, 64, 32),
            "w2": raw(E, 64, 16),
            "w13_scale": raw(E, 64, 2),
            "w2_scale": raw(E, 64, 1),
            "w13_bias": raw(E, 64 * 4).view(torch.float32),
            "w2_bias": raw(E, 64 * 4).view(torch.float32),
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
    tensors: dict[str, Tensor], device: str, layout: Layout, mutant: int = 0, compress: bool = False
) -> DevicePlannedProvider:
    p = DevicePlannedProvider(
        **{k: v.pin_memory() if device == "cuda" else v for k, v in tensors.items()},
        capacity=C,
        device=device,
        layout=layout,
        kernels="triton" if device == "cuda" else "torch",
        compress=compress,
    )
    if mutant:
        p._kernels = TritonKernels(p._sources, p._slots, E, mutant=mutant)
    return p


def slot_buffers(p: DevicePlannedProvider) -> list[Tensor]:
    return [t for t in p._slots.tensors() if t is not None]


def host_rows(p: DevicePlannedProvider) -> list[Tensor]:
    """Every present source as the slots must hold it (a compressed one decoded on the host)."""
    planes = p._sources.planes
    return [
        decode(planes[name]) if name in planes else t
        for name, t in zip(SOURCE_NAMES, p._sources.tensors(), strict=True)
        if t is not None
    ]


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
class Issued:
    """A step enqueued on the GPU: each pass's forward map and slot snapshot, to be checked."""

    rows: list[list[int]]
    total: int
    maps: list[Tensor]
    snaps: list[list[Tensor]]


@dataclass
class Harness:
    """The GPU provider, the CPU reference and the captured graphs of one example."""

    geometry: str
    layout: Layout
    mutant: int = 0
    handoff_mutant: str | None = None  # the provider runs the handoff of this mutant's table
    compress: bool = field(init=False)
    gpu: DevicePlannedProvider = field(init=False)
    ref: DevicePlannedProvider = field(init=False)
    graphs: dict[int, Captured] = field(default_factory=dict)
    streams: list[torch.cuda.Stream] = field(default_factory=list)

    def __post_init__(self) -> None:
        tensors = sources(self.geometry)
        self.compress = self.geometry == "compressed"
        self.gpu = provider(tensors, "cuda", self.layout, self.mutant, self.compress)
        if self.handoff_mutant is not None:
            install_mutant(self.gpu, self.handoff_mutant)
        self.ref = provider(tensors, "cpu", self.layout, compress=self.compress)
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self._warm(tensors)

    def _warm(self, tensors: dict[str, Tensor]) -> None:
        """Compile every kernel specialization the captures use, on a throwaway cache (a
        compilation cannot happen inside a capture)."""
        scratch = provider(tensors, "cuda", self.layout, self.mutant, self.compress)
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
        with no_collection(), torch.cuda.graph(graph):
            for index in range(total):
                result = self.gpu.prepare(ids, pass_index=index, passes=total)
                maps[index].copy_(result.expert_map)
                for snap, buf in zip(snaps[index], slot_buffers(self.gpu), strict=True):
                    snap.copy_(buf)
        staged = torch.zeros(rows, K, dtype=torch.int32, pin_memory=True)
        return Captured(graph, ids, total, maps, snaps, staged)

    def forward(self, rows: list[list[int]], stream: int, replay: bool) -> list[str]:
        """One step, checked against the reference."""
        issued = self.issue(rows, stream, replay)
        torch.cuda.synchronize()
        reads, maps = self.check(issued)
        return maps + reads + self.state_mismatches()

    def issue(self, rows: list[list[int]], stream: int, replay: bool) -> Issued:
        """Enqueue one step on ``streams[stream]`` (a replay of the graph of its size, captured
        first when there is none, or eager passes); nothing is read back."""
        size = len(rows)
        host_ids = torch.tensor(rows, dtype=torch.int32)
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
                self.gpu.handoff()
                captured.graph.replay()
                return Issued(rows, captured.passes, captured.maps, captured.slots)
            ids = host_ids.cuda()
            total = self.gpu.num_passes(ids)
            maps, snaps = [], []
            for index in range(total):
                result = self.gpu.prepare(ids, pass_index=index, passes=total)
                maps.append(result.expert_map.clone())
                snaps.append([t.clone() for t in slot_buffers(self.gpu)])
            return Issued(rows, total, maps, snaps)

    def check(self, issued: Issued) -> tuple[list[str], list[str]]:
        """Once the device is idle: the reference runs the same step; returns (wrong reads:
        a slot a pass maps that does not hold its expert's bytes, forward maps that differ)."""
        host_ids = torch.tensor(issued.rows, dtype=torch.int32)
        reads: list[str] = []
        maps: list[str] = []
        for index in range(issued.total):
            expected = self.ref.prepare(host_ids, pass_index=index, passes=issued.total).expert_map
            got = issued.maps[index].cpu()
            if not torch.equal(got, expected):
                maps.append(f"pass {index}: forward map {got.tolist()} != {expected.tolist()}")
                continue
            for expert, slot in enumerate(got.tolist()):
                if slot < 0:
                    continue
                for snap, src in zip(issued.snaps[index], host_rows(self.gpu), strict=True):
                    if not torch.equal(
                        as_bytes(snap[slot : slot + 1].cpu()), as_bytes(src[expert : expert + 1])
                    ):
                        reads.append(f"pass {index}: slot {slot} does not hold expert {expert}")
        return reads, maps

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


def machine(geometry: str, layout: Layout, mutant: int) -> type:
    class DevicePlannerMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.h = Harness(geometry, layout, mutant)

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
        machine(geometry, layout, mutant),
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


@pytest.mark.parametrize(("geometry", "layout"), CELLS)
def test_device_planner_in_lockstep_inside_graphs(geometry: str, layout: Layout) -> None:
    # PER_CELL each, else EXAMPLES x 5/3 in all (NVFP4, six tensors, a third of them per layout,
    # the four others a sixth), over the ten geometry x layout cells.
    share = max(1, EXAMPLES // 3) if geometry == "nvfp4" else max(1, EXAMPLES // 6)
    run_machine(geometry, layout, PER_CELL or share)


def _kernel_copy(dst: Tensor, src: Tensor) -> None:
    """``dst[:] = src`` by an elementwise kernel over the bits (a device-to-device memcpy issued
    between two streams' commands may serialize them, which would hide a race)."""
    torch.bitwise_or(src.view(torch.int16), 0, out=dst.view(torch.int16))


# ---------------------------------------------------------------- race fixtures
#
# Both fixtures hold the racing work with ``flag_spin.FlagHold`` (imported inside them: Triton
# is there on the GPU machine only) and return an ``Observation`` for ``race_verdict``. What
# must hold for a run to mean anything, kept from the sleep-based versions:
# * every graph is captured and replayed once before the race (a graph's first launch uploads
#   it, which can wait for the device);
# * the reader copies by a kernel, not a memcpy (``_kernel_copy``);
# * every buffer (pinned staging included) and event is allocated before the hold, and nothing
#   is allocated between the two streams' commands (an allocation can serialize them);
# * every kernel that runs while held has been launched once before (CUDA's lazy loading may
#   load a kernel's module at its first launch, which can wait for the spin).


class Canary:
    """Control work for a race: a small kernel enqueued on the racing stream before the call
    under test, which nothing orders behind the hold; its event completing while held shows
    that the device ran that stream meanwhile (``Observation.control``). Launched once when
    built (see above)."""

    def __init__(self) -> None:
        self.src = torch.arange(64, dtype=torch.int16, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        _kernel_copy(self.dst, self.src)

    def launch(self) -> None:
        """On the current stream."""
        _kernel_copy(self.dst, self.src)
        self.done.record()

    def ran(self) -> bool:
        return bool(self.done.query())


RACE_ROWS = [[3, 4], [5, 3]]  # every slot the reader reads is overwritten (C = 3 new experts)
REPLAY_ROWS = [[5, 2]]  # 5 is resident (a hit), 2 a miss
INVALIDATED = 5


def _race(handoff_mutant: str | None) -> Observation:
    """A reader on stream 0 (the owner) is held behind the spin when a replay on stream 1
    overwrites every slot it reads; with the handoff the replay waits for it. The racing work
    is the replay: it has raced when it completed while the reader was held. With
    ``handoff_mutant`` the provider runs the handoff generated from that mutant's table
    (``tests/device_handoff_mutants.py``)."""
    from flag_spin import FlagHold

    h = Harness("bf16", "separate", handoff_mutant=handoff_mutant)
    warm = h.forward([[6, 7], [7, 6]], stream=1, replay=True)  # captures size 2, replays once
    warm += h.forward([[0, 1], [2, 0]], stream=0, replay=False)  # stream 0 becomes the owner
    assert warm == [], warm
    assert len(RACE_ROWS) in h.graphs, "the race replays a graph captured before the hold"
    # Read before the reader is enqueued: a read-back on the default stream would wait for it.
    # The reader copies every slot, so every resident expert's slot must keep its bytes (the
    # last pass's forward map may be empty: the step's second pass exposes nothing).
    expected = h.gpu.resident_experts()
    assert len(expected) == C, expected
    seen = [torch.empty_like(t) for t in slot_buffers(h.gpu)]
    for snap, buf in zip(seen, slot_buffers(h.gpu), strict=True):
        _kernel_copy(snap, buf)  # the reader's kernel, launched once before the hold
    hold = FlagHold()
    canary = Canary()
    replay_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    with no_collection():  # no finalizer runs between the two streams' commands
        with torch.cuda.stream(h.streams[0]):
            hold.launch()
            for snap, buf in zip(seen, slot_buffers(h.gpu), strict=True):
                _kernel_copy(snap, buf)
        with torch.cuda.stream(h.streams[1]):
            canary.launch()
        issued = h.issue(RACE_ROWS, stream=1, replay=True)  # the call under test
        replay_done.record(h.streams[1])
        raced, control = hold.hold_then_release(replay_done.query, canary.ran)
    torch.cuda.synchronize()
    spin = hold.result()
    reads, maps = h.check(issued)
    src = host_rows(h.gpu)
    for expert, slot in expected.items():
        for snap, rows in zip(seen, src, strict=True):
            if not torch.equal(
                as_bytes(snap[slot : slot + 1].cpu()), as_bytes(rows[expert : expert + 1])
            ):
                reads.append(f"pending reader saw slot {slot} overwritten (expert {expert})")
    return Observation(
        released=spin.released,
        raced=raced,
        control=control,
        wrong_reads=tuple(reads),
        state_mismatches=tuple(maps + h.state_mismatches()),
        spins=spin.spins,
        polled_ms=hold.polled_ms,
    )


def _invalidate_during_replay(handoff_mutant: str | None) -> Observation:
    """A replay is held behind the spin on the owner stream (stream 0) when the host, on
    stream 1, invalidates an expert that replay hits: the invalidation must land after it, so
    the expert ends up not resident, as in the reference (replay, then invalidate). Landing
    first, it frees the slot and the replay loads the expert again. The racing work is the
    invalidation: it has raced when the device's invalidation count moved while the replay was
    held (read by ``Peek`` on a stream of its own). With ``handoff_mutant`` the provider runs
    the handoff generated from that mutant's table for the call under test."""
    from flag_spin import FlagHold, Peek

    h = Harness("bf16", "separate")
    # Captures size 1 and replays it once; stream 0 becomes the owner.
    assert h.forward([[0, INVALIDATED]], stream=0, replay=True) == []
    # The invalidate kernel, launched once with the very argument of the race (Triton
    # specializes integer arguments).
    assert h.invalidate(INVALIDATED) == []
    assert h.forward([[4, INVALIDATED]], stream=0, replay=False) == []
    captured = h.graphs[len(REPLAY_ROWS)]
    owner = h.streams[0]
    counter = COUNTERS.index("invalidations")
    hold = FlagHold()
    canary = Canary()
    peek = Peek(h.gpu.state.counters)
    assert peek.stream.cuda_stream not in {s.cuda_stream for s in h.streams}
    before = peek.read(wait_ms=1000.0)
    assert before is not None
    captured.staged.copy_(torch.tensor(REPLAY_ROWS, dtype=torch.int32))  # before the hold
    if handoff_mutant is not None:
        install_mutant(h.gpu, handoff_mutant)  # compiled here, before the hold

    def invalidated() -> bool:
        now = peek.read()
        return now is not None and now[counter] != before[counter]

    torch.cuda.synchronize()
    with no_collection():
        with torch.cuda.stream(owner):
            hold.launch()
            captured.ids.copy_(captured.staged, non_blocking=True)
            h.gpu.handoff()  # the table's replay: handoff, then the graph (a no-op on the owner)
            captured.graph.replay()
        with torch.cuda.stream(h.streams[1]):  # the call under test
            canary.launch()
            h.gpu.invalidate(INVALIDATED)
        raced, control = hold.hold_then_release(invalidated, canary.ran)
    torch.cuda.synchronize()
    spin = hold.result()
    reads, maps = h.check(Issued(REPLAY_ROWS, captured.passes, captured.maps, captured.slots))
    h.ref.invalidate(INVALIDATED)
    return Observation(
        released=spin.released,
        raced=raced,
        control=control,
        wrong_reads=tuple(reads),
        state_mismatches=tuple(maps + h.state_mismatches()),
        spins=spin.spins,
        polled_ms=hold.polled_ms,
    )


def _settle(fixture: str, provider: str, observe: Callable[[], Observation], role: Role) -> None:
    """Run a race fixture until it decides (``race_verdict.settle``), logging every run."""
    label = f"device: {provider}" + (" (sanitizer pass)" if sanitizer_enabled() else "")

    def record(outcome: Outcome, attempt: int) -> None:
        o = outcome.observation
        print(
            f"{fixture} [{provider}] run {attempt}: {outcome.verdict.value}: {outcome.reason} "
            f"(released {o.released}, raced {o.raced}, control {o.control}, {o.spins} spins, "
            f"{o.polled_ms:.1f} ms polled)"
        )
        log_outcomes(label, fixture, outcome, attempt)

    settle(f"{fixture} ({provider})", observe, role, record=record)


def test_flag_hold_holds_until_released_and_ends_at_its_limit() -> None:
    """The spin holds work queued behind it until the host writes the flag, a peek on another
    stream meanwhile reads the held stream's target as it was, and without a release the spin
    ends at its iteration limit."""
    from flag_spin import FlagHold, Peek

    value = torch.arange(4, dtype=torch.int64, device="cuda")
    value.add_(0)  # the kernel held below, launched once before
    peek = Peek(value)
    hold = FlagHold()
    behind = torch.cuda.Event()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    hold.launch()
    value.add_(10)
    behind.record()
    during = peek.read(wait_ms=1000.0)
    raced, control = hold.hold_then_release(behind.query, lambda: during is not None, 100.0)
    torch.cuda.synchronize()
    spin = hold.result()
    assert spin.released and spin.spins > 0, spin
    assert not raced and control and hold.polled_ms >= 100.0
    assert during == [0, 1, 2, 3]
    assert peek.read(wait_ms=1000.0) == [10, 11, 12, 13]

    short = FlagHold(limit_ms=20.0)
    short.launch()
    torch.cuda.synchronize()  # never released: the limit ends it
    ended = short.result()
    assert not ended.released and ended.spins == short.limit, (ended, short.limit)


@pytest.mark.parametrize("run", RACE_RUNS)
def test_replay_waits_for_a_pending_reader_on_another_stream(run: str) -> None:
    _settle("device_replay_after_pending_reader", "real", lambda: _race(None), "correct")


@pytest.mark.parametrize("run", RACE_RUNS)
def test_invalidate_lands_after_a_pending_replay(run: str) -> None:
    _settle(
        "device_invalidate_during_replay",
        "real",
        lambda: _invalidate_during_replay(None),
        "correct",
    )


MUTANTS = {
    "victim_taken_from_selected": 1,
    "forward_entry_left_from_previous_pass": 2,
    "gather_past_miss_count": 3,
    "hits_keep_old_stamps": 4,
    "step_exposed_in_id_order": 5,
    "protection_limited_to_the_pass": 6,
}


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_device_mutant_is_detected(name: str) -> None:
    # Mutant 3's stale copies race the step's own copies into the same slot inside one gather,
    # so whether a stale write lands last is the device's scheduling: a run can miss it, and a
    # failure hypothesis found may not repeat when it replays it (``Flaky``). A failure seen in
    # any of three runs, each larger, is a detection; three runs without one fail the test.
    sizes = (50, 100, 200)
    for examples in sizes:
        try:
            run_machine("nvfp4", "separate", examples, mutant=MUTANTS[name])
        except (AssertionError, Flaky) as found:
            print(f"mutant {name} detected at {examples} examples: {type(found).__name__}")
            return
    pytest.fail(f"device mutant {name} went undetected in runs of {sizes} examples")


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("run", RACE_RUNS)
def test_device_mutant_invalidate_on_the_calling_stream_is_detected(run: str) -> None:
    _settle(
        "device_invalidate_during_replay",
        "invalidate_on_the_calling_stream",
        lambda: _invalidate_during_replay("dp_invalidate_on_current"),
        "mutant",
    )


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("run", RACE_RUNS)
def test_device_mutant_replay_without_handoff_is_detected(run: str) -> None:
    _settle(
        "device_replay_after_pending_reader",
        "replay_without_handoff",
        lambda: _race("replay_without_handoff"),
        "mutant",
    )


# ---------------------------------------------------------------- device error counts


def _error_provider(seeded: str | None) -> DevicePlannedProvider:
    w = errors.weights()
    p = DevicePlannedProvider(
        **{k: v.pin_memory() for k, v in w.items()},  # type: ignore[arg-type]
        capacity=errors.C,
        device="cuda",
        kernels="triton",
    )
    if seeded is not None:
        p._kernels = errors.EveryPassCounts(p._kernels, **errors.SEEDED[seeded])
    return p


def _error_step(p: DevicePlannedProvider, mode: str, seeded: str | None) -> errors.Step:
    """Eager passes, or the replay of a graph captured per step shape (``errors.SHAPES``)."""
    if mode == "eager":
        return errors.eager_step(p, "cuda")
    # Compile every kernel specialization the captures use on a throwaway cache first.
    scratch = _error_provider(seeded)
    warm = errors.eager_step(scratch, "cuda")
    for (rows, k), passes in errors.SHAPES.items():
        warm([[0] * k for _ in range(rows)], passes)
    torch.cuda.synchronize()
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, int]] = {}
    for shape, passes in errors.SHAPES.items():
        ids = torch.zeros(shape, dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph):
            for index in range(passes):
                p.prepare(ids, pass_index=index, passes=passes)
        graphs[shape] = (graph, ids, passes)

    def step(rows: list[list[int]], passes: int) -> None:
        graph, ids, captured = graphs[(len(rows), len(rows[0]))]
        assert passes == captured, f"the graph of this shape runs {captured} passes"
        ids.copy_(torch.tensor(rows, dtype=torch.int32))
        p.handoff()
        graph.replay()

    return step


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_device_errors_counted_once_per_step(mode: str) -> None:
    """Bad ids of a 4-pass step counted once, overflow once per step, the first bad id named:
    the fused planner, eagerly and replayed from graphs."""
    p = _error_provider(None)
    assert p.kernels == "triton"
    assert errors.error_count_problems(p, _error_step(p, mode, None)) == []


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("seeded", sorted(errors.SEEDED))
def test_device_mutant_errors_counted_on_every_pass_is_detected(seeded: str, mode: str) -> None:
    p = _error_provider(seeded)
    assert errors.error_count_problems(p, _error_step(p, mode, seeded)) != []

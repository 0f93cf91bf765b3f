"""The device planner (torch implementation, on the CPU) in lockstep with the host planner and
the model's reference, step by step.

A hypothesis machine drives three things with the same forwards and invalidations: a
``DevicePlannedProvider`` (every pass planned and copied by ``rowcache.device_plan``), a
``RowCacheWeightProvider`` (the host planner, one ``prepare`` per expert group) and the model's
reference effects (``model_check.table.reference.plan_prepare`` / ``plan_invalidate``), under
either victim policy (``lru``, or ``lfu`` with counts that saturate within a run). Routings
hold ``-1`` padding. After every pass: the forward maps of all three are equal, every slot the
map names holds exactly its expert's rows, and the LRU order, the request counts, the resident
map and the counters agree; so the victim choice of every step is the reference's.

Then the device's error path: ids outside ``[-1, E)`` are ignored (nothing written for them,
the maps keep their size), counted, and raised once by ``stats()`` as ``DeviceInputError``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import Tensor

from model_check.table.reference import (
    NO_SLOT,
    Bounds,
    Counters,
    initial_host,
    plan_invalidate,
    plan_step_pass,
    step_order,
)
from rowcache import RowCacheWeightProvider
from rowcache.device_plan.forward import run_passes
from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.device_plan.state import DeviceInputError
from rowcache.policy import Policy
from rowcache.vllm import expert_cache_counter_problems

E, C, K = 6, 3, 2
H, INTER = 4, 3

SETTINGS = settings(
    max_examples=int(os.environ.get("ROWCACHE_DEVICE_EXAMPLES", "500")),
    stateful_step_count=30,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)

ROWS = st.lists(st.lists(st.integers(-1, E - 1), min_size=K, max_size=K), min_size=0, max_size=4)


def weights(seed: int = 0, geometry: str = "f32") -> dict[str, Tensor]:
    """``f32``: six float32 tensors; ``fp8_block``: vLLM's block-scaled FP8 experts
    (float8_e4m3fn weights as random bytes, float32 block scales ``[E, 2, 3]`` and ``[E, 3, 1]``,
    whose 12-byte rows the gather copies in bytes); ``mxfp4``: gpt-oss's experts (packed uint8
    values, uint8 e8m0 scales, float32 biases; ``test_mxfp4_slots``); ``compressed``: bf16
    weights over many binades with every special class among them (the device provider holds
    them compressed, ``compress=True``, and its slots must still hold every bit)."""
    gen = torch.Generator().manual_seed(seed)
    if geometry == "compressed":
        scale = torch.exp2(torch.randint(-24, 8, (E, 2 * INTER * H), generator=gen).float())
        w13 = (torch.randn(E, 2 * INTER * H, generator=gen) * scale).to(torch.bfloat16)
        specials = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81]
        bits = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in specials])
        w13.view(torch.int16)[:, : len(specials)] = bits.to(torch.int16)
        w2 = (torch.randn(E, H, INTER, generator=gen) * 0.02).to(torch.bfloat16)
        return {"w13": w13.reshape(E, 2 * INTER, H), "w2": w2}
    if geometry == "mxfp4":
        from test_mxfp4_slots import mxfp4_sources

        return mxfp4_sources(hidden=64, inter=32, experts=E)
    if geometry == "fp8_block":

        def raw(*shape: int) -> Tensor:
            return torch.randint(0, 256, (E, *shape), generator=gen, dtype=torch.uint8)

        return {
            "w13": raw(2 * INTER, 384).view(torch.float8_e4m3fn),
            "w2": raw(384, INTER).view(torch.float8_e4m3fn),
            "w13_scale": raw(2, 3 * 4).view(torch.float32),
            "w2_scale": raw(3, 1 * 4).view(torch.float32),
        }
    return {
        "w13": torch.randn(E, 2 * INTER, H, generator=gen),
        "w2": torch.randn(E, H, INTER, generator=gen),
        "w13_scale": torch.rand(E, 2, generator=gen),
        "w2_scale": torch.rand(E, 1, generator=gen),
        "w13_scale_2": torch.rand(E, generator=gen),
        "w2_scale_2": torch.rand(E, generator=gen),
    }


def as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def groups_of(rows: list[list[int]], slot_of: tuple[int, ...]) -> list[list[int]]:
    """The reference's groups of a step: its order (hits first) cut into groups of C."""
    order = step_order(slot_of, [e for row in rows for e in row if e >= 0])
    return [sorted(order[i : i + C]) for i in range(0, len(order), C)]


class Lockstep(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(["separate", "packed"]),
        geometry=st.sampled_from(["f32", "fp8_block", "mxfp4", "compressed"]),
        policy=st.sampled_from(["lru", "lfu"]),
        count_max=st.integers(1, 3),
    )
    def start(self, layout: str, geometry: str, policy: Policy, count_max: int) -> None:
        self.w = weights(geometry=geometry)
        compress = geometry == "compressed"
        self.device = DevicePlannedProvider(
            **self.w,
            capacity=C,
            device="cpu",
            layout="separate" if compress else layout,  # type: ignore[arg-type]
            compress=compress,
            policy=policy,
            count_max=count_max,
        )
        assert bool(self.device._sources.planes) == compress
        self.host = RowCacheWeightProvider(
            **self.w,
            capacity=C,
            device="cpu",
            split="expert",
            policy=policy,
            count_max=count_max,
        )
        self.bounds = Bounds(E, C, policy=policy, count_max=count_max)
        self.model = initial_host(self.bounds)
        self.counters = Counters()

    @rule(rows=ROWS)
    def forward(self, rows: list[list[int]]) -> None:
        ids = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), K)
        total = self.device.num_passes(ids)
        assert total == num_passes(len(rows) * K, E, C)
        groups = groups_of(rows, self.model.slot_of)
        assert self.host.step_groups(ids) == groups
        step = [e for group in groups for e in group]
        assert len(groups) <= total
        for index in range(total):
            result = self.device.prepare(ids, pass_index=index, passes=total)
            got = result.expert_map.tolist()
            if index >= max(1, len(groups)):
                assert got == [-1] * E, f"an empty pass exposes {got}"
                continue
            # A step of padding only is one host prepare that requests nothing.
            group = groups[index] if groups else []
            if group:
                host_map = self.host.prepare(ids, unique_ids=group).expert_map.tolist()
            else:
                host_map = self.host.prepare(torch.tensor([[-1]])).expert_map.tolist()
            effect = plan_step_pass(self.model, self.counters, self.bounds, group, step, 0)
            self.model, self.counters = effect.host, effect.counters
            model_map = [-1] * E
            for expert, slot in effect.host.forward or ():
                model_map[expert] = slot
            assert got == host_map == model_map, (got, host_map, model_map)
            for expert, slot in enumerate(got):
                if slot >= 0:
                    self._check_slot(expert, slot)

    @rule(expert=st.integers(0, E - 1))
    def invalidate(self, expert: int) -> None:
        self.device.invalidate(expert)
        self.host.invalidate(expert)
        effect = plan_invalidate(self.model, self.counters, self.bounds, (expert,), 0)
        self.model, self.counters = effect.host, effect.counters

    def _check_slot(self, expert: int, slot: int) -> None:
        for name, src in self.w.items():
            buf = getattr(self.device, f"buf_{name}")
            # Bytes: fp8 has no equality on the CPU, and random bytes may be NaN.
            same = torch.equal(as_bytes(buf[slot]), as_bytes(src[expert]))
            assert same, f"slot {slot} {name} != expert {expert}"

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "device"):
            return
        model_slots = tuple(-1 if s == NO_SLOT else s for s in self.model.slot_of)
        assert self.device.slot_of() == self.host.slot_of() == model_slots
        assert self.device.lru_order() == self.host.lru_order() == self.model.lru
        counts = self.device.request_counts()
        assert counts == self.host.request_counts() == self.model.counts, counts
        stats = self.device.stats()
        for name in ("hits", "misses", "evictions", "prepare_calls", "invalidations"):
            assert stats[name] == getattr(self.counters, name) == self.host.stats()[name], name
        assert expert_cache_counter_problems([stats, self.host.stats()]) == []


TestLockstep = Lockstep.TestCase
TestLockstep.settings = SETTINGS


def test_planner_never_takes_a_selected_experts_slot() -> None:
    """A pass over experts that all fit: the hits stay where they are, the misses take the
    free slots and then the oldest unselected ones."""
    w = weights()
    p = DevicePlannedProvider(**w, capacity=C, device="cpu")  # type: ignore[arg-type]
    p.prepare(torch.tensor([[0, 1], [2, -1]]))
    assert p.resident_experts() == {0: 0, 1: 1, 2: 2}
    p.prepare(torch.tensor([[3, 1]]))  # 0 is the oldest unselected (stamps 0 < 2)
    assert p.resident_experts() == {1: 1, 2: 2, 3: 0}
    assert p.lru_order() == (2, 1, 3)


def test_bad_ids_are_ignored_counted_and_raised_once() -> None:
    w = weights()
    p = DevicePlannedProvider(**w, capacity=C, device="cpu")  # type: ignore[arg-type]
    result = p.prepare(torch.tensor([[E + 7, 1], [-3, 2]]))
    assert result.expert_map.shape == (E,)
    assert result.expert_map.tolist() == [-1, 0, 1, -1, -1, -1]
    assert p.state.resident.shape == (E,) and p.state.owners.shape == (C,)
    with pytest.raises(
        DeviceInputError, match=rf"2 topk_ids entries outside \[-1, {E}\).*first was {E + 7}"
    ):
        p.stats()
    assert p.stats()["misses"] == 2  # reported once, then the counters read clean


def test_overflow_is_counted_when_a_step_runs_too_few_passes() -> None:
    w = weights()
    p = DevicePlannedProvider(**w, capacity=C, device="cpu")  # type: ignore[arg-type]
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    p.prepare(ids, pass_index=0, passes=1)
    with pytest.raises(DeviceInputError, match="3 requested experts were not exposed"):
        p.check_errors()
    p.check_errors()  # reported once


def test_passes_sum_in_float32_and_one_pass_is_the_kernel_output() -> None:
    w = weights()
    p = DevicePlannedProvider(**w, capacity=C, device="cpu")  # type: ignore[arg-type]
    calls: list[tuple[list[int], bool]] = []

    def run(weights_: object, rows: slice, shared: bool) -> Tensor:
        emap = p.state.forward.tolist()
        calls.append(([e for e, s in enumerate(emap) if s >= 0], shared))
        return torch.full((rows.stop - rows.start, 2), float(len(calls)), dtype=torch.bfloat16)

    one = run_passes(p, torch.tensor([[0, 1]]), run)
    assert one.dtype == torch.bfloat16 and one.tolist() == [[1.0, 1.0]]
    calls.clear()
    many = run_passes(p, torch.tensor([[0, 1], [2, 3], [4, -1]]), run)
    assert [c[0] for c in calls] == [[0, 1, 2], [3, 4]]
    assert [c[1] for c in calls] == [True, False]
    assert many.dtype == torch.bfloat16 and many[0].tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pass_index": 2, "passes": 2}, r"pass_index 2 outside \[0, 2\)"),
        ({"passes": 0}, "passes must be an int >= 1"),
        ({"unique_ids": [0]}, "takes no unique_ids"),
    ],
)
def test_bad_pass_arguments_are_rejected_before_any_change(
    kwargs: dict[str, object], message: str
) -> None:
    w = weights()
    p = DevicePlannedProvider(**w, capacity=C, device="cpu")  # type: ignore[arg-type]
    before = [t.clone() for t in (p.state.resident, p.state.owners, p.state.counters)]
    with pytest.raises(ValueError, match=message):
        p.prepare(torch.tensor([[0, 1]]), **kwargs)  # type: ignore[arg-type]
    after = (p.state.resident, p.state.owners, p.state.counters)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

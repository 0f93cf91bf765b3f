"""The device's error counts, on the CPU (torch planner): an id outside ``[-1, E)`` is counted
once per step however many passes the step runs (on its first pass), a requested expert that
no pass exposes once per step (on its last pass), and ``check_errors()`` raises one
``DeviceInputError`` naming those counts and the first offending id, then reads clean.

``error_count_problems`` is the check, shared with the GPU suite
(``tests/cuda/test_device_planner_cuda.py`` runs it on the fused Triton planner, eagerly and
replayed from CUDA graphs). It looks at counts and the first bad id only, never at which
experts a pass exposes. ``EveryPassCounts`` seeds the bug it must catch: a planner that counts
bad ids or overflow on every pass of a step.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from rowcache import RowCacheWeightProvider, run_with_expert_cache
from rowcache.device_plan.kernels import Kernels
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.device_plan.state import COUNTERS, DeviceCacheState, DeviceInputError

E, C, K = 8, 2, 2

Rows = list[list[int]]

BAD = [[0, 9], [1, -5], [2, 3], [12, 4]]
"""8 entries, so 4 passes of 2 (every valid expert exposed); bad ids 9, -5 and 12, the first
not in the first entry."""
BAD_2 = [[-7, 5], [6, 20], [-1, -1], [7, 5]]
"""The same shape: bad ids -7 and 20 (-1 is padding, never counted)."""
OVER = [[0, 1], [2, 3], [4, 5]]
"""Six distinct experts: run as 2 passes of 2, two are never exposed."""
BOTH = [[0, 1], [2, 3], [4, 8]]
"""The same shape: one bad id (8, just past the last expert) and, run as 2 passes, one
expert never exposed."""
SHAPES = {(4, K): 4, (3, K): 2}
"""Passes each step shape runs here (the GPU suite captures one graph per shape)."""

Step = Callable[[Rows, int], None]
"""``step(rows, passes)``: run passes ``0 .. passes-1`` of one step of ``rows``."""


def bad_part(count: int, first: int) -> str:
    return f"{count} topk_ids entries outside [-1, {E}) were ignored (the first was {first})"


def overflow_part(count: int) -> str:
    return f"{count} requested experts were not exposed by any pass"


def expect_errors(
    label: str, p: DevicePlannedProvider, bad: tuple[int, int] | None, overflow: int
) -> list[str]:
    """``check_errors()`` raises once, naming ``bad`` (count, first id) and ``overflow``
    (count), and nothing else; then it reads clean."""
    try:
        p.check_errors()
    except DeviceInputError as error:
        message = str(error)
    else:
        message = ""
    problems = []
    wanted = ([bad_part(*bad)] if bad else []) + ([overflow_part(overflow)] if overflow else [])
    for part in wanted:
        if part not in message:
            problems.append(f"{label}: check_errors() said {message!r}, not {part!r}")
    counted = [int(n) for n in re.findall(r"(?:^|; )(\d+) ", message)]
    if len(counted) != len(wanted):
        problems.append(f"{label}: check_errors() said {message!r}, expected {wanted}")
    try:
        p.check_errors()
    except DeviceInputError as error:
        problems.append(f"{label}: reported a second time: {error}")
    return problems


def error_count_problems(p: DevicePlannedProvider, step: Step) -> list[str]:
    """Run the error steps through ``step`` on a fresh provider (``E`` experts, capacity
    ``C``) and return every miscount (an empty list when all are right)."""
    out: list[str] = []
    step(BAD, 4)
    out += expect_errors("bad ids of one 4-pass step", p, (3, 9), 0)
    step(OVER, 2)
    out += expect_errors("overflow of one 2-pass step", p, None, 2)
    step(OVER, 2)
    step(OVER, 2)
    out += expect_errors("overflow of two 2-pass steps", p, None, 4)
    step(BAD, 4)
    step(BAD_2, 4)
    out += expect_errors("bad ids of two 4-pass steps (the first step's first id)", p, (5, 9), 0)
    step(BAD_2, 4)
    out += expect_errors("bad ids after a report (the new step's first id)", p, (2, -7), 0)
    step(BOTH, 2)
    out += expect_errors("bad ids and overflow in one 2-pass step", p, (1, 8), 1)
    step([[0, 1], [2, 3], [4, 5], [6, 7]], 4)
    out += expect_errors("a clean 4-pass step", p, None, 0)
    return out


def weights(seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w13": torch.randn(E, 6, 4, generator=gen),
        "w2": torch.randn(E, 4, 3, generator=gen),
    }


def eager_step(p: DevicePlannedProvider, device: str = "cpu") -> Step:
    def step(rows: Rows, passes: int) -> None:
        ids = torch.tensor(rows, dtype=torch.int32, device=device)
        for index in range(passes):
            p.prepare(ids, pass_index=index, passes=passes)

    return step


class EveryPassCounts:
    """A seeded bug around real kernels: after each pass, count the step's bad ids again
    (``bad``) on every pass but the first, or its overflow (``overflow``) on every pass but the
    last; as if the planner counted on every pass. Torch operations of fixed shapes, on the
    state's device (capturable in a CUDA graph)."""

    def __init__(self, inner: Kernels, *, bad: bool = False, overflow: bool = False) -> None:
        self.inner = inner
        self.name = inner.name
        self.bad = bad
        self.overflow = overflow

    def plan(
        self, state: DeviceCacheState, topk_ids: Tensor, pass_index: int, num_passes: int
    ) -> None:
        self.inner.plan(state, topk_ids, pass_index, num_passes)
        ids = topk_ids.reshape(-1).to(torch.int64)
        e = state.num_experts
        valid = (ids >= 0) & (ids < e)
        if self.bad and pass_index > 0:
            state.counters[COUNTERS.index("bad_ids")] += (~valid & (ids != -1)).sum()
        if self.overflow and pass_index < num_passes - 1:
            marks = torch.zeros(e + 1, dtype=torch.int64, device=ids.device)
            marks.scatter_(0, torch.where(valid, ids, e), 1)
            distinct = marks[:e].sum()
            extra = (distinct - num_passes * state.capacity).clamp(min=0)
            state.counters[COUNTERS.index("overflow")] += extra

    def gather(self, state: DeviceCacheState) -> None:
        self.inner.gather(state)

    def invalidate(self, state: DeviceCacheState, expert_id: int) -> None:
        self.inner.invalidate(state, expert_id)


SEEDED = {
    "bad_ids_every_pass": {"bad": True},
    "overflow_every_pass": {"overflow": True},
}


def test_error_counts_once_per_step() -> None:
    p = DevicePlannedProvider(**weights(), capacity=C, device="cpu", kernels="torch")  # type: ignore[arg-type]
    assert p.kernels == "torch"
    assert error_count_problems(p, eager_step(p)) == []


def test_error_counts_once_per_step_through_the_public_constructor() -> None:
    w = weights()
    p = RowCacheWeightProvider(w["w13"], w["w2"], capacity=C, device="cpu", planner="device")
    assert isinstance(p, DevicePlannedProvider)
    assert error_count_problems(p, eager_step(p)) == []


def test_a_multi_pass_forward_counts_its_bad_ids_once() -> None:
    """``run_with_expert_cache`` runs the step's 4 passes: 3 bad ids, not 12."""
    p = DevicePlannedProvider(**weights(), capacity=C, device="cpu")  # type: ignore[arg-type]
    ids = torch.tensor(BAD, dtype=torch.int32)
    assert p.num_passes(ids) == 4
    run_with_expert_cache(p, ids, lambda w, rows, shared: torch.zeros(rows.stop - rows.start, 1))
    with pytest.raises(DeviceInputError) as info:
        p.stats()
    assert str(info.value) == bad_part(3, 9)
    assert p.stats()["passes"] == 4


@pytest.mark.parametrize("seeded", sorted(SEEDED))
def test_a_planner_counting_on_every_pass_is_caught(seeded: str) -> None:
    p = DevicePlannedProvider(**weights(), capacity=C, device="cpu", kernels="torch")  # type: ignore[arg-type]
    p._kernels = EveryPassCounts(p._kernels, **SEEDED[seeded])
    problems = error_count_problems(p, eager_step(p))
    assert problems, "the seeded miscount went unnoticed"
    if seeded == "bad_ids_every_pass":
        assert any("12 topk_ids entries" in line for line in problems), problems
    else:
        assert any("4 requested experts" in line for line in problems), problems

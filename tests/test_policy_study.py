"""tools/policy_study.py: its few-line LRU is the providers' policy (both planners, on the
same skewed steps), and so is its slot cache with LRU victims, exactly, on every model's
routing; its bound bounds every policy it prints; a frequency-aware choice beats LRU on skewed
routing where steps are large, also when a step larger than the slots must keep its last pass,
not on uniform routing; and the same choice in a slot cache, which must admit every miss,
gains at batch 1 and little at 8."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import policy_study as study

ROOT = Path(__file__).resolve().parents[1]
WARM, STEPS = 40, 140


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_study_lru_is_the_providers_policy(rows: int) -> None:
    steps, _ = study.skewed_steps(1.0, rows, STEPS)
    lru = study.lru_hit_rate(steps, WARM)
    for planner in ("host", "device"):
        assert study.provider_hit_rate(planner, steps, WARM) == pytest.approx(lru, abs=0.02)


@pytest.mark.parametrize("rows", [8, 32])
def test_frequency_beats_lru_on_skewed_routing_and_the_bound_bounds_all(rows: int) -> None:
    steps, scales = study.skewed_steps(1.0, rows, STEPS)
    lru = study.provider_hit_rate("device", steps, WARM)
    lfu = study.lfu_hit_rate(steps, WARM)
    passes = study.lfu_passes_hit_rate(steps, WARM)
    static = study.static_hit_rate(steps, scales, WARM)
    bound = study.bound_hit_rate(steps, WARM)
    assert lfu > lru + 0.05 and static > lru + 0.05
    # Served in passes, whose last pass's experts must stay: still above LRU, not above the
    # free choice.
    assert lru < passes <= lfu
    assert bound >= max(lru, lfu, passes, static)


@pytest.mark.parametrize("model", sorted(study.MODELS))
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_the_slot_cache_is_the_providers_policy_under_both_policies(
    model: str, alpha: float
) -> None:
    geometry = study.MODELS[model]
    for rows in (1, 8, 32):
        steps, _ = study.skewed_steps(alpha, rows, 60, geometry=geometry)
        lru = study.slot_cache_hit_rate(steps, 20, geometry, counted=False)
        for planner in ("host", "device"):
            assert study.provider_hit_rate(planner, steps, 20, geometry) == lru
            for count_max in (3, 15):  # 15: the default, the study's table
                lfu = study.slot_cache_hit_rate(steps, 20, geometry, count_max=count_max)
                by_count = study.provider_hit_rate(
                    planner, steps, 20, geometry, policy="lfu", count_max=count_max
                )
                assert by_count == lfu, (planner, rows, count_max)


@pytest.mark.parametrize("model", ["qwen3", "gpt-oss-20b", "deepseek-v2-lite"])
def test_counted_victims_in_a_slot_cache_gain_at_batch_1_on_skewed_routing(model: str) -> None:
    geometry = study.MODELS[model]
    steps, _ = study.skewed_steps(1.0, 1, STEPS, geometry=geometry)
    lru = study.slot_cache_hit_rate(steps, WARM, geometry, counted=False)
    counted = study.slot_cache_hit_rate(steps, WARM, geometry)
    assert counted > lru + 0.02
    assert study.bound_hit_rate(steps, WARM, geometry.capacity) >= counted
    uniform, _ = study.skewed_steps(0.0, 1, STEPS, geometry=geometry)
    rates = [study.slot_cache_hit_rate(uniform, WARM, geometry, counted=c) for c in (True, False)]
    assert rates[0] == pytest.approx(rates[1], abs=0.05)


def test_counts_choose_the_victim_and_halve_when_they_saturate() -> None:
    """Two slots; expert 1 requested eight times, then expert 0 twice, then expert 2, then 1
    again. Victim of expert 2: LRU takes 1 (the older); raw counts take 0 (two requests
    against eight); counts saturating at 3 and halved whenever one would pass it have forgotten
    part of 1's requests (2 against 0's 2: a tie, which goes to the older) and take 1, where
    counts that only saturated would hold 3 against 2 and take 0."""
    geometry = study.Geometry(experts=3, top_k=1, capacity=2)
    ids = [1] * 8 + [0] * 2 + [2, 1]
    steps = [torch.tensor([[e]]) for e in ids]
    last = len(steps) - 1  # the hit rate of the last step alone: 1.0 when 1 stayed
    assert study.slot_cache_hit_rate(steps, last, geometry, counted=False) == 0.0
    assert study.slot_cache_hit_rate(steps, last, geometry, count_max=100) == 1.0
    assert study.slot_cache_hit_rate(steps, last, geometry, count_max=3) == 0.0


def test_uniform_routing_has_the_static_ceiling_for_every_policy() -> None:
    steps, scales = study.skewed_steps(0.0, 8, STEPS)
    assert study.static_hit_rate(steps, scales, WARM) == pytest.approx(0.25, abs=0.04)
    for rate in (study.provider_hit_rate("host", steps, WARM), study.lfu_hit_rate(steps, WARM)):
        assert 0.2 <= rate <= 0.3


def test_the_byte_model() -> None:
    assert study.uva_ratio(0.25) == pytest.approx(1.0)
    assert study.uva_ratio(0.625) == pytest.approx(2.0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.policy_study", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_command_line() -> None:
    done = _cli("--rows", "8", "--steps", "60")
    assert done.returncode == 0 and "host" in done.stdout and "bound" in done.stdout
    refused = _cli("--steps", "10", "--warm", "10")
    assert refused.returncode == 2 and "--warm 10 must be below --steps 10" in refused.stderr

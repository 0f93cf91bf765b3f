"""tools/policy_study.py: its few-line LRU is the providers' policy (both planners, on the
same skewed steps), its bound bounds every policy it prints, and a frequency-aware choice
beats LRU on skewed routing where steps are large, also when a step larger than the slots
must keep its last pass, not on uniform routing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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

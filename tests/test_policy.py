"""The victim policy's settings and counts (``rowcache.policy``): bad values refused by both
providers before anything is built, naming the value and the limit; the counts' arithmetic."""

from __future__ import annotations

import pytest
import torch

from rowcache import InvalidInputError, RowCacheWeightProvider
from rowcache.policy import COUNT_MAX, RequestCounts, check_policy


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(4, 2, 1), torch.zeros(4, 1, 1)


@pytest.mark.parametrize(
    ("policy", "count_max", "message"),
    [
        ("mru", 15, "policy must be one of ['lru', 'lfu'], got 'mru'"),
        ("LFU", 15, "policy must be one of ['lru', 'lfu'], got 'LFU'"),
        ("lfu", 0, "count_max must be in [1, 15], got 0"),
        ("lfu", 16, "count_max must be in [1, 15], got 16"),
        ("lfu", True, "count_max must be an int in [1, 15], got True"),
        ("lru", 3.0, "count_max must be an int in [1, 15], got 3.0"),
    ],
)
@pytest.mark.parametrize("planner", ["host", "device"])
def test_bad_settings_are_refused_before_anything_is_built(
    planner: str, policy: object, count_max: object, message: str
) -> None:
    # device="cuda" on a machine without one: the policy is refused first, before the backend
    # or any slot would be made.
    for device in ("cpu", "cuda"):
        with pytest.raises(InvalidInputError) as caught:
            RowCacheWeightProvider(
                *weights(),
                capacity=2,
                device=device,
                planner=planner,  # type: ignore[arg-type]
                policy=policy,  # type: ignore[arg-type]
                count_max=count_max,  # type: ignore[arg-type]
            )
        assert str(caught.value) == message


def test_check_policy_returns_what_it_checked() -> None:
    assert check_policy("lfu", 3) == ("lfu", 3)
    assert check_policy("lru", COUNT_MAX) == ("lru", COUNT_MAX)


def test_counts_halve_every_count_before_one_would_pass_the_maximum() -> None:
    counts = RequestCounts(4, 2)
    counts.add([0, 1])
    counts.add([0])
    assert counts.snapshot() == (2, 1, 0, 0)
    counts.add([0, 2])  # 0 is at 2: every count halved, then 0 and 2 counted
    assert counts.snapshot() == (2, 0, 1, 0)
    counts.add([3])  # none of the pass's at the maximum: no halving
    assert counts.snapshot() == (2, 0, 1, 1)

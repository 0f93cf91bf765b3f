"""The worker extension a server is read through (``POST /collective_rpc``) and the counter
check it feeds: on real CPU providers, and against seeded miscounts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rowcache import RowCacheWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.vllm import expert_cache_counter_problems
from rowcache.vllm.worker_extension import QUALNAME, ExpertCacheRpc

E, C, H, N = 6, 3, 8, 4


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w13": torch.randn(E, 2 * N, H, generator=g),
        "w2": torch.randn(E, H, N, generator=g),
    }


class Method:
    def __init__(self, provider: Any) -> None:
        self.rowcache_provider = provider
        self.rowcache_forwards = 0


class Layer(nn.Module):
    def __init__(self, provider: Any) -> None:
        super().__init__()
        self.quant_method = Method(provider)


class Runner:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model


class Worker(ExpertCacheRpc):
    def __init__(self, model: nn.Module) -> None:
        self.model_runner = Runner(model)


def served_worker() -> tuple[Worker, list[Any]]:
    providers: list[Any] = [
        RowCacheWeightProvider(**weights(0), capacity=C, device="cpu"),
        DevicePlannedProvider(**weights(1), capacity=C, device="cpu"),  # type: ignore[arg-type]
    ]
    model = nn.Sequential(*(Layer(p) for p in providers))
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        ids = torch.randint(-1, E, (1, 2), generator=g)  # at most 2 unique: fits C
        for p in providers:
            p.prepare(ids)
    for p in providers:
        p.invalidate(int(next(iter(p.resident_experts()))))
        p.invalidate(E - 1)  # resident or not: only a resident one counts
    return Worker(model), providers


def test_qualname_names_the_class() -> None:
    module, _, name = QUALNAME.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is ExpertCacheRpc


def test_a_served_cache_reads_consistent_counters_and_exact_slots() -> None:
    worker, providers = served_worker()
    stats = worker.rowcache_stats()
    assert [s["layer"] for s in stats] == ["0", "1"]
    assert all(s["misses"] > C and s["evictions"] > 0 and s["invalidations"] >= 1 for s in stats)
    assert expert_cache_counter_problems(stats) == []
    check = worker.rowcache_slot_check()
    assert check["layers"] == 2 and check["mismatches"] == []
    assert check["slots"] == sum(len(p.resident_experts()) for p in providers)


def test_a_corrupted_slot_is_reported() -> None:
    worker, providers = served_worker()
    _, slot = next(iter(providers[0].resident_experts().items()))
    providers[0].buf_w2[slot].add_(1.0)
    mismatches = worker.rowcache_slot_check()["mismatches"]
    assert len(mismatches) == 1 and mismatches[0].startswith("0: ")


@pytest.mark.parametrize(
    ("seed", "words"),
    [
        ({"misses": 1}, "misses - evictions - invalidations"),  # a miss counted twice
        ({"evictions": -1}, "misses - evictions - invalidations"),  # an eviction lost
        ({"invalidations": 1}, "misses - evictions - invalidations"),
        ({"resident": C + 1 - 0}, "outside [0, capacity"),
        ({"hits": -(10**9)}, "a negative counter"),
    ],
)
def test_seeded_miscounts_are_caught(seed: dict[str, int], words: str) -> None:
    worker, _ = served_worker()
    stats = worker.rowcache_stats()
    for key, delta in seed.items():
        stats[0][key] = stats[0][key] + delta if key != "resident" else delta
    problems = expert_cache_counter_problems(stats)
    assert problems and all(p.startswith("0: ") for p in problems)
    assert any(words in p for p in problems), problems


def test_unreadable_counters_are_a_problem_not_a_pass() -> None:
    assert expert_cache_counter_problems([{"layer": "x", "hits": 1}]) == [
        "x: counters unreadable (KeyError: 'misses')"
    ]


def test_the_pinned_read_names_torch_s_blocks_and_the_arenas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``rowcache_pinned`` answers with or without a cache: torch's caching host allocator's
    blocks (None on a machine without CUDA) and the arenas' slabs."""
    import rowcache.pinned as pinned
    from rowcache.pinned import PinnedArena

    assert ExpertCacheRpc().rowcache_pinned() == {
        "torch_host_bytes": None,
        "arena_bytes": 0 if pinned._ARENA is None else pinned._ARENA.reserved_bytes,
        "transient_bytes": 0 if pinned._TRANSIENT is None else pinned._TRANSIENT.reserved_bytes,
    }
    arena = PinnedArena(slab_bytes=4096, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))
    kept = arena.empty((10,), torch.uint8)
    monkeypatch.setattr(pinned, "_TRANSIENT", arena)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 3 << 20}
    )
    got = ExpertCacheRpc().rowcache_pinned()
    assert got["torch_host_bytes"] == 3 << 20 and got["transient_bytes"] == 4096
    del kept

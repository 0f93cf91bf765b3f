"""Host and device time of ``prepare`` at a fixed number of misses per step.

One step: record a start event on the current stream, call ``prepare`` (host time is
``time.perf_counter`` around that call alone), enqueue a trivial consumer read of the slots
on the current stream (one element of every slot of ``w1`` and ``w2`` summed, and the maximum of
the returned ``expert_map``), record an end event, and synchronize on it. The device time is
the events' elapsed time: it covers the copies (on the row provider's copy stream, joined by
its ready event; on the current stream for ``cached``), the map uploads and the read. Each step
is isolated (synchronized) so that its numbers do not overlap the next one's.

Copy path: for providers with a CUDA backend (``row``, ``row_packed``, ``row_pt``), a second
pass of the same number of steps runs with the backend's copy timing on
(``CudaBackend.copy_timing``): CUDA events recorded on the copy stream immediately before and
after the copy API call(s) of each step. Its median is the time the copy stream spends on the
copies alone, from the first API call being enqueued to the last row landing. A separate
pass, so that the timing events' host cost stays out of the step timings of the first.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rowcache.bench.providers import BenchProvider, copy_timing_of
from rowcache.bench.steps import exact_miss_request, request_tensor
from rowcache.types import ExpertWeightResult

__all__ = ["StepTiming", "consume", "fill", "measure_cell", "timed_step"]


@dataclass(frozen=True)
class StepTiming:
    host_s: float
    device_s: float
    misses: int


def consume(result: ExpertWeightResult, topk: Tensor) -> Tensor:
    """A trivial reader of the slots and the map on the current stream (``topk`` unused on
    the device: it is a CPU tensor, and moving it would add a copy to the step)."""
    del topk
    slots = result.expert_map.max()
    first = result.w1.view(result.w1.shape[0], -1)[:, 0].float().sum()
    second = result.w2.view(result.w2.shape[0], -1)[:, 0].float().sum()
    return first + second + slots.float()


def timed_step(provider: BenchProvider, topk: Tensor, device: torch.device) -> StepTiming:
    stream = torch.cuda.current_stream(device)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    misses_before = provider.stats()["misses"]
    start.record(stream)
    t0 = time.perf_counter()
    result = provider.prepare(topk)
    host = time.perf_counter() - t0
    consume(result, topk)
    end.record(stream)
    end.synchronize()
    device_s = start.elapsed_time(end) / 1e3
    return StepTiming(host, device_s, provider.stats()["misses"] - misses_before)


def fill(provider: BenchProvider, capacity: int, top_k: int, num_experts: int) -> None:
    """Fill every slot (all-miss steps) so that later steps evict."""
    rng = random.Random(0)
    while len(provider.resident_experts()) < capacity:
        ids = exact_miss_request(provider, top_k, top_k=top_k, num_experts=num_experts, rng=rng)
        provider.prepare(request_tensor(ids))
    torch.cuda.synchronize()


def _request(
    provider: BenchProvider, misses: int, top_k: int, num_experts: int, rng: random.Random
) -> Tensor:
    ids = exact_miss_request(provider, misses, top_k=top_k, num_experts=num_experts, rng=rng)
    return request_tensor(ids)


def _check(timing: StepTiming, misses: int) -> None:
    if timing.misses != misses:
        raise RuntimeError(f"step made {timing.misses} misses, expected {misses}")


def measure_cell(
    provider: BenchProvider,
    misses: int,
    *,
    top_k: int,
    num_experts: int,
    steps: int,
    warmup: int,
    seed: int,
    device: torch.device,
) -> dict[str, float | None]:
    """Medians over ``steps`` steps (after ``warmup``) of exactly ``misses`` misses each; then,
    when the provider's backend can time its copies and ``misses > 0``, the median copy-path
    time over ``steps`` more steps (``copy_us_median``, else None)."""
    rng = random.Random(seed)
    hosts: list[float] = []
    devices: list[float] = []
    for index in range(warmup + steps):
        timing = timed_step(provider, _request(provider, misses, top_k, num_experts, rng), device)
        _check(timing, misses)
        if index >= warmup:
            hosts.append(timing.host_s)
            devices.append(timing.device_s)
    copy_us: float | None = None
    timer = copy_timing_of(provider, enabled=misses > 0)
    if timer is not None:
        copies: list[float] = []
        try:
            for _ in range(steps):
                timing = timed_step(
                    provider, _request(provider, misses, top_k, num_experts, rng), device
                )
                _check(timing, misses)
                records = timer.take()
                if len(records) != 1:
                    raise RuntimeError(f"expected one copy_rows per step, timed {len(records)}")
                copies.append(records[0][0])
        finally:
            copy_timing_of(provider, enabled=False)
        copy_us = statistics.median(copies) * 1e6
    return {
        "host_us_median": statistics.median(hosts) * 1e6,
        "device_us_median": statistics.median(devices) * 1e6,
        "host_us_p90": statistics.quantiles(hosts, n=10)[-1] * 1e6,
        "device_us_p90": statistics.quantiles(devices, n=10)[-1] * 1e6,
        "copy_us_median": copy_us,
    }

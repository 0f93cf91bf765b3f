"""Pinned host-to-device bandwidth by copy size: one contiguous copy, timed with CUDA events."""

from __future__ import annotations

import statistics

import torch

__all__ = ["MIB", "measure_ceiling"]

MIB = 1 << 20


def measure_ceiling(num_bytes: int, *, repeats: int, device: torch.device) -> float:
    """Median GB/s (1e9 bytes per second) of one pinned H2D copy of ``num_bytes``.

    The copy runs on a created stream, as the providers' copies do on theirs.
    """
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    times: list[float] = []
    with torch.cuda.stream(stream):
        for index in range(repeats + 3):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            if index >= 3:  # warm-up
                times.append(start.elapsed_time(end) / 1e3)
    return num_bytes / statistics.median(times) / 1e9

"""Seconds of one call, as the benches that run on the GPU and under Triton's interpreter time
it: CUDA events on a GPU, the host clock elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["one_call"]


def one_call(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call of ``fn`` takes on ``device``: between two CUDA events on the current
    stream on a GPU (the call's work enqueued between them), the host clock elsewhere."""

    def timed(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    return timed

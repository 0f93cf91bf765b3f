"""The read the link bench times (``rowcache.bench.link``): the GPU's SMs copy int64 words
from host memory into device memory, as the device planner's gather does
(``rowcache.device_plan.triton_kernels.gather_kernel``), one grid-stride loop of loads of
``BLOCK`` words with ``CACHE`` as their modifier. The typed launcher is ``link.read_words``."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["CACHE_MODIFIERS", "read_kernel"]

CACHE_MODIFIERS = ("", ".cg")
"""Triton's load modifiers tried: none (the gather's) and cache at L2 only (``.cv`` compiles to
the same plain load as none in Triton 3.6, so it is not offered)."""


@triton.jit
def read_kernel(src_addr, dst_ptr, n_words, BLOCK: tl.constexpr, CACHE: tl.constexpr):
    # The source is an address (as the gather's table holds them): host memory mapped for the
    # device, which no torch tensor describes for write-combined memory.
    src = src_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * BLOCK, n_words, nprog * BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < n_words
        tl.store(dst_ptr + at, tl.load(src + at, mask=inside, cache_modifier=CACHE), mask=inside)

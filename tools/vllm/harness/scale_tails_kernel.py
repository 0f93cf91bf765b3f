"""The load ``harness/scale_tails.py`` reads with: ``n`` bytes from byte ``start`` of ``src`` on,
past the end of its tensor if need be, as vLLM's MXFP4 matmul loads its last scale step
(unmasked). The typed launcher is ``scale_tails._read_on_cuda``.

Its parameters carry no annotations: Triton's code generator resolves annotations as globals,
and ``from __future__ import annotations`` makes them strings it cannot resolve (2026-12-07:
an annotated copy inside the launcher failed to compile on the GPU)."""

import triton
import triton.language as tl

__all__ = ["peek_kernel"]


@triton.jit
def peek_kernel(src, out, start, n: tl.constexpr):
    offsets = tl.arange(0, n)
    tl.store(out + offsets, tl.load(src + start + offsets))

"""The CUDA backend's batched miss path: one ``cudaMemcpyBatchAsync`` for every row of a call.

Why: a ``prepare`` with m misses over t source tensors used to make m x t ``copy_`` calls of
about 8 us host time each (DESIGN.md section 7), so NVFP4 experts (six tensors) reached only
about half of the PCIe link. ``cudaMemcpyBatchAsync`` (CUDA 12.8 and newer) enqueues any number
of pointer-to-pointer copies in one call, in stream order as a whole.

Addresses are plain integer arithmetic on base pointers and row strides, computed once at
``bind`` (``RowLayout``): building per-row tensor views (``buf[slot].data_ptr()``) costs
about 17 us each and made an earlier try slower than the plain copies. Sources are pinned host
tensors ``[E, ...]`` and slot buffers device tensors ``[capacity, ...]``; each must hold every
expert's (slot's) row contiguously, which ``RowLayout`` checks once.

``BatchedCopier`` calls NVIDIA's Python bindings (package ``cuda-bindings``, module
``cuda.bindings.runtime``). The import is lazy: this module imports on a machine without them,
and only building a copier (``CudaBackend(copy="batched")``) needs them; when they are missing,
or the driver predates the call, ``load_runtime`` raises ``BatchedCopyUnavailable`` naming what
is missing (there is no silent fallback to per-tensor copies).

Binding versions: the Python signature is ``cudaMemcpyBatchAsync(dsts, srcs, sizes, count,
attrs, attrsIdxs, numAttrs, stream)`` in cuda-bindings 12.9 and 13.x alike; 12.x returns
``(err, failIdx)`` and 13.x ``(err,)`` (CUDA 13 dropped the ``failIdx`` argument of the C
call). Only the error code (the first element) is read.

Limits of the call (CUDA documentation): it is rejected on the legacy default stream
(``CudaBackend`` uses per-tensor copies for a call issued there), and it has no graph-node form,
so a ``prepare`` whose copy stream is being captured into a CUDA graph cannot use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["BatchedCopier", "BatchedCopyUnavailable", "RowLayout", "load_runtime"]

MIN_DRIVER = 12080
"""``cudaDriverGetVersion`` value of the first driver with ``cudaMemcpyBatchAsync`` (12.8)."""


class BatchedCopyUnavailable(RuntimeError):
    """``copy="batched"`` cannot work here (bindings missing, driver too old, layout)."""


def _version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def load_runtime() -> Any:
    """``cuda.bindings.runtime``, checked to offer ``cudaMemcpyBatchAsync`` on this driver."""
    try:
        runtime = importlib.import_module("cuda.bindings.runtime")
    except ImportError as error:
        raise BatchedCopyUnavailable(
            "CudaBackend(copy='batched') needs NVIDIA's CUDA Python bindings: the package "
            "cuda-bindings (module cuda.bindings.runtime) is not importable "
            f"({error}). Install it (pip install 'rowcache[cuda]') to match the driver, or pass "
            "backend=CudaBackend(device, copy='per_tensor') for one copy per tensor per miss."
        ) from error
    if not hasattr(runtime, "cudaMemcpyBatchAsync"):
        bindings = importlib.import_module("cuda.bindings")
        raise BatchedCopyUnavailable(
            f"CudaBackend(copy='batched'): cuda-bindings {getattr(bindings, '__version__', '?')} "
            "has no cudaMemcpyBatchAsync (added with CUDA 12.8); upgrade cuda-bindings or pass "
            "copy='per_tensor'."
        )
    err, driver = runtime.cudaDriverGetVersion()
    if err != runtime.cudaError_t.cudaSuccess:
        raise BatchedCopyUnavailable(
            f"CudaBackend(copy='batched'): cudaDriverGetVersion failed ({err}); no usable driver"
        )
    if driver < MIN_DRIVER:
        raise BatchedCopyUnavailable(
            f"CudaBackend(copy='batched'): the CUDA driver supports CUDA {_version(driver)}, but "
            f"cudaMemcpyBatchAsync needs a driver for CUDA {_version(MIN_DRIVER)} or newer; "
            "upgrade the driver or pass copy='per_tensor'."
        )
    return runtime


def _row_span(name: str, role: str, t: Tensor) -> tuple[int, int, int]:
    """(base address, bytes between consecutive rows, bytes of one row) of ``t``'s rows."""
    element = t.element_size()
    row = t[0] if t.shape[0] > 0 else t
    row_bytes = row.numel() * element
    if t.shape[0] > 0 and not row.is_contiguous():
        raise BatchedCopyUnavailable(
            f"CudaBackend(copy='batched'): {role} {name} (shape {tuple(t.shape)}, strides "
            f"{t.stride()}) does not hold each row contiguously, so a row is not one byte "
            "range; pass contiguous tensors or copy='per_tensor'."
        )
    stride = t.stride(0) * element
    if t.shape[0] > 1 and row_bytes and stride < row_bytes:
        raise BatchedCopyUnavailable(
            f"CudaBackend(copy='batched'): rows of {role} {name} overlap (row stride {stride} "
            f"bytes < row size {row_bytes} bytes)"
        )
    return t.data_ptr(), stride, row_bytes


def _merged_span(
    rows: Sequence[tuple[Tensor, int, int, int]],
) -> tuple[int, int, int] | None:
    """(base address, row stride, bytes) of ONE range per row covering every tensor's row, when
    ``rows`` ((tensor, base, stride, row bytes) of each tensor) are views of one storage with a
    common row stride and the range fits in one stride; None otherwise."""
    storages = {t.untyped_storage().data_ptr() for t, _, _, _ in rows}
    strides = {stride for _, _, stride, _ in rows}
    if len(storages) != 1 or len(strides) != 1:
        return None
    (stride,) = strides
    start = min(base for _, base, _, _ in rows)
    end = max(base + size for _, base, _, size in rows)
    if end - start > stride:
        return None
    return start, stride, end - start


class RowLayout:
    """Where every row of every (slot buffer, source) pair lives, for address arithmetic.

    Built once from ``(slot buffer, source, name)`` triples; tensors with empty rows are left
    out of the batch (a zero-byte copy is not a valid batch entry), the others keep their order.
    Works on any tensors (CPU ones too, for tests): it only reads pointers and strides.

    When both sides are packed (``rowcache.packing``: every tensor a view of one storage, with
    one row stride, each tensor at the same offset from the first on both sides), one range per
    expert covers all its tensors, alignment padding included, and a miss is ONE batch entry:
    each entry costs the copy engine a few microseconds whatever its size.
    """

    __slots__ = ("_dst", "_row_bases", "_sizes", "_src", "expert_bytes", "merged", "names")

    def __init__(self, pairs: Sequence[tuple[Tensor, Tensor, str]]) -> None:
        dst: list[tuple[int, int]] = []
        src: list[tuple[int, int]] = []
        sizes: list[int] = []
        names: list[str] = []
        dst_rows: list[tuple[Tensor, int, int, int]] = []
        src_rows: list[tuple[Tensor, int, int, int]] = []
        for buf, source, name in pairs:
            dst_base, dst_stride, dst_row = _row_span(name, "slot buffer", buf)
            src_base, src_stride, src_row = _row_span(name, "source", source)
            if dst_row != src_row:
                raise BatchedCopyUnavailable(
                    f"CudaBackend(copy='batched'): {name}: a slot row holds {dst_row} bytes but "
                    f"a source row {src_row}"
                )
            if src_row == 0:
                continue
            dst.append((dst_base, dst_stride))
            src.append((src_base, src_stride))
            sizes.append(src_row)
            names.append(name)
            dst_rows.append((buf, dst_base, dst_stride, dst_row))
            src_rows.append((source, src_base, src_stride, src_row))
        self.names = tuple(names)
        self.expert_bytes = sum(sizes)
        """Bytes of one expert's rows (padding of a packed layout not counted)."""
        merged = self._merge(dst_rows, src_rows)
        self.merged = merged is not None
        """True when a miss is one range (packed on both sides)."""
        if merged is not None:
            dst, src, sizes = [merged[0]], [merged[1]], [merged[2]]
        self._dst = tuple(dst)
        self._src = tuple(src)
        self._sizes = sizes
        # Every tensor's own rows, for reporting the written addresses per tensor.
        self._row_bases = tuple((base, stride) for _, base, stride, _ in dst_rows)

    @staticmethod
    def _merge(
        dst_rows: Sequence[tuple[Tensor, int, int, int]],
        src_rows: Sequence[tuple[Tensor, int, int, int]],
    ) -> tuple[tuple[int, int], tuple[int, int], int] | None:
        if len(dst_rows) < 2:
            return None
        dst, src = _merged_span(dst_rows), _merged_span(src_rows)
        if dst is None or src is None or dst[2] != src[2]:
            return None
        # The same offset from the range's start on both sides, tensor by tensor.
        same = all(
            d_base - dst[0] == s_base - src[0]
            for (_, d_base, _, _), (_, s_base, _, _) in zip(dst_rows, src_rows, strict=True)
        )
        if not same:
            return None
        return (dst[0], dst[1]), (src[0], src[1]), dst[2]

    def addresses(
        self, copies: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Destination addresses, source addresses and sizes of the batch entries of
        ``copies`` ((expert, slot) pairs), miss by miss: one per tensor in ``names`` order,
        or one per miss when merged."""
        dst, src = self._dst, self._src
        dsts = [base + slot * stride for _, slot in copies for base, stride in dst]
        srcs = [base + expert * stride for expert, _ in copies for base, stride in src]
        return dsts, srcs, self._sizes * len(copies)

    def row_addresses(self, copies: Sequence[tuple[int, int]]) -> list[int]:
        """The destination address of every tensor's row of ``copies``, merged or not (what a
        per-tensor copy would write: the stream sanitizer tracks tensors by these)."""
        rows = self._row_bases
        return [base + slot * stride for _, slot in copies for base, stride in rows]


class BatchedCopier:
    """Issues the rows of a ``RowLayout`` as one ``cudaMemcpyBatchAsync`` per call."""

    __slots__ = (
        "_attr_idxs",
        "_attrs",
        "_call",
        "_h2d",
        "_handles",
        "_memcpy",
        "_runtime",
        "_success",
        "layout",
    )

    def __init__(self, runtime: Any, layout: RowLayout, device: torch.device) -> None:
        self._runtime = runtime
        self.layout = layout
        self._call = runtime.cudaMemcpyBatchAsync
        self._memcpy = runtime.cudaMemcpyAsync
        self._h2d = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._success = runtime.cudaError_t.cudaSuccess
        # One attribute entry covers every copy (attrsIdxs = [0]): the source is host memory
        # (pinned: the sources are pinned at construction) read in stream order, like
        # cudaMemcpyAsync; the destination is the provider's device. Location hints only steer
        # managed memory, but state what the copies are.
        attr = runtime.cudaMemcpyAttributes()
        attr.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        source = runtime.cudaMemLocation()
        source.type = runtime.cudaMemLocationType.cudaMemLocationTypeHost
        source.id = 0
        target = runtime.cudaMemLocation()
        target.type = runtime.cudaMemLocationType.cudaMemLocationTypeDevice
        target.id = device.index if device.index is not None else 0
        attr.srcLocHint = source
        attr.dstLocHint = target
        self._attrs = [attr]
        self._attr_idxs = [0]
        self._handles: dict[int, Any] = {}

    def _stream(self, handle: int) -> Any:
        stream = self._handles.get(handle)
        if stream is None:
            stream = self._handles[handle] = self._runtime.cudaStream_t(handle)
        return stream

    def copy(self, handle: int, copies: Sequence[tuple[int, int]]) -> None:
        """Enqueue every row of ``copies`` on the stream ``handle`` (one API call)."""
        dsts, srcs, sizes = self.layout.addresses(copies)
        if not dsts:
            return
        result = self._call(
            dsts, srcs, sizes, len(dsts), self._attrs, self._attr_idxs, 1, self._stream(handle)
        )
        if result[0] != self._success:
            raise RuntimeError(
                f"cudaMemcpyBatchAsync of {len(dsts)} rows ({len(copies)} experts) on stream "
                f"{handle:#x} failed: {result[0]!r}"
            )

    def upload(self, handle: int, destination: int, source: int, num_bytes: int) -> None:
        """One ``cudaMemcpyAsync`` of ``num_bytes`` from pinned host ``source`` to device
        ``destination`` on the stream ``handle`` (the backend's map uploads)."""
        result = self._memcpy(destination, source, num_bytes, self._h2d, self._stream(handle))
        if result[0] != self._success:
            raise RuntimeError(
                f"cudaMemcpyAsync of a {num_bytes}-byte map on stream {handle:#x} failed: "
                f"{result[0]!r}"
            )

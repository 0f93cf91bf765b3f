"""What lies just past each gpt-oss layer's w13 weight scales, where vLLM's kernel reads it.

vLLM 0.25.0's MXFP4 matmul on Hopper loads each swizzled weight-scale row's last K step
unmasked, 64 bytes past the row; the last expert's last w13 row reads past the scale tensor's
storage, and 32 of those bytes reach output columns 5744 to 5759, where they multiply a zero
weight: a finite byte vanishes, an e8m0 ``0xFF`` gives NaN, and the clamped SwiGLU turns the
NaN into wrong finite values (docs/GPT_OSS.md, section 3). So the last expert's outputs depend
on what the allocator put after that tensor. This probe reads :data:`TAIL_BYTES` bytes past the
end of each layer's w13 scale storage, as the kernel finds them, and counts the ``0xFF`` bytes:
in vLLM as it comes (``nonebare.full``) its own tensor and whatever follows it; in a cache
engine the slot buffer, and in the guarded no offload (``harness/scale_guard.py``) a copy of
vLLM's tensor, whose zero guard (``rowcache.sources.SLOT_GUARD_BYTES``) should show zeros.

On CUDA the bytes are read by a small Triton kernel (a load past the tensor's end, as the
matmul's); ``read`` stands in for it elsewhere. torch and Triton are imported when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TAIL_BYTES", "storage_end", "tails"]

TAIL_BYTES = 64
"""Bytes read past the storage's end: the matmul's over-read of one scale row."""

FF = 0xFF
"""The byte that a scale read past the end turns into NaN (e8m0's NaN)."""


def _w13_scales(method: Any) -> Any:
    """The torch tensor behind a gpt-oss MXFP4 method's w13 weight scales (vLLM's method and
    the plugin's keep them in ``w13_precision_config``), or None."""
    precision = getattr(method, "w13_precision_config", None)
    scale = getattr(precision, "weight_scale", None)
    storage = getattr(scale, "storage", None)
    return getattr(storage, "data", None)


def storage_end(data: Any) -> int:
    """The byte offset in its storage just past ``data``'s last element (any strides)."""
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(data.shape, data.stride(), strict=True)
    )
    return int((data.storage_offset() + span) * data.element_size())


def _read_on_cuda(raw: Any, start: int, count: int) -> list[int]:
    """``count`` bytes of ``raw``'s memory from byte ``start`` on, past its end if need be
    (``raw``: a uint8 tensor over a whole storage), loaded as the matmul loads them."""
    import torch

    from tools.vllm.harness.scale_tails_kernel import peek_kernel

    out = torch.empty(count, dtype=torch.uint8, device=raw.device)
    peek_kernel[(1,)](raw, out, start, n=count)
    return [int(v) for v in out.tolist()]


def tails(model: Any, read: Callable[[Any, int, int], list[int]] | None = None) -> dict[str, Any]:
    """``{"layers": {name: {"bytes": [...], "ff": n}}, "layers_with_ff": n, "tail_bytes": k}``
    over the gpt-oss MXFP4 layers of ``model``: the bytes from the end of each w13 scale
    tensor on (``read(raw, start, count)``: the reader; default the CUDA kernel)."""
    import torch

    reader = _read_on_cuda if read is None else read
    layers: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        data = _w13_scales(getattr(module, "quant_method", None))
        if not isinstance(data, torch.Tensor):
            continue
        raw = torch.tensor([], dtype=torch.uint8, device=data.device).set_(data.untyped_storage())
        found = reader(raw, storage_end(data), TAIL_BYTES)
        layers[name] = {"bytes": found, "ff": sum(b == FF for b in found)}
    return {
        "layers": layers,
        "layers_with_ff": sum(1 for c in layers.values() if c["ff"]),
        "tail_bytes": TAIL_BYTES,
    }

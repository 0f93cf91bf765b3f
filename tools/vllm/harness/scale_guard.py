"""No offload with its MXFP4 weight scales followed by zeros, as the cache's slots are.

vLLM 0.25.0's MXFP4 kernel on Hopper reads past each gpt-oss layer's swizzled w13 weight
scales, and an ``0xFF`` byte there changes the last expert's outputs (docs/GPT_OSS.md, section
3; ``harness/scale_tails.py`` reads what lies there). The cache's slot buffers are followed by
zeros (``rowcache.sources.SLOT_GUARD_BYTES``); vLLM's own scale tensors by whatever its
allocator put next. An engine with ``EngineSpec.guard_scale_tails`` is vLLM without the cache
whose tokens do not depend on that: right after vLLM converts a layer's weights, before any
graph is captured, each of its w13 and w2 weight-scale tensors is copied into storage of the
same strides followed by :data:`~rowcache.sources.SLOT_GUARD_BYTES` zero bytes, in the
triton_kernels wrapper that the method's precision config and its kernel's quant config share.

The engine's process must hold vLLM's engine core (``install`` patches a class here), as the
trace's hooks must. torch is imported when a function runs (``probes``' rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.vllm.harness.scale_tails import storage_end

__all__ = ["KEYS", "guard", "guarded_like", "install", "record", "uninstall"]

KEYS = ("w13", "w2")
"""The weight scales guarded: ``<key>_precision_config.weight_scale`` of a method."""

_MARK = "_unguarded"
"""The attribute of a wrapped ``process_weights_after_loading`` that holds the class's own."""

_GUARDED: list[str] = []
"""The classes of the methods guarded in this process, one entry a layer (:func:`record`)."""


def guarded_like(data: Any) -> Any:
    """A copy of ``data`` with its shape, strides and storage offset, whose storage holds zeros
    up to ``data``'s offset, its bytes, zeros between them where the strides leave gaps, and
    then :data:`~rowcache.sources.SLOT_GUARD_BYTES` zero bytes past its last element."""
    from rowcache.sources import guarded_empty

    end = storage_end(data) // data.element_size()
    flat = guarded_empty((end,), data.dtype, data.device)
    copy = flat.as_strided(tuple(data.shape), data.stride(), data.storage_offset())
    copy.copy_(data)
    return copy


def _precision_configs(method: Any, key: str) -> list[tuple[str, Any]]:
    """Every precision config of ``key``'s weight that ``method`` holds, by where: its own and
    those of its quant configs (the kernel's reads its scales)."""
    index = {"w13": "_w1", "w2": "_w2"}[key]
    found = [(f"{key}_precision_config", getattr(method, f"{key}_precision_config", None))]
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    for where, config in (
        ("moe_quant_config", getattr(method, "moe_quant_config", None)),
        ("moe_kernel.fused_experts.quant_config", getattr(kernel, "quant_config", None)),
    ):
        if config is not None:
            found.append((f"{where}.{index}.scale", getattr(config, index).scale))
    return found


def guard(method: Any) -> None:
    """Give ``method``'s converted w13 and w2 weight scales a zero tail (:func:`guarded_like`),
    in place in their triton_kernels ``Storage``; a ``RuntimeError`` naming what is missing
    where a precision config or a scale is absent, or where the kernel's quant config holds a
    scale of its own (which the guard would then miss). Nothing is changed before every check
    has passed."""
    storages: list[Any] = []
    for key in KEYS:
        configs = _precision_configs(method, key)
        own = configs[0][1]
        storage: Any = getattr(getattr(own, "weight_scale", None), "storage", None)
        if storage is None or getattr(storage, "data", None) is None:
            raise RuntimeError(
                f"scale guard: {type(method).__name__} has no {key} weight scale in "
                f"{configs[0][0]} after processing its weights (a vLLM other than 0.25.0?)"
            )
        for where, config in configs[1:]:
            theirs = getattr(getattr(config, "weight_scale", None), "storage", None)
            if theirs is not storage:
                raise RuntimeError(
                    f"scale guard: {where} of {type(method).__name__} holds another {key} "
                    f"weight scale than {configs[0][0]}; the guard would miss what the kernel "
                    "reads"
                )
        storages.append(storage)
    for storage in storages:
        storage.data = guarded_like(storage.data)
    _GUARDED.append(type(method).__name__)


def record() -> dict[str, int]:
    """``{"layers": n}``: the methods :func:`guard` changed in this process (one a gpt-oss MoE
    layer); a ``RuntimeError`` where it changed none, since the engine would then measure vLLM
    unguarded under a guarded engine's name."""
    if not _GUARDED:
        raise RuntimeError(
            "guard_scale_tails: no gpt-oss MXFP4 layer was guarded (the model has none, or "
            "vLLM processed its weights elsewhere than GptOssMxfp4MoEMethod."
            "process_weights_after_loading)"
        )
    return {"layers": len(_GUARDED)}


def _target() -> Any:
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    return GptOssMxfp4MoEMethod


def install(cls: type | None = None) -> None:
    """Wrap ``process_weights_after_loading`` of ``cls`` (vLLM's ``GptOssMxfp4MoEMethod``
    unless a test names another) so that :func:`guard` follows it; a second call changes
    nothing. The cache's method overrides it and is not wrapped: its slots are guarded by the
    cache."""
    target: Any = _target() if cls is None else cls
    original: Callable[..., Any] = target.process_weights_after_loading
    if hasattr(original, _MARK):
        return

    def guarded(self: Any, layer: Any, _original: Callable[..., Any] = original) -> Any:
        result = _original(self, layer)
        guard(self)
        return result

    setattr(guarded, _MARK, original)
    target.process_weights_after_loading = guarded


def uninstall(cls: type | None = None) -> None:
    """The class's own ``process_weights_after_loading`` back; the count starts again."""
    target: Any = _target() if cls is None else cls
    original = getattr(target.process_weights_after_loading, _MARK, None)
    if original is not None:
        target.process_weights_after_loading = original
    _GUARDED.clear()

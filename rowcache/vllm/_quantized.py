"""The MoE methods of quantized models: which the cache takes over, which it rejects.

``install`` wraps ``RoutedExperts._get_quant_method``, where every MoE layer gets its method
from the model's quantization config (vLLM 0.25.0 and 0.33.0), once vLLM's fused-MoE package
has been imported (``rowcache.vllm`` installs it right after ``rowcache.vllm._method``). With
the cache on, ``take_over`` keeps our unquantized method (ours already, through the
out-of-tree registry), hands vLLM's FP8 methods to ``rowcache.vllm._fp8.adopt`` (block-scaled
FP8 checkpoints and online per-tensor FP8 on the TRITON FP8 backend) and gpt-oss's MXFP4 method
to ``rowcache.vllm._mxfp4.adopt`` (on the TRITON_UNFUSED backend), and rejects any other
method with its name and what is supported (``rowcache.vllm._method.SUPPORTED_METHODS``); with
the knob off vLLM's method is returned as it is.

``rowcache.vllm._fp8`` imports vLLM's FP8 modules, so it is imported only when a layer's method
is built (vLLM has imported them then): never while vLLM's fused-MoE package is being imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.config.vllm import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from rowcache.vllm._config import settings_of
from rowcache.vllm._method import RowcacheMoEMethod

__all__ = ["install", "take_over"]

_TAKES_OVER = "_rowcache_takes_over"


def take_over(method: Any) -> Any:
    """The method a MoE layer gets with the cache on: ours for what the cache serves (the
    unquantized method is ours already, through the out-of-tree registry; the FP8 methods of
    ``SUPPORTED_METHODS`` become ``rowcache.vllm._fp8``'s), vLLM's own with the knob off, and
    a ``RowcacheError`` naming the method and what is supported for any other."""
    if isinstance(method, RowcacheMoEMethod):
        return method
    config = get_current_vllm_config()
    settings = settings_of(config)
    if not settings.cache_on:
        return method
    if type(method).__name__ == "GptOssMxfp4MoEMethod":
        from rowcache.vllm import _mxfp4  # vLLM's MXFP4 modules: imported by now

        return _mxfp4.adopt(method, settings, config)
    from rowcache.vllm._fp8 import adopt  # vLLM's FP8 modules: imported by now

    return adopt(method, settings, config)


def _wrap_get_quant_method(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_quant_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return take_over(original(self, *args, **kwargs))

    setattr(_get_quant_method, _TAKES_OVER, True)
    _get_quant_method.__wrapped__ = original  # type: ignore[attr-defined]
    return _get_quant_method


def install() -> bool:
    """Wrap ``RoutedExperts._get_quant_method``; False when it is already wrapped."""
    if getattr(RoutedExperts._get_quant_method, _TAKES_OVER, False):
        return False
    RoutedExperts._get_quant_method = _wrap_get_quant_method(RoutedExperts._get_quant_method)
    return True

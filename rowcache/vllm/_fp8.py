"""vLLM's FP8 MoE methods with the expert cache (docs/PLUGIN.md, "FP8 experts").

Imported by ``rowcache.vllm._method.take_over`` when a MoE layer of an engine with the cache on
gets a method other than the unquantized one; vLLM has imported its FP8 modules by then (it
has just built the method). ``adopt`` takes over the two methods vLLM 0.25.0 builds for
``quantization="fp8"`` on an H200, on the backend it picks there, and rejects everything else
by name:

* ``Fp8MoEMethod`` with 128 x 128 block scales (an FP8 checkpoint with ``weight_block_size``
  [128, 128], as DeepSeek and Qwen ship them): ``w13_weight [E, 2I, H]`` and ``w2_weight
  [E, H, I]`` in float8_e4m3fn, ``w13_weight_scale_inv [E, 2I/128, H/128]`` and
  ``w2_weight_scale_inv [E, H/128, I/128]`` in float32, no input scales (dynamic). The four
  tensors are created in pinned host memory behind device views (vLLM's own ``create_weights``
  on the CPU, then moved), the provider is built over them before vLLM sets up its kernel, and
  vLLM's ``_setup_kernel`` builds the kernel's quant config through ``get_fused_moe_quant_config``,
  which here hands it the provider's scale slot buffers. The kernel gets the weight slots and
  the provider's ``expert_map`` on every call. The TRITON backend leaves the tensors as loaded
  (no shuffle); that they stay in place is checked after vLLM's processing.
* ``Fp8PerTensorOnlineMoEMethod`` (a bf16 checkpoint quantized while loading): vLLM loads and
  quantizes each layer on the GPU (its weights start on the meta device); after that the FP8
  weights and their ``[E]`` float32 scales move to pinned host memory, the provider is built
  over them and vLLM's ``_setup_kernel`` runs again over device views of the host tensors,
  building the quant config over the scale slots. The layer's expert set is on the GPU only
  while that layer is processed. Its activation scales are dynamic per tensor: one scale over
  each kernel call's whole input, and one over the whole intermediate, so a step cut into
  several calls (more experts than slots) is not bit-exact; a step that fits is.

Both run on ``TritonExperts`` (``Fp8MoeBackend.TRITON``), which reduces through the overridable
``moe_sum``: the exact route of cut steps (the tap of ``rowcache.vllm._method``) applies as it
does to the unquantized method; block scales quantize per row, so it is exact there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerTensorOnlineMoEMethod

from rowcache.types import ExpertWeightProvider
from rowcache.vllm._config import RowcacheError
from rowcache.vllm._method import (
    SUPPORTED_METHODS,
    CachedForward,
    build_provider,
    check_layer,
    device_view,
    pinned_empty,
    to_pinned,
)
from rowcache.vllm.knob import SIZE, CacheSettings

__all__ = ["BLOCK", "RowcacheFp8MoEMethod", "RowcacheFp8OnlineMoEMethod", "adopt"]

logger = logging.getLogger("rowcache.vllm")

BLOCK = [128, 128]
"""The block-scale shape the cache serves (vLLM's Triton kernel's fused SiLU + block quant
needs it too)."""

WEIGHTS = ("w13_weight", "w2_weight")
_said: set[str] = set()


def _scale_names(method: Any) -> tuple[str, str]:
    """``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` (block) or ``..._weight_scale``."""
    return f"w13_{method.weight_scale_name}", f"w2_{method.weight_scale_name}"


class ScaleSlots:
    """The layer as vLLM's ``get_fused_moe_quant_config`` reads it, its two weight-scale
    parameters replaced by the provider's scale slot buffers (fixed addresses)."""

    def __init__(self, layer: Any, slots: dict[str, Tensor]) -> None:
        self._layer = layer
        self._slots = slots

    def __getattr__(self, name: str) -> Any:
        slots: dict[str, Tensor] = self.__dict__["_slots"]
        if name in slots:
            return slots[name]
        return getattr(self.__dict__["_layer"], name)


def _scale_slots(method: Any, layer: Any, provider: ExpertWeightProvider) -> ScaleSlots:
    w13_name, w2_name = _scale_names(method)
    w13_scale = getattr(provider, "buf_w13_scale", None)
    w2_scale = getattr(provider, "buf_w2_scale", None)
    if w13_scale is None or w2_scale is None:
        raise RowcacheError(
            f"rowcache: the provider of {type(method).__name__} holds no scale slots "
            f"({w13_name}, {w2_name})"
        )
    return ScaleSlots(layer, {w13_name: w13_scale, w2_name: w2_scale})


def _check_backend(method: Any) -> None:
    backend = method.fp8_backend
    experts = method.experts_cls
    if backend == Fp8MoeBackend.TRITON and experts is TritonExperts:
        return
    raise RowcacheError(
        f"rowcache: {type(method).__name__} selected vLLM's FP8 MoE backend {backend.name} "
        f"({getattr(experts, '__name__', experts)}); the expert cache serves the TRITON backend "
        "(TritonExperts) only, the one vLLM picks on the H200 (capability 9.0) without expert "
        "parallelism, where FLASHINFER_TRTLLM, FLASHINFER_CUTLASS, DEEPGEMM, VLLM_CUTLASS, "
        "MARLIN and the others lay the experts out differently. It is steered by moe_backend, "
        "VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM set to 1 and VLLM_TEST_FORCE_FP8_MARLIN; "
        f"supported: {SUPPORTED_METHODS}"
    )


def adopt(method: Any, settings: CacheSettings, config: Any) -> Any:
    """``method`` (vLLM's, just built) as the cache's, or a ``RowcacheError`` naming it.

    The method returned is a new instance of our subclass of its class holding everything
    vLLM's constructor chose (backend, experts class, block size); the caller hands it to vLLM
    in place of ``method``.
    """
    name = type(method).__name__
    target: type[Any]
    if type(method) is Fp8MoEMethod:
        block = method.weight_block_size
        if block is None or list(block) != BLOCK:
            what = "per-tensor scales" if block is None else f"weight_block_size {list(block)}"
            raise RowcacheError(
                f"rowcache: {SIZE}={settings.size} does not support {name} with {what} yet "
                f"(an FP8 checkpoint); supported: {SUPPORTED_METHODS}"
            )
        target = RowcacheFp8MoEMethod
    elif type(method) is Fp8PerTensorOnlineMoEMethod:
        target = RowcacheFp8OnlineMoEMethod
    else:
        raise RowcacheError(
            f"rowcache: {SIZE}={settings.size} does not support vLLM's MoE method {name} "
            f"yet; supported: {SUPPORTED_METHODS}"
        )
    _check_backend(method)
    capacity = check_layer(method.moe, settings, name)
    # A new instance with the constructor's attributes, not ``method.__class__ = target``:
    # vLLM's methods descend from abc.ABC, and a subclass with our mixin in front has another
    # object layout, which class assignment refuses.
    adopted: Any = object.__new__(target)
    vars(adopted).update(vars(method))
    adopted._init_cache_state(settings, config)
    adopted._rowcache_capacity = capacity
    adopted._rowcache_hosts = {}
    if target is RowcacheFp8OnlineMoEMethod:
        message = (
            f"rowcache: {name} (online per-tensor FP8): a step cut into several kernel calls "
            "(more experts than slots) gets other activation scales than one call and is not "
            "bit-exact; a step that fits the slots is"
        )
        if message not in _said:
            _said.add(message)
            logger.warning(message)
    return adopted


class _CachedFp8Forward(CachedForward):
    """What both FP8 methods do alike with the cache: the kernel's quant config is built over
    the scale slots, and a forward runs through the cache; with no provider, vLLM's own. It
    comes first in each method's bases, so ``super()`` is that method's vLLM class."""

    _rowcache_capacity: int
    _rowcache_hosts: dict[str, Tensor]

    def _build_provider(self, hosts: dict[str, Tensor]) -> ExpertWeightProvider:
        """The provider over the layer's pinned host weights and scales (``hosts``, by
        parameter name)."""
        settings = self.rowcache_settings
        assert settings is not None
        w13_name, w2_name = _scale_names(self)
        return build_provider(
            settings,
            self._rowcache_capacity,
            hosts["w13_weight"],
            hosts["w2_weight"],
            hosts[w13_name],
            hosts[w2_name],
        )

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        base: Any = super()
        provider = self.rowcache_provider
        if provider is None:
            return base.get_fused_moe_quant_config(layer)
        return base.get_fused_moe_quant_config(_scale_slots(self, layer, provider))


class RowcacheFp8MoEMethod(_CachedFp8Forward, Fp8MoEMethod):  # type: ignore[misc]
    """vLLM's ``Fp8MoEMethod`` (block scales [128, 128], TRITON) with the expert cache; only
    ever made by ``adopt`` (the knob is on)."""

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # vLLM's own tensors (names, shapes, dtypes, initial scales, loader attributes), built
        # on the CPU instead of the GPU, then moved into pinned host memory.
        with torch.device("cpu"):
            super().create_weights(
                layer,
                num_experts,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                **extra_weight_attrs,
            )
        names = (*WEIGHTS, *_scale_names(self))
        self._rowcache_hosts = to_pinned(layer, names, keep_values=set(names[2:]), lasting=True)

    def process_weights_after_loading(self, layer: Any) -> None:
        assert self.rowcache_settings is not None
        hosts = self._rowcache_hosts
        provider = self.rowcache_provider
        if provider is not None:
            # Processed again (a weight reload wrote the host tensors): the resident slots
            # hold the old bytes; one provider per layer, whatever vLLM does again.
            for expert in range(provider.num_experts):
                provider.invalidate(expert)
            super().process_weights_after_loading(layer)
            return
        # Before vLLM's processing, which builds the kernel's quant config through
        # get_fused_moe_quant_config: over the scale slots.
        self.rowcache_provider = self._build_provider(hosts)
        views = {n: getattr(layer, n).data_ptr() for n in hosts}
        super().process_weights_after_loading(layer)
        moved = [n for n, ptr in views.items() if getattr(layer, n).data_ptr() != ptr]
        if moved:
            raise RowcacheError(
                f"rowcache: vLLM's processing of {type(self).__name__} on backend "
                f"{self.fp8_backend.name} replaced {', '.join(moved)}; the cache serves the "
                "tensors as loaded"
            )


class RowcacheFp8OnlineMoEMethod(_CachedFp8Forward, Fp8PerTensorOnlineMoEMethod):  # type: ignore[misc]
    """vLLM's ``Fp8PerTensorOnlineMoEMethod`` (TRITON) with the expert cache; only ever made
    by ``adopt`` (the knob is on)."""

    def process_weights_after_loading(self, layer: Any) -> None:
        done = getattr(layer, "_already_called_process_weights_after_loading", False)
        # vLLM materializes the layer on the GPU, quantizes it and builds its kernel.
        super().process_weights_after_loading(layer)
        if done or self.rowcache_provider is not None:
            return
        assert self.rowcache_settings is not None
        w13_name, w2_name = _scale_names(self)
        hosts: dict[str, Tensor] = {}
        for name in (*WEIGHTS, w13_name, w2_name):
            quantized = getattr(layer, name).data
            host = pinned_empty(tuple(quantized.shape), quantized.dtype, lasting=True)
            host.copy_(quantized)
            hosts[name] = host
        self._rowcache_hosts = hosts
        self.rowcache_provider = self._build_provider(hosts)
        # vLLM's kernel set-up again, over device views of the host tensors (the GPU copies
        # are released with the parameters they replace) and the scale slots.
        views = {n: device_view(h) for n, h in hosts.items()}
        self._setup_kernel(
            layer,
            views["w13_weight"],
            views["w2_weight"],
            views[w13_name],
            views[w2_name],
            None,
            None,
        )

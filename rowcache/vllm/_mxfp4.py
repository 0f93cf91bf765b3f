"""vLLM's gpt-oss MXFP4 MoE method with the expert cache (docs/GPT_OSS.md).

Imported by ``rowcache.vllm._quantized.take_over`` when a MoE layer of an engine with the cache
on gets ``GptOssMxfp4MoEMethod``; vLLM has imported its MXFP4 modules by then. ``adopt`` takes
the method over on vLLM's ``TRITON_UNFUSED`` backend (``UnfusedOAITritonExperts``: the one
whose ``apply`` takes the router's ids and an ``expert_map`` and reduces through a
``masked_moe_sum`` the exact route can tap; chosen with ``moe_backend="triton_unfused"``) and
rejects every other backend by name.

The layer's raw tensors (packed values, e8m0 scales, bf16 biases) are created in pinned host
memory. After loading, each layer goes to the GPU for vLLM's own conversion
(``_setup_kernel``: the Hopper swizzle, float32 biases, the scales moved into precision
configs); every expert's byte range of each converted tensor is then copied into pinned host
sources (``rowcache.vllm.mxfp4_slots.expert_rows``) and the GPU copies are dropped. The
provider's slot buffers stand in for them: seen with the converted storage's strides and
wrapped as vLLM wrapped it, with ``C`` experts (``slot_view``, ``rewrapped``), the scales in new
precision configs, the biases as the layer's parameters; vLLM's quant config and kernel are
then built over those, once, as ``_setup_kernel`` builds them.

Every kernel call of a cached forward is told the tiles of one call over every expert
(``_pin_tiles``). The CPU tests drive it through a fake of vLLM's classes
(tests/test_vllm_mxfp4.py); on the H200 at gpt-oss-20b's full depth its steps cut into passes
gave the tokens of the uncut engine and every slot was byte-exact
(docs/records/2026-12-04-gpt-oss.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import (
    UnfusedOAITritonExperts,
)
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
    Mxfp4MoeBackend,
    make_mxfp4_moe_kernel,
)
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod
from vllm.model_executor.utils import replace_parameter

from rowcache.types import ExpertWeightProvider, ExpertWeightResult
from rowcache.vllm._config import RowcacheError
from rowcache.vllm._method import (
    SUPPORTED_METHODS,
    CachedForward,
    ReductionTap,
    build_provider,
    check_layer,
    drop_replaced,
    layer_device,
    pinned_empty,
    release_host_cache,
    to_pinned,
)
from rowcache.vllm.knob import CacheSettings
from rowcache.vllm.mxfp4_slots import MaskedSumTap, expert_rows, rewrapped, slot_view

__all__ = ["RowcacheGptOssMxfp4MoEMethod", "adopt", "masked_sum_tap"]

_KERNEL_PARAMETERS = frozenset(inspect.signature(make_mxfp4_moe_kernel).parameters)

RAW = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
"""The layer's tensors as ``create_weights`` makes them (the biases where the model has them)."""


def masked_sum_tap() -> MaskedSumTap:
    """The tap standing in for the module global ``masked_moe_sum`` that
    ``UnfusedOAITritonExperts.apply`` calls (installed on first use, for every layer)."""
    module: Any = sys.modules[UnfusedOAITritonExperts.__module__]
    current = module.masked_moe_sum
    if isinstance(current, MaskedSumTap):
        return current
    tap = MaskedSumTap(current)
    module.masked_moe_sum = tap
    return tap


def adopt(method: Any, settings: CacheSettings, config: Any) -> Any:
    """vLLM's ``GptOssMxfp4MoEMethod`` (just built) as the cache's, or a ``RowcacheError``
    naming its backend and what is supported."""
    name = type(method).__name__
    backend = method.mxfp4_backend
    experts = method.experts_cls
    if backend != Mxfp4MoeBackend.TRITON_UNFUSED or experts is not UnfusedOAITritonExperts:
        raise RowcacheError(
            f"rowcache: {name} selected vLLM's MXFP4 MoE backend {backend.name} "
            f"({getattr(experts, '__name__', experts)}); the expert cache serves gpt-oss on the "
            "TRITON_UNFUSED backend (UnfusedOAITritonExperts) only, whose kernel takes the "
            "router's ids and an expert_map: start vLLM with --moe-backend triton_unfused "
            "(moe_backend='triton_unfused'). Supported: " + SUPPORTED_METHODS
        )
    if settings.compress_planes:
        raise RowcacheError(
            f"rowcache: moe_expert_cache_compress='on' holds bf16 experts as planes; {name}'s "
            "experts are MXFP4: set it to off or auto"
        )
    capacity = check_layer(method.moe, settings, name, biases=True)
    adopted: Any = object.__new__(RowcacheGptOssMxfp4MoEMethod)
    vars(adopted).update(vars(method))
    adopted._init_cache_state(settings, config)
    adopted._rowcache_capacity = capacity
    adopted._rowcache_hosts = {}
    adopted._rowcache_raw_params = []
    adopted._kernel_w = None
    return adopted


def _pin_tiles(experts: Any, method: RowcacheGptOssMxfp4MoEMethod) -> None:
    """Make the kernel choose the tiles of one call over every expert.

    ``matmul_ogs`` sizes its row tiles from the expected tokens per expert, by default the
    call's (row, k) entries over its local experts (``opt_flags.py``: ``m // n_expts_tot``):
    over ``C`` slots that is up to ``E / C`` times what one call over the ``E`` experts sees,
    and another tile may round differently. The routing data of every call of a cached forward
    therefore says what the call over every expert would (``expected_tokens_per_expt``), from
    the forward's entries and the layer's expert count (``_forward_starts``)."""
    original = experts._make_routing_data

    def make_routing_data(topk_ids: Tensor, topk_weights: Tensor, num_local_experts: int) -> Any:
        routing, gather, scatter = original(topk_ids, topk_weights, num_local_experts)
        if method._forward_entries:
            expected = max(1, method._forward_entries // method._global_experts)
            routing.expected_tokens_per_expt = expected
        return routing, gather, scatter

    experts._make_routing_data = make_routing_data


def _pinned_copy(t: Tensor) -> Tensor:
    host = pinned_empty(tuple(t.shape), t.dtype, lasting=True)
    host.copy_(t)
    return host


class RowcacheGptOssMxfp4MoEMethod(CachedForward, GptOssMxfp4MoEMethod):  # type: ignore[misc]
    """vLLM's ``GptOssMxfp4MoEMethod`` (TRITON_UNFUSED) with the expert cache; only ever made
    by ``adopt`` (the knob is on)."""

    _rowcache_capacity: int
    _rowcache_hosts: dict[str, Tensor]
    _rowcache_raw_params: list[tuple[str, Tensor]]
    _kernel_w: tuple[Any, Any] | None
    _forward_entries: int = 0
    _global_experts: int = 1
    w13_precision_config: Any
    w2_precision_config: Any

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # vLLM's own tensors, built on the CPU instead of the GPU, then pinned: the loader
        # writes the checkpoint's bytes there.
        with torch.device("cpu"):
            super().create_weights(
                layer,
                num_experts,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                **extra_weight_attrs,
            )
        names = tuple(n for n in RAW if getattr(layer, n, None) is not None)
        # Freed once converted: the transient arena's slabs (rowcache.pinned), collected then.
        self._rowcache_hosts = to_pinned(layer, names, keep_values=set(names), lasting=False)
        self._rowcache_raw_params = [(n, getattr(layer, n)) for n in names]

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.rowcache_provider is not None:
            raise RowcacheError(
                "rowcache: the weights of a gpt-oss MXFP4 layer served by the expert cache "
                "cannot be processed again (a reload): start a new engine"
            )
        assert self.rowcache_settings is not None
        device = layer_device()
        raw = {n: h.to(device) for n, h in self._rowcache_hosts.items()}
        # vLLM's conversion and kernel over every expert of this layer, on the GPU for now.
        self._setup_kernel(
            layer,
            raw["w13_weight"],
            raw["w2_weight"],
            raw["w13_weight_scale"],
            raw["w2_weight_scale"],
            raw.get("w13_bias"),
            raw.get("w2_bias"),
        )
        del raw
        # The raw pinned tensors: no longer needed, and their loaders (which vLLM keeps for as
        # long as the model lives) must not keep them pinned.
        self._rowcache_hosts = {}
        drop_replaced(layer, self._rowcache_raw_params)
        self._rowcache_raw_params = []
        release_host_cache()
        w13, w2 = layer.w13_weight, layer.w2_weight
        w13_pc, w2_pc = self.w13_precision_config, self.w2_precision_config
        kernel_tensors = {
            "w13": w13,
            "w2": w2,
            "w13_scale": w13_pc.weight_scale,
            "w2_scale": w2_pc.weight_scale,
        }
        hosts = {
            key: _pinned_copy(expert_rows(wrapper.storage.data))
            for key, wrapper in kernel_tensors.items()
        }
        biases = {
            key: _pinned_copy(getattr(layer, f"{key}_bias").data)
            for key in ("w13", "w2")
            if getattr(layer, f"{key}_bias", None) is not None
        }
        provider = build_provider(
            self.rowcache_settings,
            self._rowcache_capacity,
            hosts["w13"],
            hosts["w2"],
            hosts["w13_scale"],
            hosts["w2_scale"],
            w13_bias=biases.get("w13"),
            w2_bias=biases.get("w2"),
        )
        self.rowcache_provider = provider
        self._serve_from_slots(layer, provider, kernel_tensors)
        del kernel_tensors, w13, w2, w13_pc, w2_pc  # the layer's converted experts
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _serve_from_slots(
        self, layer: Any, provider: ExpertWeightProvider, kernel_tensors: dict[str, Any]
    ) -> None:
        """Point the layer, its precision configs and vLLM's kernel at the slot buffers."""

        def over_slots(key: str, slots: Tensor | None) -> Any:
            wrapper = kernel_tensors[key]
            if slots is None:
                raise RowcacheError(f"rowcache: the provider holds no {key} slots")
            return rewrapped(wrapper, slot_view(slots, wrapper.storage.data))

        w13 = over_slots("w13", provider.buf_w13)
        w2 = over_slots("w2", provider.buf_w2)
        self._kernel_w = (w13, w2)
        layer.w13_weight, layer.w2_weight = w13, w2
        self.w13_precision_config = dataclasses.replace(
            self.w13_precision_config, weight_scale=over_slots("w13_scale", provider.buf_w13_scale)
        )
        self.w2_precision_config = dataclasses.replace(
            self.w2_precision_config, weight_scale=over_slots("w2_scale", provider.buf_w2_scale)
        )
        for key, slots in (("w13", provider.buf_w13_bias), ("w2", provider.buf_w2_bias)):
            if slots is not None:
                replace_parameter(layer, f"{key}_bias", slots)
        # The tail of vLLM's _setup_kernel, over the slots (vLLM 0.33.0's kernel factory
        # takes no layer).
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        extra = {"layer": layer} if "layer" in _KERNEL_PARAMETERS else {}
        self.moe_kernel = make_mxfp4_moe_kernel(
            moe_quant_config=self.moe_quant_config,
            moe_config=self.moe,
            mxfp4_backend=self.mxfp4_backend,
            experts_cls=self.experts_cls,
            routing_tables=layer._expert_routing_tables(),
            **extra,
        )
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if experts is not None:
            _pin_tiles(experts, self)

    def _forward_starts(self, layer: Any, topk_ids: Tensor) -> None:
        # What a kernel call over every expert would see: this forward's (row, k) entries
        # over the layer's experts (``_pin_tiles``).
        self._forward_entries = int(topk_ids.numel())
        self._global_experts = int(layer.global_num_experts)

    def _kernel_weights(self, weights: ExpertWeightResult) -> tuple[Any, Any]:
        assert self._kernel_w is not None
        return self._kernel_w

    def _reduction_tap(self, kernel: Any) -> ReductionTap | None:
        experts = getattr(kernel, "fused_experts", None)
        return masked_sum_tap() if isinstance(experts, UnfusedOAITritonExperts) else None

    def _step_reduction(
        self, tap: ReductionTap, topk_ids: Tensor
    ) -> Callable[[Tensor, Tensor], None]:
        assert isinstance(tap, MaskedSumTap)
        taker = tap

        def reduce(unreduced: Tensor, output: Tensor) -> None:
            taker.reduce(unreduced, output, topk_ids)

        return reduce

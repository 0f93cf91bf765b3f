"""The vLLM side of the plugin: imported by ``rowcache.vllm.register`` only, with vLLM present.

Two changes to vLLM, both through names listed in ``rowcache.vllm.seams``:

* ``VllmConfig.__post_init__`` is wrapped. Before vLLM's own checks the knob is parsed (bad
  values stop the engine here) and the guards run (expert or data parallelism, LoRA, a
  quantized model); after them the MoE ops become splitting ops and full CUDA graphs are
  lowered to piecewise ones, because a host-planned cache must run between captured pieces.
* ``UnquantizedFusedMoEMethod`` is substituted out of tree by ``RowcacheMoEMethod``: with the
  cache on it allocates the expert weights in pinned host memory, builds the provider once the
  weights are processed, and routes ``apply`` through ``run_with_expert_cache``.

Why piecewise graphs gave wrong tokens with the MoE op as a splitting op (vLLM 0.25.0): a
captured piece reads its inputs from the addresses they had at capture time
(``CUDAGraphWrapper`` replays without copying inputs), while the eager MoE op returns a tensor
freshly allocated by the modular kernel (``torch.empty_like(hidden_states)``) on every call. The
piece after the op therefore reads whatever now lives at the capture-time address. Attention
avoids this by writing into an output buffer allocated inside the previous piece. Here each
layer instead copies its result into a buffer it owns (one row per captured batch size), so the
next piece always finds it at the captured address.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.config.vllm import VllmConfig, get_current_vllm_config
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

from rowcache.cached import CachedWeightProvider
from rowcache.forward import run_with_expert_cache
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.types import ExpertWeightProvider, ExpertWeightResult
from rowcache.vllm.knob import SIZE, CacheSettings, KnobError, parse_settings

__all__ = ["MOE_OPS", "RowcacheMoEMethod", "install"]

logger = logging.getLogger("rowcache.vllm")

MOE_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
"""vLLM's MoE custom ops; as splitting ops they run eagerly between captured pieces."""

_WRAPPED = "_rowcache_wrapped"
_said: set[str] = set()


class RowcacheError(RuntimeError):
    """A configuration the expert cache cannot serve, found while vLLM starts."""


# -- configuration ----------------------------------------------------------------------------


def settings_of(config: Any) -> CacheSettings:
    return parse_settings(getattr(config, "additional_config", None), os.environ)


def check_guards(config: Any, settings: CacheSettings) -> None:
    """Reject what the cache does not support, before vLLM allocates anything."""
    if not settings.cache_on:
        return
    parallel = config.parallel_config
    what = f"{SIZE}={settings.size}"
    if getattr(parallel, "enable_expert_parallel", False):
        raise RowcacheError(
            f"rowcache: {what} does not support expert parallelism (--enable-expert-parallel); "
            "each rank would cache experts it does not own. Turn one of them off."
        )
    if getattr(parallel, "data_parallel_size", 1) > 1:
        raise RowcacheError(
            f"rowcache: {what} does not support data parallelism (data_parallel_size="
            f"{parallel.data_parallel_size}); use tensor parallelism or one rank."
        )
    if getattr(config, "lora_config", None) is not None:
        raise RowcacheError(
            f"rowcache: {what} does not support LoRA (--enable-lora): LoRA's MoE path reads "
            "the full expert weights on the GPU."
        )
    model = getattr(config, "model_config", None)
    quantization = getattr(model, "quantization", None)
    if quantization is not None:
        raise RowcacheError(
            f"rowcache: {what} supports unquantized (bf16/fp16) experts only; this model's "
            f"quantization {quantization!r} uses a quantized MoE method that rowcache does "
            "not support yet."
        )


def adjust_graphs(config: Any, settings: CacheSettings) -> None:
    """Make the MoE op run eagerly between captured pieces, lowering full graphs."""
    cc = config.compilation_config
    if cc.mode != CompilationMode.VLLM_COMPILE:
        if cc.cudagraph_mode != CUDAGraphMode.NONE:
            logger.warning(
                "rowcache: cudagraph_mode %s without torch.compile (mode %s) would capture the "
                "host-planned MoE op; lowered to NONE.",
                cc.cudagraph_mode.name,
                cc.mode,
            )
            cc.cudagraph_mode = CUDAGraphMode.NONE
        return
    if cc.splitting_ops is not None and len(cc.splitting_ops) == 0:
        raise RowcacheError(
            "rowcache: compilation_config.splitting_ops=[] (one full graph) cannot run the MoE "
            "op eagerly, which the expert cache needs; leave splitting_ops unset or list the "
            f"attention ops together with {', '.join(MOE_OPS)}."
        )
    if cc.cudagraph_mode.has_full_cudagraphs():
        message = (
            f"rowcache ({settings.describe()}): cudagraph_mode {cc.cudagraph_mode.name} lowered "
            "to PIECEWISE: a full CUDA graph would freeze one step's expert plan; the MoE op "
            "now runs eagerly between captured pieces."
        )
        # vLLM builds its config more than once per engine; say it once.
        if message not in _said:
            _said.add(message)
            logger.warning(message)
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    ops = list(cc.splitting_ops or [])
    for op in MOE_OPS:
        if op not in ops:
            ops.append(op)
    cc.splitting_ops = ops


def _wrap_post_init(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def __post_init__(self: Any) -> None:
        settings = settings_of(self)  # a bad knob value stops vLLM here
        if settings.active:
            check_guards(self, settings)
        original(self)
        if settings.active:
            adjust_graphs(self, settings)
            logger.info("rowcache: %s", settings.describe())

    setattr(__post_init__, _WRAPPED, True)
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __post_init__


# -- the MoE method ---------------------------------------------------------------------------


def _host_loader(loader: Callable[..., Any], param: Tensor, host: Tensor) -> Callable[..., Any]:
    """Run vLLM's weight loader against the pinned host tensor instead of the device view.

    The parameter's data is a device view of pinned host memory (so that vLLM's loading code,
    which moves CPU parameters to the GPU for processing, leaves it alone); the checkpoint is
    copied host to host, without going through the device view.
    """

    def load(*args: Any, **kwargs: Any) -> Any:
        view = param.data
        param.data = host
        try:
            return loader(*args, **kwargs)
        finally:
            param.data = view

    return load


def _graph_rows(config: Any) -> int:
    cc = config.compilation_config
    if cc.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    return int(cc.max_cudagraph_capture_size or 0)


class RowcacheMoEMethod(UnquantizedFusedMoEMethod):  # type: ignore[misc]
    """vLLM's unquantized MoE method, with the expert cache when the knob turns it on.

    With the knob off it is vLLM's method unchanged (every override calls the parent).
    """

    def __init__(self, moe: Any) -> None:
        super().__init__(moe)
        config = get_current_vllm_config()
        settings = settings_of(config)
        self.rowcache_settings: CacheSettings | None = settings if settings.active else None
        self.rowcache_provider: ExpertWeightProvider | None = None
        self._host: tuple[Tensor, Tensor] | None = None
        self._stable: Tensor | None = None
        self._graph_rows = _graph_rows(config) if settings.active else 0
        self._capacity = 0
        self.rowcache_forwards = 0  # cached forwards; prepare_calls above it means chunks
        if settings.cache_on:
            self._capacity = self._check_layer(settings)

    def _check_layer(self, settings: CacheSettings) -> int:
        moe = self.moe
        top_k = int(moe.experts_per_token)
        experts = int(moe.num_local_experts)
        if settings.size < top_k:
            raise KnobError(
                f"{SIZE}={settings.size} is smaller than the model's top_k={top_k}: one token "
                f"needs {top_k} experts at once; allowed: 0 (off) or an integer >= {top_k}"
            )
        if moe.has_bias:
            raise RowcacheError(
                "rowcache: MoE layers with expert biases are not supported yet "
                f"({type(self).__name__})"
            )
        if self.unquantized_backend != UnquantizedMoeBackend.TRITON:
            raise RowcacheError(
                f"rowcache: the expert cache runs on vLLM's Triton MoE backend; this engine "
                f"selected {self.unquantized_backend.name}, which lays expert weights out "
                "differently and is not supported yet"
            )
        if settings.size > experts:
            logger.info(
                "rowcache: %s=%d is more than the %d experts of a layer; using %d slots",
                SIZE,
                settings.size,
                experts,
                experts,
            )
        return min(settings.size, experts)

    @property
    def _cache_on(self) -> bool:
        return self.rowcache_settings is not None and self.rowcache_settings.cache_on

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if not self._cache_on:
            super().create_weights(
                layer,
                num_experts,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                **extra_weight_attrs,
            )
            return
        up = intermediate_size_per_partition * (2 if self.moe.is_act_and_mul else 1)
        shapes = {
            "w13_weight": (num_experts, up, hidden_size),
            "w2_weight": (num_experts, hidden_size, intermediate_size_per_partition),
        }
        hosts: list[Tensor] = []
        for name, shape in shapes.items():
            # Pinned host memory from the start: the full expert set never touches the GPU.
            host = torch.empty(shape, dtype=params_dtype, device="cpu", pin_memory=True)
            param = torch.nn.Parameter(get_accelerator_view_from_cpu_tensor(host), False)
            layer.register_parameter(name, param)
            attrs = dict(extra_weight_attrs)
            if "weight_loader" in attrs:
                attrs["weight_loader"] = _host_loader(attrs["weight_loader"], param, host)
            set_weight_attrs(param, attrs)
            hosts.append(host)
        self._host = (hosts[0], hosts[1])

    def process_weights_after_loading(self, layer: Any) -> None:
        super().process_weights_after_loading(layer)
        if not self._cache_on:
            return
        assert self._host is not None and self.rowcache_settings is not None
        w13, w2 = self._host
        settings = self.rowcache_settings
        # The layer's device: where vLLM allocated the rest of the model.
        device = torch.device("cuda", torch.cuda.current_device())
        provider: ExpertWeightProvider
        if settings.provider == "cached":
            provider = CachedWeightProvider(
                w13, w2, capacity=self._capacity, split=settings.split, device=device
            )
        else:
            provider = RowCacheWeightProvider(
                w13, w2, capacity=self._capacity, split=settings.split, device=device
            )
        self.rowcache_provider = provider

    def _stable_output(self, out: Tensor) -> Tensor:
        """``out`` at an address that stays the same for every call with as many rows."""
        rows = out.shape[0]
        if rows == 0 or rows > self._graph_rows or out.dim() != 2:
            return out
        stable = self._stable
        if stable is None or stable.dtype != out.dtype or stable.shape[1] != out.shape[1]:
            stable = out.new_empty((self._graph_rows, out.shape[1]))
            self._stable = stable
        view = stable[:rows]
        view.copy_(out)
        return view

    def apply(
        self,
        layer: Any,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        if self.rowcache_settings is None:
            out: Tensor = super().apply(
                layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
            )
            return out
        provider = self.rowcache_provider
        if provider is None:
            out = super().apply(
                layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
            )
            return self._stable_output(out)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RowcacheError(
                "rowcache: the MoE op is being captured into a CUDA graph, which would freeze "
                f"one step's expert plan; {', '.join(MOE_OPS)} must be splitting ops "
                "(the plugin sets this up unless its config hook was bypassed)"
            )
        kernel = self.moe_kernel
        assert kernel is not None
        self.rowcache_forwards += 1
        pending_shared = [shared_experts]

        def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
            # vLLM's shared-expert object computes all rows at once: hand it to the first
            # kernel call only, so shared experts run once per forward.
            shared = pending_shared.pop() if include_shared and pending_shared else None
            result: Tensor = kernel.apply(
                hidden_states=x[rows],
                w1=weights.w1,
                w2=weights.w2,
                topk_weights=topk_weights[rows],
                topk_ids=topk_ids[rows],
                activation=layer.activation,
                global_num_experts=layer.global_num_experts,
                expert_map=weights.expert_map,
                apply_router_weight_on_input=layer.apply_router_weight_on_input,
                shared_experts=shared,
                shared_experts_input=shared_experts_input if shared is not None else None,
            )
            return result

        # Plan on a host copy: one device-to-host transfer per forward, where planning and
        # validation on the device tensor would each synchronize with the GPU.
        host_ids = topk_ids.cpu()
        return self._stable_output(run_with_expert_cache(provider, host_ids, run))


def install() -> bool:
    """Substitute the MoE method and hook the config; False when already installed."""
    name = UnquantizedFusedMoEMethod.__name__
    present = op_registry_oot.get(name)
    hooked = getattr(VllmConfig.__post_init__, _WRAPPED, False)
    if present is RowcacheMoEMethod and hooked:
        return False
    if present is not None and present is not RowcacheMoEMethod:
        raise RowcacheError(
            f"another plugin already substitutes {name} ({present.__module__}."
            f"{present.__qualname__}); rowcache would replace it"
        )
    if not hooked:
        VllmConfig.__post_init__ = _wrap_post_init(VllmConfig.__post_init__)
    if present is None:
        CustomOp.register_oot(RowcacheMoEMethod, name=name)
    return True

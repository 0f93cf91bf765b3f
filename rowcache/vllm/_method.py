"""The substituted MoE method: imported only once vLLM's fused-MoE package has been imported.

``RowcacheMoEMethod`` subclasses vLLM's ``UnquantizedFusedMoEMethod``, so importing this module
imports vLLM's fused-MoE modules (seconds in a fresh process). ``rowcache.vllm.register``
therefore does not import it: it runs ``install`` from a post-import hook on the package
``vllm.model_executor.layers.fused_moe`` (``rowcache.vllm._post_import``), or at once where
the package is already imported, or when a configuration turns the knob on
(``rowcache.vllm._config``). Every MoE method is built after that package has executed, so the
substitution is always in place before the first one is.

``CustomOp.register_oot`` puts ``RowcacheMoEMethod`` wherever vLLM builds the unquantized MoE
method: with the cache on it allocates the expert weights in pinned host memory, builds the
provider once the weights are processed, and routes ``apply`` through
``run_with_expert_cache``; with the knob off every override calls the parent.

Why piecewise graphs gave wrong tokens with the MoE op as a splitting op (vLLM 0.25.0): a
captured piece reads its inputs from the addresses they had at capture time
(``CUDAGraphWrapper`` replays without copying inputs), while the eager MoE op returns a tensor
freshly allocated by the modular kernel (``torch.empty_like(hidden_states)``) on every call. The
piece after the op therefore reads whatever now lives at the capture-time address. Attention
avoids this by writing into an output buffer allocated inside the previous piece. Here each
layer instead copies its result into a buffer it owns (one row per captured batch size), so the
next piece always finds it at the captured address.

Exact steps. A step cut into several kernel calls by experts (every multi-pass step of the
device planner; the host planner's ``"expert"`` split) goes through
``run_unreduced_with_expert_cache``, so its output has the bits of one call with every expert
resident. vLLM 0.25.0's ``TritonExperts.apply`` (``fused_moe/experts/triton_moe.py``) writes
each token's weighted per-entry outputs into ``intermediate_cache3`` (``[M, top_k, H]``, a view
of ``workspace2``, the first GEMM's output too) and reduces it once with
``self.moe_sum(intermediate_cache3, output)``, for bf16 and FP8 experts alike. ``_MoeSumTap`` is
installed as the instance attribute ``moe_sum`` of the layer kernel's ``TritonExperts``
(``FusedMoEKernel.fused_experts``): outside a cut step it calls vLLM's ``moe_sum``; during each
call of a cut step it hands the unreduced ``intermediate_cache3`` to the library instead of
reducing it, and the library, after merging every call's exposed entries into its step buffer,
reduces that buffer once with vLLM's own ``moe_sum``. The kernel's reduced output of those
calls is not used.

``CachedForward`` holds that forward and what goes with it (the capture-stable output, the
one warning of the float32 fallback); ``RowcacheMoEMethod`` and the FP8 methods of
``rowcache.vllm._fp8`` put it in front of vLLM's method class. Quantized models:
``rowcache.vllm._quantized``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor
from vllm.config.compilation import CUDAGraphMode
from vllm.config.vllm import get_current_vllm_config
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe import override_config
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

from rowcache.cached import CachedWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.forward import run_unreduced_with_expert_cache, run_with_expert_cache
from rowcache.pinned import (
    collect_transient,
    pinned_empty_exact,
    pinned_empty_transient,
    pinned_memory,
    pinning_seconds,
    timed_pinning,
)
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.torch_seams import HOST_EMPTY_CACHE, lookup
from rowcache.types import ExpertWeightProvider, ExpertWeightResult
from rowcache.vllm._config import MOE_OPS, RowcacheError, settings_of
from rowcache.vllm.knob import SIZE, CacheSettings, KnobError
from rowcache.vllm.memory_line import note_layer, take_line
from rowcache.vllm.reduction_tap import UnreducedTap

__all__ = [
    "SUPPORTED_METHODS",
    "CachedForward",
    "HostLoad",
    "RowcacheMoEMethod",
    "build_provider",
    "check_layer",
    "device_view",
    "drop_replaced",
    "forget_host_loaders",
    "install",
    "pinned_empty",
    "register_host_parameter",
    "release_host_cache",
    "release_host_weights",
    "to_pinned",
]

logger = logging.getLogger("rowcache.vllm")

SUPPORTED_METHODS = (
    "UnquantizedFusedMoEMethod (bf16/fp16 experts) on vLLM's Triton MoE backend, and on vLLM's "
    "TRITON FP8 MoE backend (TritonExperts): Fp8MoEMethod with 128 x 128 block scales (an FP8 "
    "checkpoint with weight_block_size [128, 128]) and Fp8PerTensorOnlineMoEMethod (online "
    "per-tensor FP8 of a bf16 checkpoint), and gpt-oss's GptOssMxfp4MoEMethod on vLLM's "
    "TRITON_UNFUSED MXFP4 MoE backend (UnfusedOAITritonExperts; --moe-backend triton_unfused)"
)
"""What the expert cache serves, as the guards name it."""


# -- the MoE method ---------------------------------------------------------------------------


class HostLoad:
    """vLLM's weight loader, run against a pinned host tensor instead of the device view.

    The parameter's data is a device view of pinned host memory (so that vLLM's loading code,
    which moves CPU parameters to the GPU for processing, leaves it alone); the checkpoint is
    copied host to host, without going through the device view.

    vLLM keeps a copy of every parameter's attributes, this loader among them, for as long as
    the model lives (its layerwise reload metadata, recorded right after ``create_weights``):
    a loader that held the tensor for good would keep it pinned after the cache has released
    it (on the H200, 12.9 GB of the 22.57 GB a 9.7 GB model pinned beside its planes, by the
    tensors' sizes).
    ``forget`` drops the tensor and the parameter once the cache no longer needs them; a load
    after that is refused.
    """

    def __init__(self, loader: Callable[..., Any], param: Tensor, host: Tensor) -> None:
        self._loader = loader
        self._param: Tensor | None = param
        self._host: Tensor | None = host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        param, host = self._param, self._host
        if param is None or host is None:
            raise RowcacheError(
                "rowcache: this layer's pinned checkpoint tensors were released once the "
                "expert cache held its experts in its own form (bf16 planes, or MXFP4 rows "
                "as vLLM's kernel reads them); reloading weights into this engine is not "
                "supported: start a new engine"
            )
        view = param.data
        param.data = host
        try:
            return self._loader(*args, **kwargs)
        finally:
            param.data = view

    @property
    def registered(self) -> Tensor | None:
        """The parameter this loader was registered with (None once forgotten)."""
        return self._param

    def forget(self) -> None:
        """Drop the host tensor and its parameter (the cache holds the experts otherwise)."""
        self._param = self._host = None


def drop_replaced(layer: Any, params: Iterable[tuple[str, Tensor]]) -> None:
    """Empty the data of each ``(name, parameter)`` that is no longer ``layer``'s ``name``
    (replaced), and of the parameter its host loader was registered with where vLLM replaced
    that one before (``HostLoad.registered``); forget the loader.

    A replaced parameter may outlive its replacement: vLLM 0.25.0 processes a layer's weights
    inside ``device_loading_context``, a generator whose loop variable still holds the layer's
    last parameter until the layer is done: the one ``register_host_parameter`` made, which
    vLLM's own ``process_weights_after_loading`` has by then replaced (``replace_parameter``:
    a new parameter over the same data). Its data, our device view, would hold the view's host
    memory (a transient slab) past ``release_host_cache``, and the last layer's for the
    engine's life (2 GiB on the H200, 2026-12-05). A parameter still the layer's is left as
    it is."""
    for name, param in params:
        loader = getattr(param, "weight_loader", None)
        first = loader.registered if isinstance(loader, HostLoad) else None
        forget_host_loaders([param])
        for each in (param, first):
            if each is not None and getattr(layer, name, None) is not each:
                each.data = each.data.new_empty(0)


def forget_host_loaders(params: Iterable[Any]) -> None:
    """``HostLoad.forget`` on the loaders of ``params`` (any other loader left alone)."""
    for param in params:
        loader = getattr(param, "weight_loader", None)
        if isinstance(loader, HostLoad):
            loader.forget()


def device_view(host: Tensor) -> Tensor:
    """A device view of the pinned ``host`` tensor through unified addressing (vLLM's
    ``get_accelerator_view_from_cpu_tensor``). A tensor that is a piece of a larger allocation
    (an arena's slab, ``rowcache.pinned``) is cut from the view of its whole storage, so that
    the driver is asked for the device address of an allocation's start, not of a pointer
    inside it; that view holds the storage for as long as the piece lives."""
    if torch.cuda.is_available() and host.numel() and not host.is_pinned():
        # vLLM's op copies a tensor that is not pinned: the loader's writes would never reach
        # the view. (An empty tensor has no memory to pin, nor to miss.)
        raise RowcacheError(
            f"rowcache: a device view of host memory needs pinned memory; got a tensor of "
            f"shape {tuple(host.shape)} that is not pinned"
        )
    storage = host.untyped_storage()
    whole_tensor = host.data_ptr() == storage.data_ptr() and host.nbytes == storage.nbytes()
    if whole_tensor or not host.is_contiguous():
        view: Tensor = get_accelerator_view_from_cpu_tensor(host)
        return view
    flat = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
    whole: Tensor = get_accelerator_view_from_cpu_tensor(flat)
    offset = host.data_ptr() - storage.data_ptr()
    return whole[offset : offset + host.nbytes].view(host.dtype).view(host.shape)


def register_host_parameter(layer: Any, name: str, host: Tensor, attrs: dict[str, Any]) -> None:
    """Register ``name`` on ``layer`` as a device view of the pinned ``host`` tensor
    (``device_view``), with vLLM's parameter attributes ``attrs`` (its ``weight_loader``, if
    any, writing ``host``: ``HostLoad``)."""
    param = torch.nn.Parameter(device_view(host), False)
    attrs = dict(attrs)
    if "weight_loader" in attrs:
        attrs["weight_loader"] = HostLoad(attrs["weight_loader"], param, host)
    layer.register_parameter(name, param)
    set_weight_attrs(param, attrs)


def release_host_weights(layer: Any) -> None:
    """Free the layer's pinned ``w13_weight`` and ``w2_weight`` once a provider holds them as
    bf16 planes (every bit of them: decode(encode(x)) == x), which would otherwise take host
    memory beside the planes. The parameters keep their shapes and dtypes on the meta device,
    so that anything still reading them fails loudly instead of reading freed memory, and
    their weight loaders refuse a reload with a line saying why."""
    for name in ("w13_weight", "w2_weight"):
        param = getattr(layer, name)
        # A new parameter: a tensor's data cannot move to the meta device in place.
        released = torch.nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
        )
        attrs = {k: v for k, v in vars(param).items() if k != "weight_loader"}
        layer.register_parameter(name, released)
        set_weight_attrs(released, {**attrs, "weight_loader": _refuse_reload})
        drop_replaced(layer, [(name, param)])


def release_host_cache() -> None:
    """Give the pinned blocks nothing holds any longer back to the driver. torch's caching host
    allocator keeps a freed block for reuse by a later request of its size class, so the
    process would stay pinned at its peak (``torch.cuda.host_memory_stats``' allocated
    bytes) after the cache released a layer's checkpoint tensors. Its host time counts as
    pinning (``rowcache.pinned.timed_pinning``): the driver unlocks every page."""
    with timed_pinning():
        collect_transient()  # the released layers' slabs back to torch first
        if not torch.cuda.is_available():
            return
        empty = lookup(HOST_EMPTY_CACHE)
        if empty is not None:
            empty()


def _refuse_reload(*args: Any, **kwargs: Any) -> None:
    raise RowcacheError(
        "rowcache: this layer's experts are held as bf16 planes "
        "(moe_expert_cache_compress='on') and its w13_weight and w2_weight were released; "
        "reloading weights into it is not supported: start a new engine"
    )


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, *, lasting: bool) -> Tensor:
    """Host memory for expert tensors: pinned where there is a GPU (CPU tests: plain).
    ``lasting``: it lives as long as the model, and is carved from the process's arena of
    pinned slabs (``rowcache.pinned``: the bytes asked, where torch's own pinned allocator
    rounds every request up to a power of two); else a view of a slab of the transient arena,
    freed with its slab (a layer's checkpoint tensors that the cache releases once it holds the
    experts in its own form; ``release_host_cache`` lets go of the slabs whose tensors are all
    released)."""
    if not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, device="cpu")
    if lasting:
        return pinned_empty_exact(shape, dtype)
    return pinned_empty_transient(shape, dtype)


def check_layer(moe: Any, settings: CacheSettings, method: str, biases: bool = False) -> int:
    """The layer's slot count after the guards every cached MoE method shares (``biases``:
    the method serves per-expert biases from slots)."""
    top_k = int(moe.experts_per_token)
    experts = int(moe.num_local_experts)
    if settings.size < top_k:
        raise KnobError(
            f"{SIZE}={settings.size} is smaller than the model's top_k={top_k}: one token "
            f"needs {top_k} experts at once; allowed: 0 (off) or an integer >= {top_k}"
        )
    if moe.has_bias and not biases:
        raise RowcacheError(
            f"rowcache: MoE layers with expert biases are not supported yet ({method})"
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


def to_pinned(
    layer: Any, names: tuple[str, ...], keep_values: set[str], *, lasting: bool
) -> dict[str, Tensor]:
    """Replace the layer's parameters ``names`` with device views of pinned host copies.

    Each keeps the attributes vLLM gave it (``weight_loader`` writing the host tensor); the
    values are copied for ``keep_values`` only (vLLM's weights start as ``torch.empty``).
    """
    hosts: dict[str, Tensor] = {}
    for name in names:
        old = getattr(layer, name)
        host = pinned_empty(tuple(old.shape), old.dtype, lasting=lasting)
        if name in keep_values:
            host.copy_(old.data)
        register_host_parameter(layer, name, host, vars(old))
        hosts[name] = host
    return hosts


def layer_device() -> torch.device:
    """Where vLLM allocated the rest of the model: the current GPU (the CPU without one)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_provider(
    settings: CacheSettings,
    capacity: int,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
    *,
    w13_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
) -> ExpertWeightProvider:
    """The provider over a layer's pinned host tensors, in the default (separate) slot layout.

    ``share_sources``: the pinned host tensors live on as the layer's parameters; a copy would
    hold every MoE weight twice in pinned memory.
    """
    pinned_before, start = pinning_seconds(), time.perf_counter()
    provider = _build_provider(
        settings, capacity, w13, w2, w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias
    )
    # Host time, pinning apart (the line counts that once, for the whole engine).
    building = time.perf_counter() - start - (pinning_seconds() - pinned_before)
    note_layer(provider.stats(), num_experts=w13.shape[0], build_seconds=building)
    return provider


def _build_provider(
    settings: CacheSettings,
    capacity: int,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    *,
    w13_bias: Tensor | None,
    w2_bias: Tensor | None,
) -> ExpertWeightProvider:
    device = layer_device()
    if settings.provider == "cached":
        return CachedWeightProvider(
            w13,
            w2,
            w13_scale,
            w2_scale,
            capacity=capacity,
            split=settings.split,
            device=device,
            share_sources=True,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
        )
    if settings.planner == "device":
        # Planned and copied on the device: the MoE op is captured with the forward.
        provider = RowCacheWeightProvider(
            w13,
            w2,
            w13_scale,
            w2_scale,
            capacity=capacity,
            device=device,
            share_sources=True,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            compress=settings.compress_planes,
            planner="device",
            policy=settings.policy,
        )
        if settings.compress_planes and device.type == "cuda":
            # The planes were encoded on the GPU; hand the encode's temporaries back to the
            # driver, or vLLM's start-up profile counts them as memory the model holds.
            torch.cuda.empty_cache()
        return provider
    provider = RowCacheWeightProvider(
        w13,
        w2,
        w13_scale,
        w2_scale,
        capacity=capacity,
        split=settings.split,
        device=device,
        share_sources=True,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        compress=settings.compress_planes,
        policy=settings.policy,
    )
    if settings.compress_planes and device.type == "cuda":
        torch.cuda.empty_cache()  # as for the device planner: the encode's temporaries
    return provider


class ReductionTap(Protocol):
    """A hook on a kernel's reduction: ``unreduced(call)`` runs one kernel call and returns
    the ``[M, top_k, H]`` entries it would have reduced."""

    def unreduced(self, call: Callable[[], object]) -> Tensor: ...


class _MoeSumTap(UnreducedTap):
    """Stands in for ``moe_sum`` on one ``TritonExperts`` instance.

    An instance attribute: ``self.moe_sum(...)`` in ``TritonExperts.apply`` finds it before the
    class's method, so only this layer's kernel object changes, and vLLM's ``moe_sum`` (bound
    to the instance, taken before the swap) stays the one reduction. Outside ``unreduced`` every
    call goes to vLLM's ``moe_sum`` with its arguments unchanged.
    """

    reduction = "vLLM's TritonExperts.moe_sum"

    def __init__(self, experts: Any) -> None:
        super().__init__()
        self.moe_sum: Callable[..., None] = experts.moe_sum
        experts.moe_sum = self

    def __call__(self, input: Tensor, output: Tensor, *args: Any, **kwargs: Any) -> None:
        if not self._took(input):
            self.moe_sum(input, output, *args, **kwargs)

    def reduce(self, unreduced: Tensor, output: Tensor) -> None:
        """vLLM's ``moe_sum`` over a step's merged entries (every entry of the buffer counts:
        those no call exposed are +0)."""
        self.moe_sum(unreduced, output)


def _moe_sum_tap(kernel: Any) -> _MoeSumTap | None:
    """The tap on ``kernel``'s ``TritonExperts`` (installed on first use); None when the
    kernel's experts are not vLLM's ``TritonExperts``."""
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, TritonExperts):
        return None
    tap = vars(experts).get("moe_sum")
    return tap if isinstance(tap, _MoeSumTap) else _MoeSumTap(experts)


def _graph_rows(config: Any) -> int:
    cc = config.compilation_config
    if cc.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    return int(cc.max_cudagraph_capture_size or 0)


def full_set_config(
    kernel: Any, layer: Any, x: Tensor, topk_ids: Tensor, weights: ExpertWeightResult
) -> dict[str, Any] | None:
    """The tile configuration vLLM's Triton experts choose for this forward with every expert
    resident: ``try_get_optimal_moe_config`` over the whole layer's weight shapes (the global
    expert count, not the slot count) and the forward's rows (not a chunk's). vLLM looks the
    configuration up by expert count and rows (a tuned file for E=128 on the H200, defaults
    for a slot count it has none for), and the tiles fix each output's summation order, so a
    kernel call over the slots with its own choice rounds differently from the call without
    the cache. Every kernel call of a cached forward runs under this configuration
    (``override_config``, vLLM's own override). None where the kernel's experts are not
    ``TritonExperts`` (their configuration is not vLLM's lookup)."""
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, TritonExperts):
        return None
    experts_total = int(layer.global_num_experts)
    config: dict[str, Any] = try_get_optimal_moe_config(
        (experts_total, *weights.w1.shape[1:]),
        (experts_total, *weights.w2.shape[1:]),
        int(topk_ids.shape[1]),
        experts.quant_config.config_name(x.dtype),
        int(x.shape[0]),
        block_shape=experts.block_shape,
    )
    return config


class CachedForward:
    """What every cached MoE method shares: the forward through the provider.

    A mixin in front of vLLM's method class; the class sets ``rowcache_settings`` (None with
    the knob off), ``rowcache_provider`` (None until the weights are processed), and has vLLM's
    ``moe_kernel``.
    """

    rowcache_settings: CacheSettings | None
    rowcache_provider: ExpertWeightProvider | None
    rowcache_forwards: int
    moe_kernel: Any
    _stable: Tensor | None
    _graph_rows: int
    _inexact_said: bool

    def _init_cache_state(self, settings: CacheSettings, config: Any) -> None:
        self.rowcache_settings = settings if settings.active else None
        self.rowcache_provider = None
        self._stable = None
        self._graph_rows = _graph_rows(config) if settings.active else 0
        self.rowcache_forwards = 0  # cached forwards; prepare_calls above it means chunks
        self._inexact_said = False

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
        """The forward through the cache once its provider is built; vLLM's own before (a
        method that needs more overrides this)."""
        provider = self.rowcache_provider
        if provider is None:
            base: Any = super()
            out: Tensor = base.apply(
                layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
            )
            return out
        return self._cached_apply(
            provider, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )

    def _cached_apply(
        self,
        provider: ExpertWeightProvider,
        layer: Any,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        """The layer's forward over the provider's slots (module docstring)."""
        self._forward_starts(layer, topk_ids)
        device_planned = isinstance(provider, DevicePlannedProvider)
        if not device_planned and x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RowcacheError(
                "rowcache: the MoE op is being captured into a CUDA graph, which would freeze "
                f"one step's expert plan; {', '.join(MOE_OPS)} must be splitting ops "
                "(the plugin sets this up unless its config hook was bypassed)"
            )
        kernel = self.moe_kernel
        assert kernel is not None
        if self.rowcache_forwards == 0:
            # A layer's first forward: every layer is built by then (vLLM's profile run).
            settings = self.rowcache_settings
            left = int(pinned_memory()["transient_bytes"] or 0)
            if left and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                # What died after the last layer's release (anything vLLM's loading code
                # still held then) goes back now; what is left is held: a leak.
                release_host_cache()
                left = int(pinned_memory()["transient_bytes"] or 0)
            line = take_line(
                settings is not None and settings.compress_planes, left, pinning_seconds()
            )
            if line is not None:
                (logger.warning if left else logger.info)(line)
        self.rowcache_forwards += 1
        pending_shared = [shared_experts]
        every_row = slice(0, topk_ids.shape[0])
        pinned: list[dict[str, Any] | None] = []

        def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
            # vLLM's shared-expert object computes all rows at once: hand it to the first
            # kernel call only, so shared experts run once per forward.
            shared = pending_shared.pop() if include_shared and pending_shared else None
            # A forward that fits (every decode step with enough slots) covers every row:
            # pass vLLM's tensors as they are, as its own apply does, instead of three views
            # whose slicing dispatches cost host time on every layer.
            whole = rows == every_row
            if not pinned:
                pinned.append(full_set_config(kernel, layer, x, topk_ids, weights))
            w1, w2 = self._kernel_weights(weights)
            with override_config(pinned[0]):
                result: Tensor = kernel.apply(
                    hidden_states=x if whole else x[rows],
                    w1=w1,
                    w2=w2,
                    topk_weights=topk_weights if whole else topk_weights[rows],
                    topk_ids=topk_ids if whole else topk_ids[rows],
                    activation=layer.activation,
                    global_num_experts=layer.global_num_experts,
                    expert_map=weights.expert_map,
                    apply_router_weight_on_input=layer.apply_router_weight_on_input,
                    shared_experts=shared,
                    shared_experts_input=shared_experts_input if shared is not None else None,
                )
            return result

        # A step cut by experts is exact through the unreduced route (module docstring); a
        # token split keeps each row in one call and is exact as it is.
        tap = self._reduction_tap(kernel) if device_planned or provider.split == "expert" else None
        if tap is None and (device_planned or provider.split == "expert"):
            self._say_inexact(kernel)

        def forward(ids: Tensor) -> Tensor:
            if tap is None:
                return run_with_expert_cache(provider, ids, run)
            taker = tap

            def run_unreduced(weights: ExpertWeightResult, rows: slice, shared: bool) -> Tensor:
                return taker.unreduced(lambda: run(weights, rows, shared))

            reduce = self._step_reduction(taker, topk_ids)
            return run_unreduced_with_expert_cache(provider, ids, run_unreduced, reduce)

        if device_planned:
            # The router's tensor as it is: the passes are fixed by its shape and planned on
            # the device, so the whole op is captured with the forward (no stable output: the
            # MoE op is no splitting op then).
            return forward(topk_ids)
        # Plan on a host copy: one device-to-host transfer per forward, where planning and
        # validation on the device tensor would each synchronize with the GPU.
        host_ids = topk_ids.cpu()
        return self._stable_output(forward(host_ids))

    def _forward_starts(self, layer: Any, topk_ids: Tensor) -> None:
        """Called once per cached forward, before its kernel calls (nothing by default)."""

    def _kernel_weights(self, weights: ExpertWeightResult) -> tuple[Any, Any]:
        """What the kernel takes as ``w1`` and ``w2``: the provider's slot buffers (a method
        whose kernel wants them wrapped overrides this)."""
        return weights.w1, weights.w2

    def _reduction_tap(self, kernel: Any) -> ReductionTap | None:
        """The hook on the kernel's reduction that the exact route of a cut step takes its
        unreduced entries from (``unreduced(call)``), or None where there is none."""
        return _moe_sum_tap(kernel)

    def _step_reduction(
        self, tap: ReductionTap, topk_ids: Tensor
    ) -> Callable[[Tensor, Tensor], None]:
        """The one reduction of a cut step's merged entries (``topk_ids``: the router's)."""
        assert isinstance(tap, _MoeSumTap)
        return tap.reduce

    def _say_inexact(self, kernel: Any) -> None:
        if self._inexact_said:
            return
        self._inexact_said = True
        experts = getattr(kernel, "fused_experts", None)
        logger.warning(
            "rowcache: the MoE kernel's experts are %s, not vLLM's TritonExperts: steps cut "
            "by experts sum their kernel calls' outputs in float32, whose last bits differ "
            "from one call with every expert resident",
            type(experts).__name__,
        )


class RowcacheMoEMethod(CachedForward, UnquantizedFusedMoEMethod):  # type: ignore[misc]
    """vLLM's unquantized MoE method, with the expert cache when the knob turns it on.

    With the knob off it is vLLM's method unchanged (every override calls the parent).
    """

    def __init__(self, moe: Any) -> None:
        super().__init__(moe)
        config = get_current_vllm_config()
        settings = settings_of(config)
        self._init_cache_state(settings, config)
        self._host: tuple[Tensor, Tensor] | None = None
        self._capacity = 0
        if settings.cache_on:
            self._capacity = self._check_layer(settings)

    def _check_layer(self, settings: CacheSettings) -> int:
        capacity = check_layer(self.moe, settings, type(self).__name__)
        if self.unquantized_backend != UnquantizedMoeBackend.TRITON:
            raise RowcacheError(
                f"rowcache: the expert cache runs on vLLM's Triton MoE backend; this engine "
                f"selected {self.unquantized_backend.name}, which lays expert weights out "
                "differently and is not supported yet"
            )
        return capacity

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
        settings = self.rowcache_settings
        assert settings is not None
        up = intermediate_size_per_partition * (2 if self.moe.is_act_and_mul else 1)
        shapes = {
            "w13_weight": (num_experts, up, hidden_size),
            "w2_weight": (num_experts, hidden_size, intermediate_size_per_partition),
        }
        hosts: list[Tensor] = []
        for name, shape in shapes.items():
            # Pinned host memory from the start: the full expert set never touches the GPU.
            # Lasting unless the planes will hold the experts (then these are released).
            host = pinned_empty(shape, params_dtype, lasting=not settings.compress_planes)
            register_host_parameter(layer, name, host, extra_weight_attrs)
            hosts.append(host)
        self._host = (hosts[0], hosts[1])

    def process_weights_after_loading(self, layer: Any) -> None:
        super().process_weights_after_loading(layer)
        if not self._cache_on:
            return
        assert self._host is not None and self.rowcache_settings is not None
        # No name here for the host tensors: with planes, release_host_cache must find them
        # dead, or their transient slab outlives the layer (the last layer's, the engine).
        self.rowcache_provider = build_provider(self.rowcache_settings, self._capacity, *self._host)
        if self.rowcache_settings.compress_planes:
            release_host_weights(layer)
            self._host = None
            release_host_cache()

    def apply(
        self,
        layer: Any,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        # The cache's forward, or vLLM's where no provider serves (CachedForward.apply); the
        # eager MoE baseline (settings, no cache) gives its output a stable address too.
        out: Tensor = super().apply(
            layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )
        if self.rowcache_settings is not None and self.rowcache_provider is None:
            return self._stable_output(out)
        return out


def install() -> bool:
    """Substitute the MoE method; False when it is already substituted.

    Raises when another plugin substitutes the same class: replacing it would silently
    disable that plugin.
    """
    name = UnquantizedFusedMoEMethod.__name__
    present = op_registry_oot.get(name)
    if present is RowcacheMoEMethod:
        return False
    if present is not None:
        raise RowcacheError(
            f"another plugin already substitutes {name} ({present.__module__}."
            f"{present.__qualname__}); rowcache would replace it"
        )
    CustomOp.register_oot(RowcacheMoEMethod, name=name)
    return True

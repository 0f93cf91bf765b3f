"""The config hook: cheap enough to install in every vLLM process at plugin-load time.

It imports only ``vllm.config`` (which vLLM has imported before it loads plugins) and wraps
``VllmConfig.__post_init__``: before vLLM's own checks the knob is parsed (bad values stop the
engine here) and the guards run (expert or data parallelism, LoRA, a quantized model); after
them the MoE ops become splitting ops and full CUDA graphs are lowered to piecewise ones,
because a host-planned cache must run between captured pieces. With the device planner
(``moe_expert_cache_planner=device``) the graph modes stay as the user set them.

A configuration is adjusted only once the MoE method substitution is known to be installed
(``method_ready``, given by ``rowcache.vllm``): an engine whose MoE op is split out of the
graphs but runs vLLM's own method gives wrong tokens (see ``rowcache.vllm._method``), so when
the substitution cannot be installed the knob is ignored and the configuration stays vLLM's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.config.vllm import VllmConfig

from rowcache.vllm.knob import SIZE, CacheSettings, parse_settings

__all__ = ["MOE_OPS", "RowcacheError", "install", "settings_of"]

logger = logging.getLogger("rowcache.vllm")

MOE_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
"""vLLM's MoE custom ops; as splitting ops they run eagerly between captured pieces."""

_WRAPPED = "_rowcache_wrapped"
_said: set[str] = set()


class RowcacheError(RuntimeError):
    """A configuration the expert cache cannot serve, found while vLLM starts."""


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
    tensor_parallel = getattr(parallel, "tensor_parallel_size", 1)
    if tensor_parallel > 1:
        raise RowcacheError(
            f"rowcache: {what} is not shown to work with tensor parallelism yet "
            f"(tensor_parallel_size={tensor_parallel}); run one rank with the cache, or turn "
            "the cache off (size 0)."
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
    """Make the MoE op run eagerly between captured pieces, lowering full graphs; nothing for
    the device planner, whose MoE op is captured with the rest of the forward."""
    if settings.cache_on and settings.planner == "device":
        return
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


def _wrap_post_init(
    original: Callable[[Any], None], method_ready: Callable[[], bool]
) -> Callable[[Any], None]:
    def __post_init__(self: Any) -> None:
        settings = settings_of(self)  # a bad knob value stops vLLM here
        # method_ready may import vLLM's fused-MoE package (only for an engine that turns the
        # knob on, which builds a MoE model anyway); False: the warning is already logged.
        if not settings.active or not method_ready():
            original(self)
            return
        check_guards(self, settings)
        original(self)
        adjust_graphs(self, settings)
        logger.info("rowcache: %s", settings.describe())

    setattr(__post_init__, _WRAPPED, True)
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __post_init__


def install(method_ready: Callable[[], bool]) -> bool:
    """Wrap ``VllmConfig.__post_init__``; False when it is already wrapped."""
    if getattr(VllmConfig.__post_init__, _WRAPPED, False):
        return False
    VllmConfig.__post_init__ = _wrap_post_init(VllmConfig.__post_init__, method_ready)
    return True

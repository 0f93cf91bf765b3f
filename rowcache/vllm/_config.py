"""The config hook: cheap enough to install in every vLLM process at plugin-load time.

It imports only ``vllm.config`` (which vLLM has imported before it loads plugins) and wraps
``VllmConfig.__post_init__``: before vLLM's own checks the knob is parsed (bad values stop the
engine here) and the guards run (expert or data parallelism, LoRA, a quantization whose MoE
method the cache does not serve); after
them the MoE ops become splitting ops and full CUDA graphs are lowered to piecewise ones,
because a host-planned cache must run between captured pieces. With the device planner
(``moe_expert_cache_planner=device``) the graph modes stay as the user set them.

A configuration is adjusted only once the MoE method substitution is known to be installed
(``method_ready``, given by ``rowcache.vllm``): an engine whose MoE op is split out of the
graphs but runs vLLM's own method gives wrong tokens (see ``rowcache.vllm._method``), so when
the substitution cannot be installed the knob is ignored and the configuration stays vLLM's.

Without a planner setting the planner is chosen after vLLM's own checks, from the graph mode
they resolved (``rowcache.vllm.defaults``), then ``moe_expert_cache_compress: auto`` for that
planner and the model's dtype and quantization, and the host planner's split; each choice is
written back into ``additional_config`` so that the engine's other processes and later copies
of the configuration serve the same one. The
choice and the settings are logged once per process. The plugin's logger (``rowcache.vllm``)
writes through the handlers vLLM configures on its own ``vllm`` logger, so its INFO lines reach
the server's log as vLLM's do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.config.vllm import VllmConfig

from rowcache.vllm.defaults import GraphMode, choose_planner
from rowcache.vllm.knob import (
    COMPRESS_CHOSEN,
    CONFIG_SECTION,
    PLANNER_CHOSEN,
    SIZE,
    SPLIT_CHOSEN,
    CacheSettings,
    chosen_record,
    compress_record,
    parse_settings,
    split_record,
)

__all__ = ["MOE_OPS", "QUANTIZATIONS", "RowcacheError", "graph_mode", "install", "settings_of"]

logger = logging.getLogger("rowcache.vllm")

QUANTIZATIONS = ("fp8", "fp8_per_tensor", "gpt_oss_mxfp4")
"""Model quantizations whose MoE methods the cache may serve: ``fp8`` (vLLM 0.25.0: FP8
checkpoints and online per-tensor FP8; 0.33.0: FP8 checkpoints) and ``fp8_per_tensor`` (online
per-tensor FP8: a shorthand in 0.25.0, the only way in 0.33.0), and ``gpt_oss_mxfp4`` (gpt-oss's
MXFP4 checkpoints). Which method and backend a layer gets is checked when it is built
(``rowcache.vllm._fp8.adopt``, ``rowcache.vllm._mxfp4.adopt``)."""

MOE_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
"""vLLM's MoE custom ops; as splitting ops they run eagerly between captured pieces."""

_WRAPPED = "_rowcache_wrapped"
_said: set[str] = set()


class RowcacheError(RuntimeError):
    """A configuration the expert cache cannot serve, found while vLLM starts."""


def graph_mode(config: Any) -> GraphMode:
    """vLLM's resolved CUDA graph mode in the terms of ``rowcache.vllm.defaults``."""
    mode = config.compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return "eager"
    return "full" if mode.has_full_cudagraphs() else "piecewise"


def settings_of(config: Any) -> CacheSettings:
    """The knob of ``config``, its planner chosen (written back by the config hook; chosen
    here from the config's graph mode where it could not be written back)."""
    settings = parse_settings(getattr(config, "additional_config", None), os.environ)
    # Chooses only what is neither set nor already chosen (the planner, compress, the split).
    return choose_planner(
        settings, graph_mode(config), evidence_quantization(config), dtype=dtype_name(config)
    )


def dtype_name(config: Any) -> str | None:
    """The model's dtype as torch names it without ``torch.`` (``bfloat16``), None where the
    configuration has none yet."""
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def quantization_of(config: Any) -> str | None:
    """vLLM's quantization of the model (``None``: unquantized)."""
    return getattr(getattr(config, "model_config", None), "quantization", None)


def evidence_quantization(config: Any) -> str | None:
    """The model's quantization as the default planner's records name it: vLLM's, except
    that vLLM 0.25.0's ``fp8`` on a checkpoint without a quantization config of its own (a
    bf16 checkpoint quantized online, ``Fp8PerTensorOnlineMoEMethod``) is ``fp8_per_tensor``,
    the online shorthand that builds the same method in 0.25.0 and its only name in 0.33.0.
    Online per-tensor FP8 quantizes each kernel call's input with one scale, so a run of FP8
    checkpoints says nothing of it."""
    quantization = quantization_of(config)
    model = getattr(config, "model_config", None)
    arch = getattr(model, "model_arch_config", None)
    if quantization == "fp8" and getattr(arch, "quantization_config", None) is None:
        return "fp8_per_tensor"
    return quantization


def _record_choice(config: Any, settings: CacheSettings) -> None:
    """Write a default planner, a default split and a resolved ``compress: auto`` into
    ``additional_config`` (a new dict: the caller's is not changed); an ``additional_config``
    that is not a dict cannot carry them."""
    extra = getattr(config, "additional_config", None)
    records = {}
    if settings.planner_source == "default":
        records[PLANNER_CHOSEN] = chosen_record(settings)
    if settings.split_source == "default":
        records[SPLIT_CHOSEN] = split_record(settings)
    if settings.compress_source == "default":
        records[COMPRESS_CHOSEN] = compress_record(settings)
    if not records or not (extra is None or isinstance(extra, dict)):
        return
    extra = dict(extra or {})
    extra[CONFIG_SECTION] = {**(extra.get(CONFIG_SECTION) or {}), **records}
    config.additional_config = extra


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info(message)


def follow_vllm_logging() -> None:
    """Send the plugin's records through the handlers of vLLM's ``vllm`` logger, at its level.

    vLLM configures only its own logger tree (``vllm.logger.DEFAULT_LOGGING_CONFIG``); without
    this the plugin's INFO lines would reach only Python's last-resort handler, which drops
    them. Nothing changes where vLLM configured no handler or the plugin's logger has its own.
    """
    ours = logging.getLogger("rowcache.vllm")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


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
    offload = getattr(config, "offload_config", None)
    offloads = {
        "cpu_offload_gb": getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0),
        "offload_group_size": getattr(getattr(offload, "prefetch", None), "offload_group_size", 0),
    }
    offloading = {k: v for k, v in offloads.items() if v}
    if offloading:
        given = ", ".join(f"{k}={v}" for k, v in offloading.items())
        raise RowcacheError(
            f"rowcache: {what} does not support vLLM's weight offload ({given}): the cache "
            "holds every expert in pinned host memory already, and vLLM's offloader would "
            "move the layer's host tensors again. Turn one of them off (cpu_offload_gb=0 and "
            "offload_group_size=0, or size 0)."
        )
    if getattr(config, "lora_config", None) is not None:
        raise RowcacheError(
            f"rowcache: {what} does not support LoRA (--enable-lora): LoRA's MoE path reads "
            "the full expert weights on the GPU."
        )
    quantization = quantization_of(config)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise RowcacheError(
            f"rowcache: {what} does not support quantization {quantization!r} yet: its MoE "
            f"method is not one the cache serves. Supported: unquantized (bf16/fp16) experts, "
            f"and quantization {' or '.join(map(repr, QUANTIZATIONS))} with vLLM's "
            "Fp8MoEMethod for FP8 checkpoints with 128 x 128 block scales or "
            "Fp8PerTensorOnlineMoEMethod for online per-tensor FP8, on its TRITON FP8 MoE "
            "backend, and gpt-oss's MXFP4 experts on the TRITON_UNFUSED backend (each layer's "
            "method and backend are checked when the model is built)."
        )


GPT_OSS_QUANTIZATION = "gpt_oss_mxfp4"
GPT_OSS_BACKEND = "triton_unfused"
"""vLLM's MXFP4 MoE backend the cache serves gpt-oss on (``rowcache.vllm._mxfp4``): on Hopper
vLLM's own choice, ``triton``, routes inside the kernel from the router logits."""


def choose_gpt_oss_backend(config: Any, settings: CacheSettings) -> str | None:
    """For a gpt-oss engine with the cache on, vLLM's ``moe_backend`` set to the one the cache
    serves where it was ``auto``, saying so (the line returned); another value given is refused,
    naming it. None: nothing to do."""
    if not settings.cache_on or quantization_of(config) != GPT_OSS_QUANTIZATION:
        return None
    kernel: Any = getattr(config, "kernel_config", None)
    current = getattr(kernel, "moe_backend", None)
    if current is None or current == GPT_OSS_BACKEND:
        # Nothing to set (a vLLM without the setting: each layer's backend is checked when
        # its method is built, rowcache.vllm._mxfp4.adopt).
        return None
    if current != "auto":
        raise RowcacheError(
            f"rowcache: {SIZE}={settings.size} serves gpt-oss's MXFP4 experts on vLLM's "
            f"{GPT_OSS_BACKEND!r} MoE backend only, and moe_backend is {current!r}; allowed: "
            f"auto (the plugin sets {GPT_OSS_BACKEND!r}) or {GPT_OSS_BACKEND!r}"
        )
    kernel.moe_backend = GPT_OSS_BACKEND
    return (
        f"rowcache: moe_backend {GPT_OSS_BACKEND} for gpt-oss's MXFP4 experts (was auto: the "
        "expert cache serves that backend only)"
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
        # A bad knob value stops vLLM here; the planner is chosen once the graph mode is known.
        settings = parse_settings(getattr(self, "additional_config", None), os.environ)
        # method_ready may import vLLM's fused-MoE package (only for an engine that turns the
        # knob on, which builds a MoE model anyway); False: the warning is already logged.
        if not settings.active or not method_ready():
            original(self)
            return
        check_guards(self, settings)
        backend_line = choose_gpt_oss_backend(self, settings)
        original(self)
        if settings.cache_on:
            # The graph mode is vLLM's now; adjust_graphs follows the planner chosen for it.
            settings = choose_planner(
                settings, graph_mode(self), evidence_quantization(self), dtype=dtype_name(self)
            )
            _record_choice(self, settings)
        adjust_graphs(self, settings)
        # vLLM builds its config more than once per engine; say each line once per process.
        _say_once(f"rowcache: {settings.describe()}")
        if backend_line is not None:
            _say_once(backend_line)
        if settings.cache_on:
            _say_once(settings.planner_line())
            if (split := settings.split_line()) is not None:
                _say_once(split)
            if (compress := settings.compress_line()) is not None:
                _say_once(compress)

    setattr(__post_init__, _WRAPPED, True)
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __post_init__


def install(method_ready: Callable[[], bool]) -> bool:
    """Wrap ``VllmConfig.__post_init__``; False when it is already wrapped."""
    if getattr(VllmConfig.__post_init__, _WRAPPED, False):
        return False
    follow_vllm_logging()
    VllmConfig.__post_init__ = _wrap_post_init(VllmConfig.__post_init__, method_ready)
    return True

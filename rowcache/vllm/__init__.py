"""rowcache as a vLLM plugin: per-layer expert caching behind one knob.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process it
starts (``pip install rowcache[vllm]``). It is idempotent, cheap and never fatal: when vLLM or
one of the internals listed in ``rowcache.vllm.seams`` is missing, it logs one warning and vLLM
runs unchanged. The knob (``rowcache.vllm.knob``) decides per engine whether anything changes
(this ``vllm serve`` line is untested: the recorded runs build an ``LLM`` in Python):

    vllm serve MODEL --additional-config '{"rowcache": {"moe_expert_cache_size": 32,
        "moe_expert_cache_provider": "row", "moe_expert_cache_split": "token"}}'

Registration does two things, and only the first at once:

1. ``rowcache.vllm._config`` wraps ``VllmConfig.__post_init__`` (it imports only
   ``vllm.config``, which vLLM has imported before it loads plugins);
2. ``rowcache.vllm._method`` substitutes vLLM's unquantized MoE method. Importing it imports
   vLLM's fused-MoE modules (seconds), which a process that builds no MoE model (an API server
   front end, a model-inspection subprocess, a dense model) never needs. So it is installed
   when the package ``vllm.model_executor.layers.fused_moe`` has finished importing: at once if
   it already has, otherwise from a post-import hook (``rowcache.vllm._post_import``, on
   wrapt's), or when a configuration turns the knob on, whichever comes first.

This module imports no vLLM (CI runs without it).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, Literal

from rowcache.vllm._post_import import call_after_import, fully_imported
from rowcache.vllm.knob import CacheSettings, KnobError, parse_settings

__all__ = [
    "CacheSettings",
    "KnobError",
    "expert_cache_counter_problems",
    "expert_cache_slot_check",
    "expert_cache_stats",
    "parse_settings",
    "register",
]

logger = logging.getLogger("rowcache.vllm")

FUSED_MOE = "vllm.model_executor.layers.fused_moe"
"""The package after whose import the MoE method is substituted (a seam)."""

MethodState = Literal["pending", "installed", "failed"]


class _State:
    registered = False
    method: MethodState = "pending"


_state = _State()


def _warn(exc: BaseException) -> None:
    logger.warning(
        "rowcache: vLLM plugin not installed, vLLM runs without the expert cache (%s: %s)",
        type(exc).__name__,
        exc,
    )


def _install_method() -> None:
    """Substitute the MoE method once; never raises (vLLM may be in the middle of an import)."""
    if _state.method != "pending":
        return
    try:
        from rowcache.vllm._method import install
        from rowcache.vllm._quantized import install as install_quantized

        install()
        # Every MoE layer gets its method through RoutedExperts._get_quant_method: the FP8
        # methods the cache serves are taken over there, other quantized ones rejected.
        install_quantized()
    except Exception as exc:
        _state.method = "failed"
        _warn(exc)
        return
    _state.method = "installed"


def _method_ready() -> bool:
    """Whether the MoE method is substituted, installing it first if it is still waiting.

    Called by the config hook for an engine that turns the knob on: its configuration is
    adjusted only if the substitution is in place (see ``rowcache.vllm._config``).
    """
    if _state.method == "pending":
        try:
            # Runs _install_method through the post-import hook if the package is new.
            importlib.import_module(FUSED_MOE)
        except Exception as exc:
            _state.method = "failed"
            _warn(exc)
            return False
        # Partially imported: a configuration built from inside the package's own import;
        # the hook installs the method when the package finishes.
        if fully_imported(FUSED_MOE):
            _install_method()
    return _state.method == "installed"


def _install() -> bool:
    from rowcache.vllm._config import install as install_config_hook

    hooked = install_config_hook(_method_ready)
    if call_after_import(FUSED_MOE, _install_method):
        logger.debug("rowcache: %s already imported; MoE method substituted at once", FUSED_MOE)
    return hooked


def register(installer: Callable[[], bool] | None = None) -> None:
    """The ``vllm.general_plugins`` entry point; safe to call any number of times.

    ``installer`` is for tests; vLLM calls it without arguments.
    """
    if _state.registered:
        return
    _state.registered = True
    try:
        installed = (installer or _install)()
    except Exception as exc:
        if _state.method == "pending":
            _state.method = "failed"
        _warn(exc)
        return
    if installed:
        logger.debug("rowcache: vLLM config hook installed")


def expert_cache_slot_check(model: Any) -> dict[str, Any]:
    """Every cached MoE layer's resident slots against their host bytes (for
    ``LLM.apply_model`` after a generation: the engine is idle, and this waits for the
    device first): how many layers and slots were checked, and each mismatch by layer."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    layers = slots = 0
    mismatches: list[str] = []
    for name, module in model.named_modules():
        provider = getattr(getattr(module, "quant_method", None), "rowcache_provider", None)
        if provider is None:
            continue
        resident = provider.resident_experts()
        layers += 1
        slots += len(resident)
        mismatches += [f"{name}: {m}" for m in provider.slot_mismatches(resident)]
    return {"layers": layers, "slots": slots, "mismatches": mismatches}


def expert_cache_stats(model: Any) -> list[dict[str, Any]]:
    """Provider stats of every cached MoE layer of ``model`` (for ``LLM.apply_model``)."""
    found: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        provider = getattr(method, "rowcache_provider", None)
        if provider is None:
            continue
        stats: dict[str, Any] = dict(provider.stats())
        stats["layer"] = name
        stats["provider"] = type(provider).__name__
        stats["split"] = provider.split
        stats["forwards"] = int(getattr(method, "rowcache_forwards", 0))
        found.append(stats)
    return found


def expert_cache_counter_problems(stats: list[dict[str, Any]]) -> list[str]:
    """What is inconsistent in ``expert_cache_stats``' counters (empty: nothing).

    A cache starts empty, every miss fills a slot, every eviction and every invalidation of a
    resident expert empties one: ``resident == misses - evictions - invalidations``, and never
    more than ``capacity`` nor fewer than none. A counter lost or counted twice under load
    (aborted requests, preemption, steps larger than the cache) breaks the first.
    """
    problems: list[str] = []
    for entry in stats:
        layer = entry.get("layer", "?")
        try:
            hits, misses, evictions, invalidations, resident, capacity = (
                int(entry[key])
                for key in ("hits", "misses", "evictions", "invalidations", "resident", "capacity")
            )
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"{layer}: counters unreadable ({type(exc).__name__}: {exc})")
            continue
        if min(hits, misses, evictions, invalidations) < 0:
            problems.append(f"{layer}: a negative counter in {entry}")
        if not 0 <= resident <= capacity:
            problems.append(f"{layer}: resident={resident} outside [0, capacity={capacity}]")
        if resident != misses - evictions - invalidations:
            problems.append(
                f"{layer}: resident={resident} but misses - evictions - invalidations = "
                f"{misses} - {evictions} - {invalidations} = {misses - evictions - invalidations}"
            )
    return problems

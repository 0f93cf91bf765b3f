"""rowcache as a vLLM plugin: per-layer expert caching behind one knob.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process it
starts (``pip install rowcache[vllm]``). It is idempotent, cheap and never fatal: when vLLM or
one of the internals listed in ``rowcache.vllm.seams`` is missing, it logs one warning and vLLM
runs unchanged. The knob (``rowcache.vllm.knob``) decides per engine whether anything changes:

    vllm serve MODEL --additional-config '{"rowcache": {"moe_expert_cache_size": 32,
        "moe_expert_cache_provider": "row", "moe_expert_cache_split": "token"}}'

This module imports no vLLM (CI runs without it); the vLLM code is in ``_plugin``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rowcache.vllm.knob import CacheSettings, KnobError, parse_settings

__all__ = ["CacheSettings", "KnobError", "expert_cache_stats", "parse_settings", "register"]

logger = logging.getLogger("rowcache.vllm")

_state: dict[str, bool] = {"done": False}


def _install() -> bool:
    from rowcache.vllm._plugin import install

    return install()


def register(installer: Callable[[], bool] | None = None) -> None:
    """The ``vllm.general_plugins`` entry point; safe to call any number of times.

    ``installer`` is for tests; vLLM calls it without arguments.
    """
    if _state["done"]:
        return
    _state["done"] = True
    try:
        installed = (installer or _install)()
    except Exception as exc:
        logger.warning(
            "rowcache: vLLM plugin not installed, vLLM runs without the expert cache (%s: %s)",
            type(exc).__name__,
            exc,
        )
        return
    if installed:
        logger.debug("rowcache: vLLM plugin installed")


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

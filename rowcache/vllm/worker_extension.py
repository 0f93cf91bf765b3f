"""Read a running server's expert cache from outside: a vLLM worker extension.

``vllm serve MODEL --worker-extension-cls rowcache.vllm.worker_extension.ExpertCacheRpc`` adds
three methods to every GPU worker, which vLLM's ``collective_rpc`` reaches (from Python,
``LLM.collective_rpc``; from a server started with ``VLLM_SERVER_DEV_MODE=1``, ``POST
/collective_rpc`` with ``{"method": "rowcache_stats"}``):

* ``rowcache_stats``: every cached MoE layer's counters (``rowcache.vllm.expert_cache_stats``);
* ``rowcache_slot_check``: every resident slot's bytes against the expert's host bytes
  (``rowcache.vllm.expert_cache_slot_check``; waits for the device first);
* ``rowcache_pinned``: the pinned host memory the worker holds (``rowcache.pinned.pinned_memory``:
  torch's caching host allocator's blocks, the arenas' slabs among them), for a soak to tell
  growth; it answers with or without the cache.

vLLM runs a ``collective_rpc`` between engine steps, so both read a cache that no forward is
using. vLLM mixes the class into its worker class and refuses one whose attribute names clash
with the worker's own, hence the ``rowcache_`` prefix. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from rowcache.pinned import pinned_memory
from rowcache.vllm import expert_cache_slot_check, expert_cache_stats

QUALNAME = "rowcache.vllm.worker_extension.ExpertCacheRpc"
"""What ``--worker-extension-cls`` takes."""


class ExpertCacheRpc:
    """Mixed into vLLM's GPU worker (which has ``model_runner.get_model()``)."""

    model_runner: Any

    def rowcache_stats(self) -> list[dict[str, Any]]:
        return expert_cache_stats(self.model_runner.get_model())

    def rowcache_slot_check(self) -> dict[str, Any]:
        return expert_cache_slot_check(self.model_runner.get_model())

    def rowcache_pinned(self) -> dict[str, int | None]:
        return pinned_memory()

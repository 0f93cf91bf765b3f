"""Functions an engine runs where its model is, through ``llm.apply_model(fn)``.

In a multi-process engine they run in the engine-core process (vLLM pickles the function
there, by reference to this module, and the result back), so this module imports nothing
beyond the standard library at import time.
"""

from __future__ import annotations

import os
from typing import Any


def probe(model: Any) -> dict[str, Any]:
    """GPU memory and where the expert weights live."""
    import torch

    from rowcache.vllm import expert_cache_stats

    expert_param_bytes = 0
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "w13_weight"):
            continue
        if getattr(method, "rowcache_provider", None) is not None:
            continue  # host-backed (device views of pinned memory): no GPU memory
        for pname in ("w13_weight", "w2_weight"):
            p = getattr(module, pname, None)
            if p is not None and p.is_cuda:
                expert_param_bytes += p.numel() * p.element_size()
    stats = expert_cache_stats(model)
    slot_bytes = sum(int(s["slot_bytes"]) for s in stats)
    host_bytes = sum(int(s["host_bytes"]) for s in stats)
    return {
        "pid": os.getpid(),
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "expert_gpu_bytes": expert_param_bytes + slot_bytes,
        "expert_host_bytes": host_bytes,
        "cached_layers": len(stats),
        "method": sorted(
            {
                type(getattr(m, "quant_method", None)).__name__
                for _n, m in model.named_modules()
                if hasattr(m, "w13_weight")
            }
        ),
    }


def identity_expert_map(model: Any) -> int:
    """Give every MoE layer without a cache the identity expert_map.

    vLLM then calls the same Triton path as a cached layer (expert ids mapped through a map),
    so a no-cache run and a cache run differ only by where the weights come from.
    """
    import torch

    count = 0
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (
            method is None
            or not hasattr(module, "w13_weight")
            or not hasattr(module, "_expert_map")
        ):
            continue
        if getattr(method, "rowcache_provider", None) is not None:
            continue
        experts = int(module.global_num_experts)
        module._expert_map = torch.arange(
            experts, dtype=torch.int32, device=module.w13_weight.device
        )
        count += 1
    return count


def stats(model: Any) -> list[dict[str, Any]]:
    """The provider stats of every cached layer."""
    from rowcache.vllm import expert_cache_stats

    return expert_cache_stats(model)


def first_moe_method(model: Any) -> Any:
    """The first MoE layer's method (an object: in-process engines only)."""
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(module, "w13_weight"):
            return method
    raise RuntimeError("no MoE layer with w13_weight found")
